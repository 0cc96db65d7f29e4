"""Worker program for the `tandem run --recover in-memory` tests: `python recover_worker.py MODE
[ARGS]`.

Torch is used for the job's store only (a TCPStore client at MASTER_ADDR:MASTER_PORT, which
the launcher hosts), except in `init`, which calls tandem.init() over it.

- `kill VICTIM [REPORT]`: every rank prints its environment and READY; rank VICTIM then
  SIGKILLs itself; every other rank waits for the launcher's `tandem/recover/dead/VICTIM` key,
  prints it, writes and reads a key of its own (the store outlived VICTIM, rank 0 included) and
  exits 0 (under the default `restart`, where there is no launcher's store, the others just
  wait to be stopped). With REPORT, the lowest survivor writes a tandem-recovery-*.json as a
  recovering worker would (step 7 redone by the survivors).
- `fail_all`: every rank prints READY and exits 3.
- `init VICTIM`: tandem.init() (Gloo) over the launcher's store, one all-reduce, then rank VICTIM
  SIGKILLs itself; the others read its dead key and use the store tandem.init met in.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
MODE = sys.argv[1]
ARGS = sys.argv[2:]
WAIT_S = 30.0


def dead_key(rank: int) -> str:
    from tandem.launch.in_memory import dead_key as key

    return key(rank)


def connect():
    from torch.distributed import TCPStore

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return TCPStore(addr, port, None, False, timedelta(seconds=WAIT_S))


def wait_for(store, key: str) -> dict:
    deadline = time.monotonic() + WAIT_S
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {RANK}: no {key} within {WAIT_S} s")
        time.sleep(0.01)
    return json.loads(store.get(key))


def say(text: str) -> None:
    print(text, flush=True)


if MODE == "kill":
    victim = int(ARGS[0])
    names = ("TANDEM_RECOVER", "TORCHELASTIC_USE_AGENT_STORE", "TANDEM_RDZV_ROUND")
    say("ENV " + json.dumps({n: os.environ.get(n) for n in names}))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        say(f"READY rank {RANK}")
        if victim == RANK:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
        raise SystemExit("not stopped")
    store = connect()
    say(f"READY rank {RANK}")
    if victim == RANK:
        os.kill(os.getpid(), signal.SIGKILL)
    seen = wait_for(store, dead_key(victim))
    noticed = time.time()
    say("SAW " + json.dumps(seen))
    store.set(f"test/alive/{RANK}", str(RANK))
    say(f"ALIVE {store.get(f'test/alive/{RANK}').decode()}")
    survivors = [r for r in range(WORLD) if r != victim]
    if len(ARGS) > 1 and survivors[0] == RANK:
        report = {
            "generation": 1,
            "lost": [victim],
            "members": survivors,
            "detected_s": noticed - seen["at"],
            "step": 7,
            "recovered_s": 0.94,
            "run_id": os.environ["TORCHELASTIC_RUN_ID"],
        }
        path = os.path.join(os.environ["TANDEM_REPORT_DIR"], f"tandem-recovery-g1-r{RANK}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(report, f)
        os.replace(path + ".tmp", path)
    say(f"DONE rank {RANK}")
elif MODE == "fail_all":
    say(f"READY rank {RANK}")
    time.sleep(0.2 * RANK)
    sys.exit(3)
elif MODE == "init":
    import torch
    import torch.distributed as dist

    import tandem
    from tandem.job import checkin

    victim = int(ARGS[0])
    w = tandem.init(backend="gloo")
    t = torch.tensor([float(w.rank)])
    dist.all_reduce(t)
    say(f"SUM {t.item()} RANK {w.rank}")
    dist.barrier()
    if victim == RANK:
        os.kill(os.getpid(), signal.SIGKILL)
    seen = wait_for(connect(), dead_key(victim))
    say("SAW " + json.dumps(seen))
    checkin.joined.set(f"after/{RANK}", "ok")  # the store tandem.init met in, after the loss
    say(f"ALIVE {checkin.joined.get(f'after/{RANK}').decode()}")
    sys.stdout.flush()
    os._exit(0)  # the group has a dead member: no teardown collective
else:
    raise SystemExit(f"unknown mode {MODE}")
