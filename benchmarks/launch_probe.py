"""The trivial worker that benchmarks/launch.py starts under each launcher.

It records three wall-clock moments (``time.time()``, comparable across processes on one
machine) and writes them to ``$TANDEM_BENCH_OUT/rank<RANK>.json``:

- ``started``: the first line of this script, before torch is imported: what the launcher and
  the interpreter's own start-up cost;
- ``imported``: after ``import torch.distributed``;
- ``init``: right after ``tandem.init(backend="gloo")`` (or, with TANDEM_PROBE_INIT=torch,
  plain ``init_process_group("gloo")``) returns, which is the moment the issue measures to.

Then one barrier, so that no rank tears down while a peer is still connecting, and exit. Both
launchers run exactly the same worker either way.
"""

import time

started = time.time()  # before any import that costs: the worker's interpreter is up

import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

import torch.distributed as dist  # noqa: E402

imported = time.time()
if os.environ.get("TANDEM_PROBE_INIT", "tandem") == "tandem":
    import tandem

    tandem.init(backend="gloo")
else:
    dist.init_process_group("gloo")
init = time.time()
rank = dist.get_rank()
dist.barrier()
dist.destroy_process_group()
record = {"rank": rank, "started": started, "imported": imported, "init": init}
Path(os.environ["TANDEM_BENCH_OUT"], f"rank{rank}.json").write_text(json.dumps(record))
