"""Worker program for the `tandem run --recover in-memory` tests: `python recover_worker.py MODE
[ARGS]`.

Torch is used for the job's store only (a TCPStore client at MASTER_ADDR:MASTER_PORT, which
the launcher hosts), except in `init`, which calls tandem.init() over it.

Every rank first says under `tandem/recover/able/<rank>` whether it recovers in memory, as
tandem.recovery does: "1" unless `TEST_ABLE` (a JSON list, one entry per rank) gives it another
value, or null for nothing at all (a plain script).

- `kill VICTIM [REPORT]`: every rank prints its environment and READY; rank VICTIM then (once
  every rank is ready) SIGKILLs itself; every other rank waits for the launcher's
  `tandem/recover/dead/VICTIM` key, prints it, writes and reads a key of its own (the store
  outlived VICTIM, rank 0 included) and exits 0 (under the default `restart`, where there is
  no launcher's store, the others just wait to be stopped). With REPORT, the lowest survivor
  writes a tandem-recovery-*.json as a recovering worker would (step 7 redone by the
  survivors). Restarted (TORCHELASTIC_RESTART_COUNT > 0), every rank prints FRESH if the
  store holds no key of the attempt before (else STALE) and says "1" whatever TEST_ABLE says;
  then nobody is killed (every rank prints DONE), unless `TEST_KILL_AGAIN` is set: then rank
  VICTIM dies again as above.
- `fail_all`: once every rank has said it recovers in memory, every rank prints READY and exits
  3 (rank r after 0.2 r s).
- `init VICTIM`: tandem.init() (Gloo) over the launcher's store, one all-reduce, then rank VICTIM
  SIGKILLs itself; the others read its dead key and use the store tandem.init met in.

With `TEST_ADMITS` set, a rank that says "1" also says it admits replacements (as
tandem.recovery.Run does). A replacement (`TANDEM_RECOVER_JOIN` set, `--max-restarts` under
in-memory) prints JOINING and waits, as tandem.init waits to be admitted: these workers never
admit one.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta

if os.environ.get("TANDEM_RECOVER_JOIN"):  # a replacement: waits to be admitted, as
    print("JOINING", flush=True)  # tandem.init does; these workers never admit one
    time.sleep(120)
    sys.exit(0)

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
MODE = sys.argv[1]
ARGS = sys.argv[2:]
WAIT_S = 30.0


def dead_key(rank: int) -> str:
    from tandem.launch.in_memory import dead_key as key

    return key(rank)


def able_key(rank: int) -> str:
    from tandem.launch.in_memory import able_key as key

    return key(rank)


def say_able(store) -> None:
    """Set this rank's able key as TEST_ABLE says ("1" by default; null: nothing)."""
    said = json.loads(os.environ.get("TEST_ABLE", "null")) or ["1"] * WORLD
    if RESTART:  # restarted, every rank recovers in memory
        said = ["1"] * WORLD
    if said[RANK] is not None:
        store.set(able_key(RANK), said[RANK])
    if said[RANK] == "1" and os.environ.get("TEST_ADMITS"):  # says it admits replacements
        from tandem.launch.in_memory import admits_key

        store.set(admits_key(RANK), "1")


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
    names += ("TORCHELASTIC_RESTART_COUNT", "MASTER_PORT")
    say("ENV " + json.dumps({n: os.environ.get(n) for n in names}))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        say(f"READY rank {RANK}")
        if victim == RANK:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
        raise SystemExit("not stopped")
    store = connect()
    if RESTART:
        # Keys only the attempt before set (this attempt's ranks set their able keys now).
        before = [f"test/attempt/{RESTART - 1}/{r}" for r in range(WORLD)] + [dead_key(victim)]
        stale = [key for key in before if store.check([key])]
        say(f"STALE {stale}" if stale else "FRESH")
        if not os.environ.get("TEST_KILL_AGAIN"):
            say(f"READY rank {RANK}")
            say(f"DONE rank {RANK}")
            raise SystemExit(0)
    say_able(store)
    store.set(f"test/attempt/{RESTART}/{RANK}", "1")
    say(f"READY rank {RANK}")
    if victim == RANK:
        for r in range(WORLD):  # every rank has said whether it recovers in memory
            wait_for(store, f"test/attempt/{RESTART}/{r}")
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
    store = connect()
    say_able(store)
    store.set(f"test/attempt/{RESTART}/{RANK}", "1")
    for r in range(WORLD):  # every rank has said it recovers in memory: the losses are its
        wait_for(store, f"test/attempt/{RESTART}/{r}")
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
    say_able(connect())
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
