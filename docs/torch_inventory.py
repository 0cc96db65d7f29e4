"""Write ``docs/_inventories/torch.inv``, the intersphinx inventory of torch's documentation.

The documentation builds without a network, so intersphinx cannot download torch's own
``objects.inv`` at build time; the inventory it reads is committed. This script writes it from the
installed torch, for the part of torch's API that tandem's docstrings and pages name (the
distributed package, FSDP, the join context manager, DDP's communication hooks, data loading,
mixed precision, optimizers, ``torch.nn``'s modules, tensors and their attributes, the RNG), with
the addresses that https://docs.pytorch.org/docs/stable/ gives each object:

- an object shown by an ``autosummary`` table has a page of its own:
  ``generated/<name>.html#<name>`` (``torch.nn.Module``, ``torch.save``, ``torch.optim.SGD``);
  its members are anchors on that page (``generated/torch.nn.Module.html#torch.nn.Module.to``),
  except a tensor's and ``Optimizer``'s, which have pages of their own too;
- an object documented in a page's text is an anchor on that page: ``distributed.html#<name>``
  for ``torch.distributed``, ``data.html``, ``amp.html``, ``fsdp.html`` (FSDP1),
  ``distributed.fsdp.fully_shard.html`` (FSDP2), ``distributed.algorithms.join.html``,
  ``ddp_comm_hooks.html``, ``optim.html#torch.optim.Optimizer``, ``tensors.html``,
  ``tensor_attributes.html``, ``random.html``.

Each entry is listed below under the page that documents it (read from torch's documentation
sources, ``docs/source/*.md``, and checked with ``--compare`` against PyTorch 2.5's published
``objects.inv``: every name both hold has the same address, but for one that torch documents
twice); the script checks that every name exists in the installed torch
(a name torch dropped fails here, not as a dead link) and adds, at priority -1, the name an object
has where it is defined (``torch.nn.modules.module.Module``), which is how autodoc writes a type
hint. Objects torch does not document (``torch.distributed.ProcessGroup``) are left out on purpose:
``docs/conf.py`` names them in ``nitpick_ignore``.

Regenerate after a torch upgrade, or when a docstring names a torch object missing here (the build
then fails on that reference), and commit the result::

    python docs/torch_inventory.py                    # writes docs/_inventories/torch.inv
    python docs/torch_inventory.py --compare objects.inv   # checks against torch's real one

``--compare`` reads an ``objects.inv`` downloaded from docs.pytorch.org (or any release's) and
reports the names both hold whose addresses differ. Where a network is at hand, that file can be
committed as ``docs/_inventories/torch.inv`` instead of this one (then drop the test in
``tests/test_docs.py`` that checks the committed file is this script's output).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
import zlib
from pathlib import Path
from typing import Any

import torch

BASE_URL = "https://docs.pytorch.org/docs/stable/"
OUT = Path(__file__).resolve().parent / "_inventories" / "torch.inv"
GENERATED = "generated"  # a page per object: generated/<name>.html

# fmt: off
# (page, module, names): each name is documented on that page, under module.name.
DOCUMENTED: list[tuple[str, str, list[str]]] = [
    # distributed.md
    ("distributed.html", "torch.distributed", [
        "is_available", "init_process_group", "is_initialized", "is_mpi_available",
        "is_nccl_available", "is_gloo_available", "is_torchelastic_launched", "Backend",
        "get_backend", "get_rank", "get_world_size", "new_group", "get_group_rank",
        "get_global_rank", "get_process_group_ranks", "send", "recv", "isend", "irecv",
        "send_object_list", "recv_object_list", "batch_isend_irecv", "P2POp", "broadcast",
        "broadcast_object_list", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor",
        "all_gather_object", "gather", "gather_object", "scatter", "scatter_object_list",
        "reduce_scatter", "reduce_scatter_tensor", "all_to_all_single", "all_to_all", "barrier",
        "monitored_barrier", "Work", "ReduceOp", "Store", "TCPStore", "HashStore", "FileStore",
        "PrefixStore", "DistError", "DistBackendError", "DistNetworkError", "DistStoreError",
        "breakpoint",
    ]),
    ("distributed.html", "torch.distributed.device_mesh", ["DeviceMesh", "init_device_mesh"]),
    # ddp_comm_hooks.md
    ("ddp_comm_hooks.html", "torch.distributed", ["GradBucket"]),
    ("ddp_comm_hooks.html", "torch.distributed.algorithms.ddp_comm_hooks.default_hooks", [
        "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "fp16_compress_wrapper",
        "bf16_compress_wrapper",
    ]),
    # distributed.algorithms.join.md
    ("distributed.algorithms.join.html", "torch.distributed.algorithms", [
        "Join", "Joinable", "JoinHook",
    ]),
    # fsdp.md (FSDP1) and distributed.fsdp.fully_shard.md (FSDP2)
    ("fsdp.html", "torch.distributed.fsdp", [
        "FullyShardedDataParallel", "BackwardPrefetch", "ShardingStrategy", "MixedPrecision",
        "CPUOffload", "StateDictConfig", "FullStateDictConfig", "ShardedStateDictConfig",
        "LocalStateDictConfig", "OptimStateDictConfig", "FullOptimStateDictConfig",
        "ShardedOptimStateDictConfig", "LocalOptimStateDictConfig", "StateDictSettings",
    ]),
    ("distributed.fsdp.fully_shard.html", "torch.distributed.fsdp", [
        "fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method",
        "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy",
    ]),
    # data.md
    ("data.html", "torch.utils.data", [
        "DataLoader", "Dataset", "IterableDataset", "TensorDataset", "StackDataset",
        "ConcatDataset", "ChainDataset", "Subset", "default_collate", "default_convert",
        "get_worker_info", "random_split", "Sampler", "SequentialSampler", "RandomSampler",
        "SubsetRandomSampler", "WeightedRandomSampler", "BatchSampler",
    ]),
    ("data.html", "torch.utils.data.distributed", ["DistributedSampler"]),
    # amp.md
    ("amp.html", "torch", ["autocast"]),
    ("amp.html", "torch.amp", ["custom_fwd", "custom_bwd"]),
    ("amp.html", "torch.amp.autocast_mode", ["is_autocast_available"]),
    # optim.md
    ("optim.html", "torch.optim", ["Optimizer"]),
    (GENERATED, "torch.optim", [
        "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "SparseAdam", "Adamax", "ASGD",
        "LBFGS", "NAdam", "RAdam", "RMSprop", "Rprop", "SGD",
    ]),
    (GENERATED, "torch.optim.lr_scheduler", [
        "LRScheduler", "LambdaLR", "MultiplicativeLR", "StepLR", "MultiStepLR", "ConstantLR",
        "LinearLR", "ExponentialLR", "PolynomialLR", "CosineAnnealingLR", "ChainedScheduler",
        "SequentialLR", "ReduceLROnPlateau", "CyclicLR", "OneCycleLR",
        "CosineAnnealingWarmRestarts",
    ]),
    # tensors.rst, tensor_attributes.rst, random.md
    ("tensors.html", "torch", ["Tensor"]),
    ("tensor_attributes.html", "torch", ["dtype", "device", "layout", "memory_format"]),
    ("random.html", "torch.random", [
        "fork_rng", "get_rng_state", "initial_seed", "manual_seed", "seed", "set_rng_state",
    ]),
    # torch.md: the functions a training loop calls
    (GENERATED, "torch", [
        "Generator", "manual_seed", "seed", "initial_seed", "get_rng_state", "set_rng_state",
        "save", "load", "no_grad", "enable_grad", "is_grad_enabled", "compile", "is_tensor",
        "numel", "tensor", "as_tensor", "from_numpy",
        "zeros", "zeros_like", "ones", "ones_like", "empty", "empty_like", "full", "arange",
        "cat", "stack", "split", "chunk", "equal", "allclose", "isclose", "isfinite",
        "set_default_dtype", "get_default_dtype", "use_deterministic_algorithms",
    ]),
    # cuda.md
    (GENERATED, "torch.cuda", [
        "is_available", "device_count", "current_device", "set_device", "synchronize",
        "set_sync_debug_mode", "get_sync_debug_mode", "Stream", "Event", "stream",
        "current_stream", "default_stream", "empty_cache", "memory_allocated",
        "max_memory_allocated", "memory_reserved", "max_memory_reserved",
        "reset_peak_memory_stats", "manual_seed", "manual_seed_all", "get_rng_state",
        "set_rng_state", "get_rng_state_all", "set_rng_state_all",
    ]),
    # nn.md
    (GENERATED, "torch.nn", [
        "Module", "Sequential", "ModuleList", "ModuleDict", "ParameterList", "ParameterDict",
        "Linear", "Bilinear", "Identity", "Embedding", "EmbeddingBag", "Conv1d", "Conv2d",
        "Conv3d", "LayerNorm", "GroupNorm", "RMSNorm", "BatchNorm1d", "BatchNorm2d",
        "BatchNorm3d", "SyncBatchNorm", "Dropout", "ReLU", "GELU", "SiLU", "Tanh", "Sigmoid",
        "Softmax", "LogSoftmax", "MultiheadAttention", "Transformer", "TransformerEncoder",
        "TransformerEncoderLayer", "TransformerDecoder", "TransformerDecoderLayer", "LSTM",
        "GRU", "RNN", "CrossEntropyLoss", "NLLLoss", "MSELoss", "L1Loss", "BCELoss",
        "BCEWithLogitsLoss", "DataParallel",
    ]),
    (GENERATED, "torch.nn.parameter", ["Parameter", "Buffer", "UninitializedParameter"]),
    (GENERATED, "torch.nn.parallel", ["DistributedDataParallel"]),
    (GENERATED, "torch.nn.utils", [
        "clip_grad_norm_", "clip_grad_value_", "get_total_norm", "clip_grads_with_norm_",
        "parameters_to_vector", "vector_to_parameters",
    ]),
    (GENERATED, "torch.nn.functional", [
        "linear", "relu", "gelu", "softmax", "log_softmax", "cross_entropy", "nll_loss",
        "mse_loss", "dropout", "layer_norm", "embedding", "scaled_dot_product_attention",
    ]),
]

# Documented names torch also exports elsewhere: the other spelling points at the same entry.
ALSO_NAMED: dict[str, list[str]] = {
    "torch.nn.parameter.Parameter": ["torch.nn.Parameter"],
    "torch.nn.parameter.Buffer": ["torch.nn.Buffer"],
    "torch.nn.parallel.DistributedDataParallel": ["torch.nn.DistributedDataParallel"],
    "torch.utils.data.distributed.DistributedSampler": ["torch.utils.data.DistributedSampler"],
    "torch.distributed.device_mesh.DeviceMesh": ["torch.distributed.DeviceMesh"],
    "torch.distributed.device_mesh.init_device_mesh": ["torch.distributed.init_device_mesh"],
    "torch.autocast": ["torch.amp.autocast"],
    "torch.amp.autocast_mode.is_autocast_available": ["torch.amp.is_autocast_available"],
}

# Objects torch's pages describe in a section of their text rather than an entry of their own:
# the reference points at that section. torch.amp.GradScaler's API is documented under its
# deprecated subclasses' names (torch.cuda.amp.GradScaler); the section describes both.
SECTIONS: dict[str, str] = {
    "torch.amp.GradScaler": "amp.html#gradient-scaling",
}

# Classes whose members torch documents, and where. "page": anchors on the class's own page
# (its members with a docstring, defined in the class itself); a list: only those members; for
# torch.Tensor and Optimizer each member has a page of its own (autosummary).
MEMBERS: dict[str, str | list[str]] = {
    "torch.distributed.Backend": "page",
    "torch.distributed.Work": "page",
    "torch.distributed.Store": "page",
    "torch.distributed.device_mesh.DeviceMesh": "page",
    "torch.distributed.GradBucket": "page",
    "torch.distributed.algorithms.Join": "page",
    "torch.distributed.algorithms.Joinable": "page",
    "torch.distributed.algorithms.JoinHook": "page",
    "torch.distributed.fsdp.FullyShardedDataParallel": "page",
    "torch.distributed.fsdp.FSDPModule": "page",
    "torch.distributed.fsdp.UnshardHandle": "page",
    "torch.Generator": "page",
    "torch.nn.Module": "page",
    "torch.nn.ModuleList": "page",
    "torch.nn.ModuleDict": "page",
    "torch.nn.ParameterDict": "page",
    "torch.nn.parallel.DistributedDataParallel": [
        "join", "join_hook", "no_sync", "register_comm_hook",
    ],
    "torch.optim.Optimizer": [
        "add_param_group", "load_state_dict", "register_load_state_dict_pre_hook",
        "register_load_state_dict_post_hook", "state_dict", "register_state_dict_pre_hook",
        "register_state_dict_post_hook", "step", "register_step_pre_hook",
        "register_step_post_hook", "zero_grad",
    ],
    "torch.Tensor": [
        "backward", "grad", "requires_grad", "requires_grad_", "is_leaf", "detach", "device",
        "to", "cpu", "cuda", "item", "numel", "element_size", "copy_", "zero_", "data_ptr",
        "untyped_storage", "pin_memory", "is_pinned", "record_stream", "view", "flatten",
        "contiguous", "is_contiguous", "clone", "float", "half", "bfloat16",
    ],
}
OWN_PAGES = {"torch.Tensor", "torch.optim.Optimizer"}

# Module entries: where torch's documentation declares each module (``py:module``).
MODULES: dict[str, str] = {
    "torch": "torch.html",
    "torch.amp": "amp.html",
    "torch.cuda": "cuda.html",
    "torch.distributed": "distributed.html",
    "torch.distributed.algorithms": "distributed.html",
    "torch.distributed.algorithms.ddp_comm_hooks": "distributed.html",
    "torch.distributed.algorithms.join": "distributed.html",
    "torch.distributed.checkpoint": "distributed.checkpoint.html",
    "torch.distributed.device_mesh": "distributed.html",
    "torch.distributed.elastic": "distributed.html",
    "torch.distributed.fsdp": "fsdp.html",
    "torch.distributed.run": "elastic/run.html",
    "torch.multiprocessing": "multiprocessing.html",
    "torch.nn": "nn.html",
    "torch.nn.parallel": "nn.html",
    "torch.nn.utils": "nn.html",
    "torch.optim": "optim.html",
    "torch.optim.lr_scheduler": "optim.html",
    "torch.profiler": "profiler.html",
    "torch.random": "random.html",
    "torch.utils.data": "data.html",
    "torch.utils.tensorboard": "tensorboard.html",
}

# Pages, for {doc} links from the Markdown pages (``inv:torch:std:doc#distributed``).
DOCS: dict[str, str] = {
    "amp": "Automatic Mixed Precision package - torch.amp",
    "cuda": "torch.cuda",
    "data": "torch.utils.data",
    "ddp_comm_hooks": "DDP Communication Hooks",
    "distributed": "Distributed communication package - torch.distributed",
    "distributed.algorithms.join": "Generic Join Context Manager",
    "distributed.checkpoint": "Distributed Checkpoint - torch.distributed.checkpoint",
    "distributed.fsdp.fully_shard": "torch.distributed.fsdp.fully_shard",
    "elastic/run": "torchrun (Elastic Launch)",
    "fsdp": "FullyShardedDataParallel",
    "multiprocessing": "Multiprocessing package - torch.multiprocessing",
    "nn": "torch.nn",
    "notes/amp_examples": "Automatic Mixed Precision examples",
    "notes/ddp": "Distributed Data Parallel",
    "optim": "torch.optim",
    "random": "torch.random",
    "tensor_attributes": "Tensor Attributes",
    "tensors": "torch.Tensor",
}
# fmt: on


def _resolve(dotted: str) -> Any:
    """The object ``dotted`` names in the installed torch (ImportError/AttributeError if none)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            value = getattr(value, name)
        return value
    raise ImportError(dotted)


