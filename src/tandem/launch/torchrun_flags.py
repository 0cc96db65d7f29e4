"""torchrun's command line, as ``tandem run`` takes it: every flag, grouped as torchrun groups them.

torchrun's parser (``torch.distributed.run.get_args_parser``) is the reference: every option
string it has is accepted here, with both spellings (``--rdzv-id``/``--rdzv_id``), and with
torchrun's default. Flags that tandem cannot apply (``--start-method``: tandem always starts a
fresh interpreter) are accepted and their help says what they do under tandem. The values that
need more than argparse (``--nnodes MIN:MAX``, ``--rdzv-endpoint HOST:PORT``, ``--rdzv-conf
k=v,...``, ``--redirects 0:1,1:2``) are parsed by the pure functions below, which import no torch.
As torchrun's ``env`` action does, a flag left out takes its value from ``PET_<NAME>`` when set
(``PET_NNODES=2``).

Example::

    >>> parse_nnodes("1:2")
    (1, 2)
    >>> parse_endpoint("node0:29603", default_port=29400)
    ('node0', 29603)
    >>> parse_std("0:1,1:3", nproc=2)
    {0: 1, 1: 3}
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from tandem.launch.rendezvous import LaunchError

#: The rendezvous backends tandem implements: torchrun's default ``static`` (node ranks given,
#: node 0 at --master-addr) and ``c10d`` (a TCPStore at --rdzv-endpoint, node ranks by arrival).
RDZV_BACKENDS = ("static", "c10d")
#: torchrun's c10d port when --rdzv-endpoint names none (torch's ``c10d_rendezvous_backend``).
C10D_DEFAULT_PORT = 29400
#: Bits of torchrun's ``Std``: which of a worker's streams go to its log file.
STD_OUT, STD_ERR = 1, 2

_GROUPS = (
    ("worker/node size", "how many workers, on how many nodes (torchrun's first group)"),
    ("rendezvous", "how the nodes find each other"),
    ("user-code launch", "what each worker runs, its restarts, its output"),
    ("node 0 (static rendezvous)", "torchrun's flags kept from torch.distributed.launch"),
)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help that ends with ``(default: ...)``, unless the help already says its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        return text if "(default" in text else super()._get_help_string(action) or ""


class _Env(argparse.Action):
    """torchrun's ``env`` action: the default is ``PET_<DEST>`` from the environment, if set."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        name = f"PET_{dest.upper()}"
        if name in os.environ:
            kwargs["default"] = os.environ[name]
            kwargs["required"] = False
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        setattr(namespace, self.dest, values)


