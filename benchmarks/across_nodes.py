"""Hybrid sharding on a slow link between two nodes: step time, bytes on the wire, memory.

Two "nodes" on one machine: two network namespaces joined by a veth pair
(``tests/launch/netns.py``), one ``tandem run --nnodes 2 --nproc-per-node 2 --node-rank i`` in
each, four ranks on Gloo. The link between the nodes is shaped with ``tc`` on both veth ends
(each direction): ``netem`` with ``--delay-ms`` and ``--rate-mbit`` where the ``sch_netem``
module exists, else ``tbf`` at ``--rate-mbit`` with no added delay (the JSON's ``link`` says
which, and why). The two ranks of a node talk over the namespace's loopback, left unshaped.

The model is ``benchmarks/sharded_contenders.py``'s: ``--blocks`` residual MLP blocks of width
``--width`` and a 10-way head (4.2 M parameters at the defaults), each block its own unit,
float32, AdamW. One process per rank builds every mode from the same seed:

- ``full``: ``FullyShardedDataParallel`` over the 4 ranks (stage 3);
- ``hybrid``: ``hybrid=True``: sharded within the node, replicated across the two;
- ``hpz``: full sharding over 4 with ``reshard_after_forward=2`` (a unit stays sharded over
  the node's 2 ranks between its forward and its backward, so the backward's all-gather stays
  in the node: ZeRO++'s hpZ). ``hybrid`` with ``reshard_after_forward=2`` is ``hybrid`` itself
  at 2 ranks per node (the node is the shard group, so 2 means ``True``); ask for it with
  ``--modes hybrid-raf2``;
- ``ddp``: ``tandem.DDP``;
- ``ddp-hybrid``: ``tandem.DDP(hybrid=True)``: each gradient bucket reduce-scattered in the
  node, its half all-reduced with the peer on the other node, all-gathered in the node.

After ``--warmup`` steps of each, the modes take turns (A B C D A B C D ...) for ``--rounds``
rounds of ``--steps`` steps. A mode's turn starts and ends at a barrier; rank 0 reads its veth's
counters (``/proc/net/dev`` in its namespace: tx is node 0 to node 1, rx the other way) at both
ends, and every rank reads ``tandem.doctor``'s bytes handed per group
(``step_clock.handed_so_far``). A step's time is the slowest rank's; reported per mode: the
median step, its ratio to ``full``, the bytes handed per step per group (rank 0's), and the bytes
on the link per step against the formula.

**The link formula.** Gloo's collectives here are rings in group rank order: on a ring of the
4 ranks ``0 1 2 3`` two of its four hops (1-2 and 3-0) cross the link, and a ring all-gather of
``n`` elements sends ``(N - 1) n`` in all, so ``1.5 n`` cross; a ring all-reduce (a
reduce-scatter then an all-gather) twice that, ``3 n``. torch's Gloo backend reduce-scatters by
all-reducing the whole tensor and keeping the slice, so a reduce-scatter costs ``3 n`` too (the
counters agree to 0.1%; ``1.5 n`` would be off by a third). With ``p`` a unit's padded elements
(4 bytes each):

- ``full``: per step, every unit gathered in forward, every unit but the root and the last
  block gathered again in backward (those two are kept: their backward comes first), every
  gradient reduce-scattered: ``4 x (1.5 x (2 sum p - p_root - p_last) + 3 sum p)``, about
  ``5.8 x`` the parameter bytes at the defaults (each direction half);
- ``hpz``: the backward's gathers stay in the node: ``4 x (1.5 sum p + 3 sum p)``;
- ``hybrid``: only the all-reduce of each rank's gradient slice (``p / 2``) with its peer on the
  other node, a ring of 2 sending ``p / 2`` each way: ``4 x 2 sum p`` for the two pairs, about
  ``2 x`` the parameter bytes;
- ``ddp``: one ring all-reduce of every gradient over 4: ``4 x 3 P`` (``P`` unpadded);
- ``ddp-hybrid``: as ``hybrid``, over the buckets: ``4 x 2 sum b`` (``b`` a bucket's elements
  padded to even), about ``2 x`` the parameter bytes, plus the end-of-backward check's 4 bytes
  over the 4 ranks.

The counters count Ethernet frames: TCP/IP headers and ACKs on top of the payload, and the
barriers and the store's few messages. So the payload is also given as the bytes less 66 per
packet (14 Ethernet + 20 IPv4 + 32 TCP with timestamps; an ACK is exactly that), and both
are compared with the formula; the target (issue 28) is within 5%.

**Memory**, per rank, after the last turn of each mode, at rest after ``optimizer.step()``
(gradients still held): parameters + gradients + AdamW's moments held
(``sharded_contenders.held_bytes``), against float32 formulas: DDP ``16P``; ``full`` and
``hpz`` ``16P/4``; ``hybrid`` ``16P/2`` (the node's half of every unit; padding is the excess).

Every namespace and process is removed after the run, whatever happened (the launchers run in
sessions of their own and are killed with their workers). Without root, iproute2 or namespaces,
or without ``tc``'s ``tbf`` while ``--rate-mbit`` asks for shaping, the script says why and
exits 0 with ``skipped`` in its JSON.

Run (as root)::

    python benchmarks/across_nodes.py                      # ~2 min here; docs/performance JSON
    python benchmarks/across_nodes.py --rate-mbit 100 --delay-ms 5 --blocks 4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
JSON_DEFAULT = ROOT / "docs" / "performance" / "across-nodes-cpu.json"
MODES = ("full", "hybrid", "hpz", "ddp", "ddp-hybrid")
EXTRA_MODES = ("hybrid-raf2",)
NNODES, PER_NODE = 2, 2
WORLD = NNODES * PER_NODE
MASTER_PORT = 29400  # node 0's namespace is new: no one holds it
HEADER_BYTES = 66  # Ethernet 14 + IPv4 20 + TCP 20 + timestamps 12 per frame
F32 = 4
TOLERANCE = 0.05
TARGET_SPEEDUP = 2.0


# -- in each rank --------------------------------------------------------------------------------


def _link_counters() -> dict[str, int]:
    """This namespace's veth counters (``GLOO_SOCKET_IFNAME``) from /proc/net/dev."""
    name = os.environ["GLOO_SOCKET_IFNAME"]
    for line in Path("/proc/net/dev").read_text().splitlines():
        head, _, rest = line.partition(":")
        if head.strip() == name:
            f = [int(v) for v in rest.split()]
            return {"rx_bytes": f[0], "rx_packets": f[1], "tx_bytes": f[8], "tx_packets": f[9]}
    raise RuntimeError(f"{name} not in /proc/net/dev")