def _role(obj: Any) -> str:
    if inspect.isclass(obj):
        return "py:exception" if issubclass(obj, BaseException) else "py:class"
    return "py:function"


_DESCRIPTORS = {"getset_descriptor", "member_descriptor"}  # a C class's attributes


def _member_role(raw: Any) -> str:
    if isinstance(raw, property) or type(raw).__name__ in _DESCRIPTORS:
        return "py:property"
    if isinstance(raw, (classmethod, staticmethod)) or callable(raw):
        return "py:method"
    return "py:attribute"


def _defined_as(obj: Any) -> str | None:
    """Where ``obj`` is defined (``module.qualname``), when that name leads back to it."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        return None
    try:
        return f"{module}.{qualname}" if _resolve(f"{module}.{qualname}") is obj else None
    except (ImportError, AttributeError):
        return None


def _page_members(cls: type) -> list[str]:
    """A class's documented members: defined in it, public, callable or a property, with a doc."""
    names = []
    for name, raw in vars(cls).items():
        if name.startswith("_"):
            continue
        member = callable(raw) or isinstance(raw, (property, classmethod, staticmethod))
        if not member and type(raw).__name__ not in _DESCRIPTORS:
            continue
        if getattr(raw, "__doc__", None) and not inspect.isclass(raw):
            names.append(name)
    return names


