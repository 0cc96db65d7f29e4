"""Worker programs for the launcher tests: `python workers.py MODE [ARGS]`.

Most modes import no torch, so that the tests measure the launcher, not torch's import time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

RANK = int(os.environ.get("RANK", "-1"))
MODE = sys.argv[1]
ARGS = sys.argv[2:]

if MODE == "env":
    names = [
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "NODE_RANK",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_RUN_ID",
        "OMP_NUM_THREADS",
    ]
    found = {n: os.environ.get(n) for n in names}
    print("ENV " + json.dumps(found))
    if "ENV_OUT" in os.environ:  # torchrun interleaves its workers' unprefixed output
        with open(os.path.join(os.environ["ENV_OUT"], f"rank{RANK}.json"), "w") as f:
            json.dump(found, f)
elif MODE == "fail":  # fail on rank ARGS[0]; the others wait long enough to be stopped
    if int(ARGS[0]) == RANK:
        time.sleep(0.5)
        raise ValueError(f"boom on rank {RANK}")
    time.sleep(60)
elif MODE == "kill9":
    if int(ARGS[0]) == RANK:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
elif MODE == "linger":  # a child of its own (like a DataLoader worker), then wait for signals
    token = ARGS[0]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", token])
    signal.signal(signal.SIGUSR1, lambda *a: print(f"USR1 on rank {RANK}", flush=True))
    print(f"READY rank {RANK} child {child.pid}", flush=True)
    time.sleep(120)
elif MODE == "slow_stop":  # on SIGTERM, take a few seconds to finish (a checkpoint being saved)

    def save_and_leave(*_: object) -> None:
        time.sleep(float(ARGS[0]))
        print(f"SAVED rank {RANK}", flush=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, save_and_leave)
    print(f"READY rank {RANK}", flush=True)
    time.sleep(120)
elif MODE == "restart":  # fail in the first attempt only
    count = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print(f"ATTEMPT {count} PORT {os.environ['MASTER_PORT']}", flush=True)
    if count == 0 and RANK == 1:
        sys.exit(3)
    if count == 0:
        time.sleep(60)
elif MODE == "torchrun_script":  # an unmodified torchrun-style script
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    print(f"SUM {t.item()} WORLD {dist.get_world_size()} RANK {dist.get_rank()}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
else:
    raise SystemExit(f"unknown mode {MODE}")