def _build(mode: str, args: argparse.Namespace):
    import torch

    import tandem
    from sharded_contenders import LR, Block, make_net

    net = make_net(args)
    if mode in ("ddp", "ddp-hybrid"):
        model = tandem.DDP(net, hybrid=mode == "ddp-hybrid")
    else:
        kwargs: dict[str, Any] = {"auto_wrap": {Block}}
        if mode in ("hybrid", "hybrid-raf2"):
            kwargs["hybrid"] = True
        if mode in ("hpz", "hybrid-raf2"):
            kwargs["reshard_after_forward"] = 2
        model = tandem.FullyShardedDataParallel(net, **kwargs)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def _link_formula(mode: str, model, params: int) -> int:
    """Bytes across the link per step, both directions (see the module docstring)."""
    if mode == "ddp":
        return int(F32 * 3 * params)
    if mode == "ddp-hybrid":
        buckets = [b.flat.numel() for b in model.reducer.buckets]
        return F32 * 2 * sum(-(-n // 2) * 2 for n in buckets) + 3 * 4  # + the check's ring
    padded = [u.padded for u in model.units]
    if mode in ("hybrid", "hybrid-raf2"):
        return F32 * 2 * sum(padded)
    # Units are in construction order, the root last: the root and the last block are kept
    # from the forward for the backward. hpz's backward gathers stay within the node.
    backward = 0 if mode == "hpz" else sum(padded) - padded[-1] - padded[-2]
    gathers = sum(padded) + backward  # 1.5 n across each
    return int(F32 * (1.5 * gathers + 3 * sum(padded)))  # a reduce-scatter: 3 n (all-reduce)


def _memory_formula(mode: str, params: int) -> float:
    return {
        "ddp": 16 * params,
        "ddp-hybrid": 16 * params,
        "hybrid": 8 * params,
        "hybrid-raf2": 8 * params,
    }.get(mode, 4 * params)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import tandem
    from sharded_contenders import Contender, batches, held_bytes, make_net
    from tandem.doctor import records, step_clock

    torch.set_num_threads(1)
    tandem.init()
    rank = dist.get_rank()
    params = sum(p.numel() for p in make_net(args).parameters())
    built = {mode: _build(mode, args) for mode in args.modes}
    data = batches(args, rank, args.warmup + args.rounds * args.steps)

    def step(mode: str, x, y) -> float:
        model, opt = built[mode]
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        return time.perf_counter() - start

    for mode in args.modes:
        for x, y in data[: args.warmup]:
            step(mode, x, y)
    times: dict[str, list[float]] = {m: [] for m in args.modes}
    link: dict[str, list[dict[str, int]]] = {m: [] for m in args.modes}
    handed: dict[str, list[dict[str, int]]] = {m: [] for m in args.modes}
    for r in range(args.rounds):
        chunk = data[args.warmup + r * args.steps :][: args.steps]
        for mode in args.modes:
            dist.barrier()
            counters, before = _link_counters(), step_clock.handed_so_far()
            mine = [step(mode, x, y) for x, y in chunk]
            dist.barrier()
            after, counters_after = step_clock.handed_so_far(), _link_counters()
            slowest = torch.tensor(mine, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times[mode] += slowest.tolist()
            link[mode].append({k: counters_after[k] - v for k, v in counters.items()})
            handed[mode].append({g: n - before.get(g, 0) for g, n in after.items()
                                 if n != before.get(g, 0)})  # fmt: skip
    out: dict[str, Any] = {"params": params, "modes": {}}
    for mode in args.modes:
        model, opt = built[mode]
        held = held_bytes(Contender(mode, model, opt, lambda: None))
        rows = [None] * WORLD
        dist.all_gather_object(rows, {k: held[k] for k in ("params", "grads", "state")})
        groups = {"world": records.group_name(None)}
        if mode == "ddp-hybrid":
            groups["node"] = records.group_name(model.shard_group)
            groups["across"] = records.group_name(model.replicate_group)
        elif mode != "ddp":
            if model.world_size < WORLD:
                groups["node"] = records.group_name(model.process_group)
            if model.replicate_group is not None:
                groups["across"] = records.group_name(model.replicate_group)
            post = model.units[0].post_forward
            if post is not None:
                groups["node (post-forward)"] = records.group_name(post.group)
        out["modes"][mode] = {
            "step_s": times[mode],
            "link": link[mode],
            "handed_rank0": handed[mode],
            "groups": groups,
            "link_formula": _link_formula(mode, model, params),
            "memory_per_rank": rows,
            "memory_formula": _memory_formula(mode, params),
            "padded": None if mode.startswith("ddp") else [u.padded for u in model.units],
        }
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


# -- the launcher side ---------------------------------------------------------------------------


def _tc(node, *words: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(node.exec(["tc", *words]), capture_output=True, text=True,
                          timeout=30, check=False)  # fmt: skip


def _shape(nodes, args: argparse.Namespace) -> dict[str, Any]:
    """Shape both veth ends (each direction); what was applied, and why not netem if not."""
    if args.rate_mbit <= 0 and args.delay_ms <= 0:
        return {"qdisc": None, "note": "unshaped"}
    note = ""
    if args.delay_ms > 0:
        words = ["netem", "delay", f"{args.delay_ms}ms", "limit", "100000"]
        if args.rate_mbit > 0:
            words += ["rate", f"{args.rate_mbit}mbit"]
        done = _tc(nodes[0], "qdisc", "add", "dev", nodes[0].interface, "root", *words)
        if done.returncode == 0:
            _tc(nodes[0], "qdisc", "del", "dev", nodes[0].interface, "root")
            return {**_apply(nodes, words, ""), "delay_ms_applied": args.delay_ms}
        note = (f"netem unavailable ({done.stderr.strip()}: no sch_netem module in this kernel, "
                f"and it cannot be loaded here), so no delay was added; ")  # fmt: skip
        if args.rate_mbit <= 0:
            raise _Skip(note + "and no --rate-mbit to shape with tbf instead")
    # A burst of 256 KB lets TCP's GSO segments through whole; a queue of 1 s of traffic drops
    # nothing (a drop would be retransmitted and counted twice on the wire).
    words = ["tbf", "rate", f"{args.rate_mbit}mbit", "burst", "256kb", "latency", "1000ms"]
    return {**_apply(nodes, words, note + "rate only, tbf"), "delay_ms_applied": 0}


def _apply(nodes, words: list[str], note: str) -> dict[str, Any]:
    for node in nodes:
        done = _tc(node, "qdisc", "add", "dev", node.interface, "root", *words)
        if done.returncode != 0:
            raise _Skip(f"`tc qdisc add ... {' '.join(words)}` failed: {done.stderr.strip()}")
    return {"qdisc": " ".join(words), "note": note}


class _Skip(Exception):
    pass


def _launch(nodes, args: argparse.Namespace, out: Path, logs: Path) -> None:
    from tests.launch.test_multinode_netns import _env

    worker_args = ["--worker", "--out", str(out), "--width", str(args.width),
                   "--blocks", str(args.blocks), "--batch", str(args.batch),
                   "--warmup", str(args.warmup), "--rounds", str(args.rounds),
                   "--steps", str(args.steps), "--modes", *args.modes]  # fmt: skip
    started = []
    try:
        for node_rank, node in enumerate(nodes):
            command = node.exec([sys.executable, "-m", "tandem.cli", "run",
                                 "--nnodes", str(NNODES), "--node-rank", str(node_rank),
                                 "--nproc-per-node", str(PER_NODE),
                                 "--master-addr", nodes[0].address,
                                 "--master-port", str(MASTER_PORT),
                                 str(Path(__file__).resolve()), *worker_args])  # fmt: skip
            env = _env(node)
            env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT)])
            with (logs / f"node{node_rank}.log").open("w") as sink:
                started.append(subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                                env=env, start_new_session=True))  # fmt: skip
        deadline = time.monotonic() + args.timeout
        while any(p.poll() is None for p in started):
            failed = [p.returncode for p in started if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                time.sleep(2 if failed else 0)  # let the other node report its lost peer
                shown = "\n".join((logs / f"node{i}.log").read_text()[-3000:] for i in (0, 1))
                why = f"exit {failed}" if failed else f"past --timeout {args.timeout} s"
                raise RuntimeError(f"a node failed ({why}):\n{shown}")
            time.sleep(0.2)
    finally:
        for process in started:  # the launcher and its workers: they hold the namespace
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _summarize(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    modes: dict[str, Any] = {}
    base = statistics.median(raw["modes"]["full"]["step_s"]) if "full" in raw["modes"] else None
    for mode, r in raw["modes"].items():
        steps = len(r["step_s"]) or 1
        tx = sum(c["tx_bytes"] for c in r["link"])
        rx = sum(c["rx_bytes"] for c in r["link"])
        packets = sum(c["tx_packets"] + c["rx_packets"] for c in r["link"])
        wire = (tx + rx) / steps
        payload = (tx + rx - HEADER_BYTES * packets) / steps
        handed: dict[str, float] = {}
        names = {v: k for k, v in r["groups"].items()}
        for group in {g for s in r["handed_rank0"] for g in s}:
            label = names.get(group, group)
            handed[label] = sum(s.get(group, 0) for s in r["handed_rank0"]) / steps
        memory = [sum(row.values()) for row in r["memory_per_rank"]]
        median = statistics.median(r["step_s"])
        modes[mode] = {
            "median_step_s": median,
            "steps_s": r["step_s"],
            "vs_full": (base / median) if base else None,
            "handed_per_step_rank0": handed,
            "groups": r["groups"],
            "link_per_step": {
                "wire_bytes": wire,
                "node0_to_node1_bytes": tx / steps,
                "node1_to_node0_bytes": rx / steps,
                "packets": packets / steps,
                "payload_bytes": payload,
                "formula_bytes": r["link_formula"],
                "wire_vs_formula": wire / r["link_formula"],
                "payload_vs_formula": payload / r["link_formula"],
            },
            "memory": {
                "per_rank": r["memory_per_rank"],
                "max_rank_bytes": max(memory),
                "formula_bytes": r["memory_formula"],
                "vs_formula": max(memory) / r["memory_formula"],
            },
            "padded": r["padded"],
        }
    return modes


def _print(result: dict[str, Any]) -> None:
    m = result["meta"]
    print(f"\n{m['params'] / 1e6:.2f} M parameters, 2 nodes x 2 ranks, link {m['link']['qdisc']}"
          f" ({m['link']['note'] or 'as asked'}); {m['rounds']} rounds x {m['steps']} steps, "
          f"{m['cpus']} cores, load average {m['loadavg_1min'][0]:.2f} before, "
          f"{m['loadavg_1min'][1]:.2f} after")  # fmt: skip
    print("| mode | median step s | full / mode | handed per step (rank 0), MB | "
          "link per step, MB (wire / payload / formula) | payload / formula | "
          "memory per rank, MB (formula) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for mode, r in result["modes"].items():
        handed = ", ".join(
            f"{g} {b / 1e6:.2f}" for g, b in sorted(r["handed_per_step_rank0"].items())
        )
        link, mem = r["link_per_step"], r["memory"]
        print(f"| {mode} | {r['median_step_s']:.3f} | {r['vs_full']:.2f}x | {handed} | "
              f"{link['wire_bytes'] / 1e6:.2f} / {link['payload_bytes'] / 1e6:.2f} / "
              f"{link['formula_bytes'] / 1e6:.2f} | x{link['payload_vs_formula']:.4f} | "
              f"{mem['max_rank_bytes'] / 1e6:.2f} ({mem['formula_bytes'] / 1e6:.2f}, "
              f"x{mem['vs_formula']:.4f}) |")  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=8, help="the model's size: 16 blocks ~8 M")
    parser.add_argument("--batch", type=int, default=8, help="samples per rank per step")
    parser.add_argument("--rate-mbit", type=float, default=200, help="0: no rate limit")
    parser.add_argument("--delay-ms", type=float, default=2, help="needs sch_netem")
    parser.add_argument("--warmup", type=int, default=2, help="steps per mode before timing")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="steps per mode per round")
    parser.add_argument("--modes", nargs="+", default=list(MODES),
                        choices=[*MODES, *EXTRA_MODES])  # fmt: skip
    parser.add_argument("--timeout", type=float, default=900, help="seconds for the whole run")
    parser.add_argument("--json", default=str(JSON_DEFAULT))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return {}
    if "full" not in args.modes:
        parser.error("--modes needs full: the ratios are to it")

    sys.path[:0] = [str(ROOT)]  # tests.launch.netns
    from tests.launch.netns import can_make_namespaces, two_nodes

    meta: dict[str, Any] = {
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **{k: getattr(args, k) for k in ("width", "blocks", "batch", "warmup", "rounds",
                                          "steps", "rate_mbit", "delay_ms", "modes")},
    }  # fmt: skip
    ok, reason = can_make_namespaces()
    result: dict[str, Any] = {"meta": meta}
    # SIGTERM as an exception, so that the namespaces and the launchers are removed on it too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("across_nodes.py: terminated"))
    try:
        if not ok:
            raise _Skip(reason)
        load = [os.getloadavg()[0]]
        with tempfile.TemporaryDirectory() as tmp, two_nodes() as nodes:
            meta["link"] = _shape(nodes, args)
            out = Path(tmp) / "raw.json"
            _launch(nodes, args, out, Path(tmp))
            raw = json.loads(out.read_text())
        load.append(os.getloadavg()[0])
    except _Skip as skip:
        print(f"across_nodes.py: SKIPPED: {skip}")
        result["skipped"] = str(skip)
    else:
        meta.update(params=raw["params"], loadavg_1min=load)
        result["modes"] = _summarize(raw, args)
        _print(result)
        full, hybrid = result["modes"]["full"], result["modes"].get("hybrid")
        if hybrid:
            result["hybrid_speedup"] = full["median_step_s"] / hybrid["median_step_s"]
            print(f"hybrid: {result['hybrid_speedup']:.2f}x full sharding's speed per step "
                  f"(target >= {TARGET_SPEEDUP}x)")  # fmt: skip
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(f"JSON: {args.json}")
    return result


if __name__ == "__main__":
    main()