def entries() -> dict[tuple[str, str], tuple[int, str]]:
    """Every (name, role) of the inventory, with its priority and address (relative to BASE_URL)."""
    found: dict[tuple[str, str], tuple[int, str]] = {}

    def add(name: str, role: str, uri: str, obj: Any = None) -> None:
        found.setdefault((name, role), (1, uri))
        for alias in [*ALSO_NAMED.get(name, []), _defined_as(obj) if obj is not None else None]:
            if alias and alias != name:
                found.setdefault((alias, role), (-1, uri))

    for page, module, names in DOCUMENTED:
        for short in names:
            name = f"{module}.{short}"
            obj = _resolve(name)
            uri = f"{GENERATED}/{name}.html#{name}" if page == GENERATED else f"{page}#{name}"
            add(name, _role(obj), uri, obj)
            how = MEMBERS.get(name)
            if how is None:
                continue
            members = _page_members(obj) if how == "page" else how
            for member in members:
                raw = inspect.getattr_static(obj, member)  # AttributeError if torch dropped it
                full = f"{name}.{member}"
                where = f"{GENERATED}/{full}.html" if name in OWN_PAGES else uri.split("#")[0]
                add(full, _member_role(raw), f"{where}#{full}")
    for name, uri in SECTIONS.items():
        obj = _resolve(name)
        add(name, _role(obj), uri, obj)
    for name, page in MODULES.items():
        importlib.import_module(name)
        add(name, "py:module", f"{page}#module-{name}")
    for doc in DOCS:
        found[(doc, "std:doc")] = (-1, f"{doc}.html")
    return found


