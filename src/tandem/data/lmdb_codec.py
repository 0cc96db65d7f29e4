"""Samples to bytes and back, without pickle: what :mod:`tandem.data.lmdb` stores per key.

pickle would run whatever code a file names when it is loaded, and an LMDB file is data that
gets copied between machines and people; ``torch.save`` adds a zip archive (kilobytes, and
milliseconds) around every small sample. So a sample is written as a JSON tree that describes its
structure and points into one byte payload:

    b"TDS1" | header length (4 bytes, big-endian) | JSON header | payload

Python's None, bools, ints (any size), floats and strings are JSON values themselves. Everything
else is a one-key JSON object, which no Python value encodes to, so decoding is unambiguous:

    {"L": [...]} list      {"T": [...]} tuple      {"D": [[key, value], ...]} dict
    {"B": [offset, length]} bytes
    {"P": [dtype, shape, offset, length]} torch tensor (its raw bytes, native byte order)
    {"A": [dtype, shape, offset, length]} numpy array, {"N": [...]} numpy scalar: raw bytes;
        for record dtypes [null, null, offset, length] of .npy bytes (``allow_pickle=False``)

Tuple and dict subclasses (namedtuples, OrderedDict) come back as plain tuples and dicts, which
compare equal; bytearrays come back as bytes; tensors come back contiguous, on the CPU, without
``requires_grad``.

torch and numpy are looked up in ``sys.modules`` instead of imported: a value cannot be a
tensor unless torch is loaded, so a data set of numbers and strings never pays for torch.
"""

from __future__ import annotations

import io
import json
import sys
from typing import Any

MAGIC = b"TDS1"
_HEADER_LEN_BYTES = 4


def encode_sample(sample: Any) -> bytes:
    """Serialize ``sample`` (tensors, numpy arrays and scalars, numbers, strings, bytes, None,
    nested in tuples, lists and dicts) into bytes that :func:`decode_sample` reads back.

    Args:
        sample: the value to encode.

    Raises:
        ValueError: a value of another type (or an object-dtype array, a sparse tensor); the
            message gives its location in the sample, e.g. ``sample['image'][1]``.

    Example::

        data = encode_sample({"x": torch.ones(2), "y": 3})
        assert decode_sample(data)["y"] == 3
    """
    chunks: list[bytes] = []
    offset = [0]

    def add(data: bytes) -> list[int]:
        chunks.append(data)
        start = offset[0]
        offset[0] += len(data)
        return [start, len(data)]

    header = json.dumps(_encode(sample, add, "sample"), separators=(",", ":")).encode()
    return b"".join([MAGIC, len(header).to_bytes(_HEADER_LEN_BYTES, "big"), header, *chunks])


def decode_sample(data: bytes | memoryview) -> Any:
    """The value :func:`encode_sample` encoded into ``data``; every array is a fresh copy.

    Args:
        data: the encoded bytes (a memoryview into an LMDB page works and is not kept).

    Raises:
        ValueError: ``data`` is not an encoded sample (wrong magic, truncated, bad header).

    Example::

        assert decode_sample(encode_sample((1, "a"))) == (1, "a")
    """
    view = memoryview(data)
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise ValueError(f"not an encoded sample: starts with {bytes(view[:4])!r}, not {MAGIC!r}")
    start = len(MAGIC) + _HEADER_LEN_BYTES
    header_len = int.from_bytes(view[len(MAGIC) : start], "big")
    if start + header_len > len(view):
        raise ValueError(
            f"truncated sample: header of {header_len} bytes but only {len(view) - start} left"
        )
    try:
        tree = json.loads(bytes(view[start : start + header_len]))
    except ValueError as exc:
        raise ValueError(f"corrupt sample header: {exc}") from exc
    return _decode(tree, view[start + header_len :])