class _EnvTrue(argparse.Action):
    """torchrun's ``check_env``: a switch, also on when ``PET_<DEST>`` is 1 (or true)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        raw = os.environ.get(f"PET_{dest.upper()}", "0")
        kwargs.setdefault("default", raw.lower() in ("1", "true", "yes"))
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        setattr(namespace, self.dest, True)


def flag(group: Any, *names: str, switch: bool = False, **kwargs: Any) -> None:
    """Add ``--some-flag`` and its underscore spelling ``--some_flag`` (and short names given).

    Example::

        flag(parser, "--max-restarts", type=int, default=0, help="restart up to K times")
    """
    spelled = list(names)
    for name in names:
        under = "--" + name[2:].replace("-", "_")
        if name.startswith("--") and under != name and under not in spelled:
            spelled.append(under)
    group.add_argument(*spelled, action=_EnvTrue if switch else _Env, **kwargs)


def add_torchrun_flags(parser: argparse.ArgumentParser) -> None:
    """Add every torchrun flag to ``parser``, in torchrun's groups, with torchrun's defaults."""
    size, rdzv, launch, static = (parser.add_argument_group(t, d) for t, d in _GROUPS)
    flag(
        size,
        "--nnodes",
        default=None,
        help="nodes: N, or MIN:MAX (c10d: elastic, from MIN to MAX nodes, re-formed at each "
        "restart; see docs/guides/multi-node.md) (default: 1, or SLURM's under srun)",
    )
    flag(
        size,
        "--nproc-per-node",
        default="1",
        help="workers per node: a number, auto (one per GPU, else 1), gpu, cpu",
    )

    flag(
        rdzv,
        "--rdzv-backend",
        default="static",
        help=f"rendezvous backend: {' or '.join(RDZV_BACKENDS)}",
    )
    flag(
        rdzv,
        "--rdzv-endpoint",
        default="",
        help=f"HOST[:PORT] of the c10d store, on the node whose address it is (PORT default "
        f"{C10D_DEFAULT_PORT}); static: --master-addr:--master-port",
    )
    flag(
        rdzv,
        "--rdzv-id",
        default="none",
        help="job id: TORCHELASTIC_RUN_ID, the log directory's prefix, the store's key prefix",
    )
    flag(
        rdzv,
        "--rdzv-conf",
        default="",
        help="k=v,...: join_timeout (s to wait for MIN nodes; static: instead of "
        "--rdzv-timeout; c10d default 600), last_call_timeout (c10d: s to wait for more once "
        "MIN are there, 30), keep_alive_interval (s between beats, 1), keep_alive_max_attempt "
        "(missed beats before a node is lost, 5), is_host; others accepted, unused",
    )
    flag(
        rdzv,
        "--standalone",
        switch=True,
        help="one node, a rendezvous on a free local port (--rdzv-* ignored)",
    )

    flag(
        launch,
        "--max-restarts",
        type=int,
        default=0,
        help="restart all workers up to K times after a failure",
    )
    flag(
        launch,
        "--monitor-interval",
        type=float,
        default=0.1,
        help="accepted; tandem watches its workers every 20 ms whatever the value",
    )
    flag(
        launch,
        "--start-method",
        default="spawn",
        choices=["spawn", "fork", "forkserver"],
        help="accepted; every worker is a fresh interpreter (as spawn)",
    )
    flag(
        launch,
        "--event-log-handler",
        default="null",
        help="accepted; tandem records no torchelastic events",
    )
    flag(launch, "--role", default="default", help="the workers' ROLE_NAME")
    flag(
        launch,
        "-m",
        "--module",
        switch=True,
        help="run SCRIPT as a module, as python -m (found in the current directory too)",
    )
    flag(launch, "--no-python", switch=True, help="run SCRIPT as an executable, not with python")
    flag(
        launch,
        "--run-path",
        switch=True,
        help="run SCRIPT with runpy.run_path in each worker's interpreter",
    )
    flag(
        launch,
        "--log-dir",
        default=None,
        help="write each worker's output to LOG_DIR/<rdzv-id>_<random>/attempt_<n>/"
        "<local rank>/{stdout,stderr}.log (all streams unless -r/-t choose)",
    )
    flag(
        launch,
        "-r",
        "--redirects",
        default="0",
        help="streams to log files only, not the console: 1 stdout, 2 stderr, 3 both; or "
        "per local rank, 0:1,1:2",
    )
    flag(
        launch,
        "-t",
        "--tee",
        default="0",
        help="streams to log files and the console (format of --redirects)",
    )
    flag(
        launch,
        "--local-ranks-filter",
        default="",
        help="show only these local ranks' output on the console, e.g. 0,1 (files keep all)",
    )
    flag(
        launch,
        "--duplicate-stdout-filters",
        default="",
        help="copy the console's stdout lines holding any of these (comma-separated; ,, is a "
        "comma) to the attempt's filtered_stdout.log",
    )
    flag(
        launch,
        "--duplicate-stderr-filters",
        default="",
        help="copy the console's stderr lines holding any of these (comma-separated; ,, is a "
        "comma) to the attempt's filtered_stderr.log",
    )
    flag(
        launch,
        "--logs-specs",
        default=None,
        help="accepted; a LogsSpecs plugin is torchelastic's: tandem writes its own layout",
    )
    flag(
        launch,
        "--numa-binding",
        default=None,
        choices=["node", "socket", "exclusive", "core-complex"],
        help="accepted; not applied (a warning says so): bind with numactl yourself",
    )
    flag(
        launch,
        "--signals-to-handle",
        default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        help="signals passed on to every worker (SIGUSR1 always is: checkpoint now)",
    )
    flag(
        launch,
        "--shutdown-timeout",
        type=float,
        default=None,
        help="seconds workers get after SIGTERM before SIGKILL (default: --term-timeout's)",
    )
    flag(
        launch,
        "--virtual-local-rank",
        switch=True,
        help="LOCAL_RANK=0 in every worker, CUDA_VISIBLE_DEVICES narrowed to its GPU",
    )

    flag(
        static,
        "--node-rank",
        type=int,
        default=None,
        help="this node's rank (default: 0 with static, or SLURM's; c10d: by arrival)",
    )
    flag(
        static,
        "--master-addr",
        default=None,
        help="node 0's address (static rendezvous) (default: 127.0.0.1 on one node)",
    )
    flag(
        static,
        "--master-port",
        type=int,
        default=None,
        help="node 0's port (default: a free port on one node, 29500 on many)",
    )
    flag(
        static,
        "--local-addr",
        default=None,
        help="accepted; tandem's workers meet at node 0's store, no node advertises its own",
    )


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"2"`` -> ``(2, 2)``, ``"1:4"`` -> ``(1, 4)``; errors name the value.

    Example::

        >>> parse_nnodes("3")
        (3, 3)
    """
    parts = str(text).split(":")
    try:
        if len(parts) not in (1, 2):
            raise ValueError
        low, high = int(parts[0]), int(parts[-1])
    except ValueError:
        raise LaunchError(f"--nnodes {text!r} is not N or MIN:MAX (whole numbers)") from None
    if low < 1:
        raise LaunchError(f"--nnodes {text!r}: the node count {low} must be >= 1")
    if low > high:
        raise LaunchError(f"--nnodes {text!r}: MIN {low} is larger than MAX {high}")
    return low, high