def render(found: dict[tuple[str, str], tuple[int, str]]) -> bytes:
    """The inventory in Sphinx's version 2 format: four header lines, then zlib-compressed rows."""
    version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    header = (
        "# Sphinx inventory version 2\n"
        "# Project: PyTorch\n"
        f"# Version: {version}\n"
        "# The remainder of this file is compressed using zlib.\n"
    )
    rows = []
    for (name, role), (priority, uri) in sorted(found.items()):
        display = DOCS[name] if role == "std:doc" else "-"
        if uri.endswith(name) and role != "std:doc":
            uri = uri[: -len(name)] + "$"
        rows.append(f"{name} {role} {priority} {uri} {display}\n")
    return header.encode() + zlib.compress("".join(rows).encode(), 9)


def read(path: Path) -> dict[tuple[str, str], str]:
    """(name, role) -> address, from any version 2 ``objects.inv``."""
    data = path.read_bytes()
    offset = 0
    for _ in range(4):
        offset = data.index(b"\n", offset) + 1
    rows: dict[tuple[str, str], str] = {}
    line = re.compile(r"(.+?)\s+(\S+)\s+(-?\d+)\s+?(\S*)\s+(.*)")
    for text in zlib.decompress(data[offset:]).decode().splitlines():
        match = line.match(text.rstrip())
        if match:
            name, role, _, uri, _ = match.groups()
            rows[(name, role)] = uri.replace("$", name) if uri.endswith("$") else uri
    return rows


def compare(ours: dict[tuple[str, str], tuple[int, str]], real_path: Path) -> int:
    """Report the names both inventories hold whose addresses differ; the count of them."""
    real = read(real_path)
    real_by_name = {name: uri for (name, role), uri in real.items() if role.startswith("py:")}
    same = differ = missing = 0
    for (name, role), (_, uri) in sorted(ours.items()):
        if not role.startswith("py:"):
            continue
        if name not in real_by_name:
            missing += 1
            continue
        if real_by_name[name] == uri:
            same += 1
        else:
            differ += 1
            print(f"differs: {name}: here {uri}, there {real_by_name[name]}")
    print(f"{same} the same, {differ} different, {missing} not in {real_path.name}")
    return differ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="where to write (%(default)s)")
    parser.add_argument(
        "--compare", type=Path, help="a real objects.inv to check the addresses against"
    )
    args = parser.parse_args(argv)
    found = entries()
    if args.compare:
        return 1 if compare(found, args.compare) else 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(render(found))
    print(f"wrote {len(found)} entries for torch {torch.__version__} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
