"""The file of ``tandem.checkpoint.save``: written atomically, read back verified, others named.

One file per checkpoint (rank 0's), with a ``.sha256`` sidecar beside it written last: the
sidecar commits the file, as it does a Trainer's checkpoint (:mod:`tandem.checkpoint.run_dir`),
and ``sha256sum -c`` reads it. A sharded checkpoint's per-rank files live where the Trainer's
do (:mod:`tandem.checkpoint.shards`): ``shards/<stem>/rankNNNNN.pt`` beside the file.

Reading verifies the checksum before unpickling anything, and unpickles with
``weights_only=True``; a file that is not a tandem checkpoint at all (a ``torch.save`` of a
state dict, a safetensors file, a shard, a Trainer's ``latest`` pointer) is named as what it
is, so a wrong path is a clear error rather than "checksum missing".

Example::

    write_checkpoint_file({"format": API_FORMAT, ...}, Path("ckpt/step100.pt"))
    payload = read_verified(Path("ckpt/step100.pt"))
"""

from __future__ import annotations

import json
import re
import struct
import zipfile
from pathlib import Path
from typing import Any

from tandem.checkpoint.run_dir import (
    FORMAT_VERSION,
    CheckpointError,
    list_checkpoints,
    read_sealed,
    sidecar_of,
    write_committed,
)
from tandem.checkpoint.shards import SHARDS_DIR

#: The ``format`` of a file written by ``tandem.checkpoint.save``; the number is its version.
API_FORMAT = "tandem.checkpoint/1"
_API_PREFIX = "tandem.checkpoint/"
_TRAINER_KEYS = ("format_version", "epoch", "step", "state")
_RANK_FILE = re.compile(r"rank(\d{5})\.pt")


def write_checkpoint_file(payload: dict[str, Any], path: Path) -> str:
    """Write ``payload`` to ``path`` and commit it with its sidecar; the file's sha256.

    The Trainer's steps 1 and 2 (:func:`tandem.checkpoint.run_dir.write_committed`): the file,
    then its sidecar, each atomic. Saving over an existing checkpoint uncommits it first, so a
    crash in between leaves a file that refuses to load ("its save did not finish"), never old
    checksum and new bytes, nor a half-written file.

    Raises:
        ValueError: the payload holds an object ``weights_only`` loading would refuse (nothing
            is written), or ``path`` is a directory.
        OSError: the file system refused a write; the message names the file.
    """
    if path.is_dir():
        raise ValueError(
            f"checkpoint path {path} is a directory; pass a file name, e.g. "
            f"{path / 'checkpoint.pt'}"
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_committed(payload, path)
    except OSError as e:
        raise OSError(
            e.errno, f"cannot save checkpoint {path}: {e.strerror or e}", e.filename
        ) from e


def read_verified(path: Path) -> dict[str, Any]:
    """``path``'s payload, after its checksum matched; nothing pickled runs.

    Raises:
        CheckpointError: the file is missing, a directory, not a tandem checkpoint (named as
            what it is), corrupt or truncated, or holds objects other than plain data.
    """
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory, not a checkpoint file{_dir_hint(path)}")
    if not sidecar_of(path).is_file():
        raise CheckpointError(
            f"{path} is {describe_file(path)}, not a committed tandem checkpoint: a tandem "
            f"checkpoint has its checksum file {sidecar_of(path).name} beside it (a file "
            "without one is not a checkpoint, or its save did not finish, or it was copied "
            "without the sidecar)"
        )
    payload = read_sealed(path)
    if not isinstance(payload, dict):
        raise CheckpointError(
            f"{path} is a torch.save file of a {type(payload).__name__}, not a tandem checkpoint"
        )
    return payload


def payload_kind(path: Path, payload: dict[str, Any]) -> str:
    """``"api"`` (tandem.checkpoint.save) or ``"trainer"``; CheckpointError for anything else.

    A version newer than this tandem reads is an error that says to upgrade.
    """
    fmt = payload.get("format")
    if isinstance(fmt, str) and fmt.startswith(_API_PREFIX):
        version = fmt.removeprefix(_API_PREFIX)
        if fmt != API_FORMAT:
            raise CheckpointError(
                f"checkpoint {path} has format {fmt!r}, version {version} written by a newer "
                f"tandem; this one reads {API_FORMAT!r}: upgrade tandem to load it"
            )
        return "api"
    if all(k in payload for k in _TRAINER_KEYS):
        version = payload["format_version"]
        if isinstance(version, int) and version > FORMAT_VERSION:
            raise CheckpointError(
                f"checkpoint {path} has format version {version}, written by a newer tandem; "
                f"this one reads versions up to {FORMAT_VERSION}: upgrade tandem to load it"
            )
        return "trainer"
    raise CheckpointError(
        f"{path} is a checksummed torch.save file of a dict with keys "
        f"{sorted(map(str, payload))}, not a tandem checkpoint"
    )


def describe_file(path: Path) -> str:
    """What ``path`` is, in words, read from its first bytes and its place (never unpickled).

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     (Path(d) / "x.bin").write_bytes(b"")
        ...     describe_file(Path(d) / "x.bin")
        0
        'an empty file'
    """
    rank = _RANK_FILE.fullmatch(path.name)
    if rank and path.parent.parent.name == SHARDS_DIR:
        main = path.parent.parent.parent / f"{path.parent.name}.pt"
        return f"rank {int(rank[1])}'s shard file of the sharded checkpoint {main}"
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as e:
        return f"an unreadable file ({e.strerror or e})"
    if not head:
        return "an empty file"
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            torch_file = any(n.endswith("/data.pkl") or n == "data.pkl" for n in z.namelist())
        return "a torch.save file" if torch_file else "a zip file"
    if len(head) >= 9 and head[8:9] == b"{":
        (size,) = struct.unpack("<Q", head[:8])
        if 0 < size <= path.stat().st_size - 8:
            return "a safetensors file"
    if head[:1] == b"\x80":
        return "a pickle file (torch.save's legacy format, or pickle.dump)"
    if head.lstrip()[:1] == b"{":
        try:
            record = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError):
            return "a text file"
        if isinstance(record, dict) and "checkpoint" in record:
            return f"a Trainer's latest pointer (it names {record['checkpoint']!r})"
        return "a JSON file"
    return f"a file of an unknown format (it starts with {head[:16]!r})"


def _dir_hint(path: Path) -> str:
    found = list_checkpoints(path)
    if found:
        return (
            f"; it holds Trainer checkpoints ({', '.join(p.name for p in found)}): resume one "
            "with Trainer(resume=...), or pass one of those files"
        )
    return "; pass the file that tandem.checkpoint.save wrote"