def parse_endpoint(text: str, default_port: int) -> tuple[str, int]:
    """``host[:port]`` (IPv6 as ``[::1]:port``) -> ``(host, port)``.

    Example::

        >>> parse_endpoint("[::1]:5000", 29400)
        ('::1', 5000)
    """
    host, port = text.strip(), str(default_port)
    if host.startswith("["):
        close = host.find("]")
        host, port = host[1:close], (host[close + 2 :] or port)
    elif host.count(":") == 1:
        host, port = host.split(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise LaunchError(f"--rdzv-endpoint {text!r} is not HOST:PORT with a port in 0..65535")
    return host, int(port)


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """``"join_timeout=600,is_host=1"`` -> ``{"join_timeout": "600", "is_host": "1"}``.

    Example::

        >>> parse_rdzv_conf("join_timeout=60")
        {'join_timeout': '60'}
    """
    conf = {}
    for item in filter(None, (i.strip() for i in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise LaunchError(f"--rdzv-conf {text!r}: {item!r} is not key=value")
        conf[key.strip()] = value.strip()
    return conf


def parse_std(text: str, nproc: int, name: str = "redirects") -> dict[int, int]:
    """torchrun's ``Std`` for each local rank: ``"3"`` for all, or ``"0:1,1:2"`` per rank.

    Example::

        >>> parse_std("2", nproc=2)
        {0: 2, 1: 2}
    """
    text = str(text).strip()

    def bits(raw: str) -> int:
        if raw.strip() not in ("0", "1", "2", "3"):
            raise LaunchError(f"--{name} {text!r}: {raw!r} is not 0, 1 (stdout), 2 or 3 (both)")
        return int(raw)

    if ":" not in text:
        return dict.fromkeys(range(nproc), bits(text))
    chosen = dict.fromkeys(range(nproc), 0)
    for item in text.split(","):
        rank, _, value = item.partition(":")
        if not rank.strip().isdigit() or int(rank) >= nproc:
            raise LaunchError(f"--{name} {text!r}: {rank!r} is not a local rank < {nproc}")
        chosen[int(rank)] = bits(value)
    return chosen


def parse_signals(text: str) -> tuple[str, ...]:
    """``"SIGTERM,SIGINT"`` -> the names, checked against this platform's signals.

    Example::

        >>> parse_signals("SIGTERM, SIGHUP")
        ('SIGTERM', 'SIGHUP')
    """
    import signal

    names = tuple(n.strip() for n in text.split(",") if n.strip())
    for n in names:
        if not isinstance(getattr(signal, n, None), signal.Signals):
            raise LaunchError(f"--signals-to-handle {text!r}: {n!r} is not a signal name")
    return names