def _encode(value: Any, add: Any, where: str) -> Any:
    # Order matters: bool is an int, numpy's float64 is a float and str_ a str; the more
    # specific types come first so that they come back as themselves.
    np = sys.modules.get("numpy")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return {"P": _tensor(value, add, where, torch)}
    if np is not None and isinstance(value, np.ndarray):
        return {"A": _array(value, add, where, np)}
    if np is not None and isinstance(value, np.generic):
        return {"N": _array(value, add, where, np)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"B": add(bytes(value))}
    if isinstance(value, tuple):
        return {"T": [_encode(v, add, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return {"L": [_encode(v, add, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        return {
            "D": [
                [_encode(k, add, f"{where} key {k!r}"), _encode(v, add, f"{where}[{k!r}]")]
                for k, v in value.items()
            ]
        }
    raise ValueError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which cannot be "
        "stored: use tensors, numpy arrays, numbers, strings, bytes, None, and tuples, lists "
        "and dicts of them"
    )


def _tensor(value: Any, add: Any, where: str, torch: Any) -> list:
    if value.layout != torch.strided or value.is_quantized:
        raise ValueError(
            f"{where} is a {value.layout} tensor (quantized={value.is_quantized}); only dense "
            "tensors can be stored: convert it with .to_dense() or .dequantize()"
        )
    # Viewing as bytes needs a contiguous CPU tensor with its conjugate/negative bits resolved.
    t = value.detach().cpu().resolve_conj().resolve_neg().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return [str(t.dtype).removeprefix("torch."), list(t.shape), *add(raw)]


def _array(value: Any, add: Any, where: str, np: Any) -> list:
    array = np.asarray(value)  # not ascontiguousarray, which makes scalars 1-d
    if array.dtype.hasobject:
        raise ValueError(
            f"{where} is a numpy array of dtype {array.dtype}, which holds Python objects; "
            "only arrays of numbers, bools, strings and records of them can be stored"
        )
    if array.dtype.names is None and array.dtype.subdtype is None and array.dtype.itemsize:
        # dtype.str ("<f4", ">i2", "<U5", "<M8[ns]") names the dtype and byte order exactly.
        return [array.dtype.str, list(array.shape), *add(array.tobytes(order="C"))]
    # Records and zero-size items: the .npy format describes them (its header is parsed with
    # ast.literal_eval, ten times slower than the raw path, so it is only the fallback).
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, array, allow_pickle=False)
    return [None, None, *add(buffer.getvalue())]


def _decode(node: Any, payload: memoryview) -> Any:
    if not isinstance(node, dict):
        return node
    ((tag, body),) = node.items()
    if tag == "L":
        return [_decode(v, payload) for v in body]
    if tag == "T":
        return tuple(_decode(v, payload) for v in body)
    if tag == "D":
        return {_decode(k, payload): _decode(v, payload) for k, v in body}
    if tag == "B":
        return bytes(_slice(payload, *body))
    if tag == "P":
        return _decode_tensor(payload, *body)
    if tag in ("A", "N"):
        array = _decode_array(payload, *body)
        # A scalar was written as a 0-d array; [()] turns it back into np.float32 & co.
        return array if tag == "A" else array[()]
    raise ValueError(f"corrupt sample: unknown tag {tag!r}")


def _decode_tensor(payload: Any, dtype_name: str, shape: list[int], start: int, length: int):
    import torch

    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"corrupt sample: {dtype_name!r} is not a torch dtype")
    if length == 0:
        return torch.empty(shape, dtype=dtype)
    # bytearray: a writable copy, owned by the tensor, independent of the LMDB page.
    raw = torch.frombuffer(bytearray(_slice(payload, start, length)), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def _decode_array(payload: Any, dtype_str: str | None, shape: Any, start: int, length: int):
    import numpy as np

    raw = _slice(payload, start, length)
    if dtype_str is None:
        return np.lib.format.read_array(io.BytesIO(raw), allow_pickle=False)
    # bytearray: writable (torch warns about read-only arrays) and independent of the page.
    return np.frombuffer(bytearray(raw), dtype=np.dtype(dtype_str)).reshape(shape)


def _slice(payload: memoryview, start: int, length: int) -> memoryview:
    if start < 0 or length < 0 or start + length > len(payload):
        raise ValueError(
            f"corrupt sample: bytes [{start}, {start + length}) outside a payload of "
            f"{len(payload)} bytes"
        )
    return payload[start : start + length]
