"""The safetensors file layout, written and parsed by hand so that writes can stream.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
(``{name: {dtype, shape, data_offsets}}`` plus an optional string-only ``__metadata__``),
then the data buffer. Tensors are laid out contiguously in header order; we order them by
item size (largest first) so every tensor is naturally aligned, and pad the JSON with
spaces so the data buffer starts on a 4 KiB boundary (legal, and O_DIRECT friendly).

Usage::

    header, data_start = plan_header({"w": ("F32", (10, 6))})
    entries = read_header(path)       # {name: (dtype, shape, (begin, end))}, data_start
"""

from __future__ import annotations

import json
import math
import os
import struct

import torch

from mesh3d.checkpoint.errors import CheckpointFormatError

__all__ = [
    "DTYPES",
    "ITEMSIZE",
    "TORCH_TO_ST",
    "HEADER_ALIGN",
    "MAX_HEADER_BYTES",
    "plan_header",
    "read_header",
]

#: safetensors dtype name -> torch dtype (every dtype both sides know).
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F8_E4M3", "float8_e4m3fn"),
                     ("F8_E5M2", "float8_e5m2"), ("C64", "complex64")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)
TORCH_TO_ST: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
ITEMSIZE: dict[str, int] = {k: v.itemsize for k, v in DTYPES.items()}

HEADER_ALIGN = 4096
#: The safetensors reference implementation refuses larger headers; so do we.
MAX_HEADER_BYTES = 100_000_000


def plan_header(
    tensors: dict[str, tuple[str, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """Header bytes (length prefix included) and each tensor's absolute [begin, end) in the file.

    Order is item size descending, then name, so each tensor is naturally aligned.
    """
    order = sorted(tensors, key=lambda n: (-ITEMSIZE[tensors[n][0]], n))
    doc: dict[str, object] = {}
    if metadata:
        doc["__metadata__"] = dict(metadata)
    relative: dict[str, tuple[int, int]] = {}
    cursor = 0
    for name in order:
        dtype, shape = tensors[name]
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        relative[name] = (cursor, cursor + nbytes)
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [cursor, cursor + nbytes]}
        cursor += nbytes
    text = json.dumps(doc, separators=(",", ":")).encode()
    padded = -(-(8 + len(text)) // HEADER_ALIGN) * HEADER_ALIGN - 8
    header = struct.pack("<Q", padded) + text + b" " * (padded - len(text))
    start = len(header)
    return header, {n: (start + b, start + e) for n, (b, e) in relative.items()}


def read_header(path: str) -> tuple[dict[str, tuple[str, tuple[int, ...], tuple[int, int]]], int]:
    """Parse a safetensors header: ``{name: (dtype, shape, absolute (begin, end))}`` and the data start.

    Raises :class:`CheckpointFormatError` naming ``path`` for any malformed header.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointFormatError(f"{path}: truncated safetensors file ({size} bytes; the header length alone needs 8)")
        (n,) = struct.unpack("<Q", prefix)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointFormatError(
                f"{path}: safetensors header claims {n} bytes but the file has {size} (truncated or corrupt)"
            )
        raw = f.read(n)
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointFormatError(f"{path}: safetensors header is not valid JSON ({err})") from None
    if not isinstance(doc, dict):
        raise CheckpointFormatError(f"{path}: safetensors header must be a JSON object")
    start = 8 + n
    out: dict[str, tuple[str, tuple[int, ...], tuple[int, int]]] = {}
    for name, entry in doc.items():
        if name == "__metadata__":
            continue
        try:
            dtype = entry["dtype"]
            shape = tuple(int(x) for x in entry["shape"])
            b, e = (int(x) for x in entry["data_offsets"])
            if any(n < 0 for n in shape):
                raise ValueError
        except (TypeError, KeyError, ValueError):
            raise CheckpointFormatError(f"{path}: malformed header entry for tensor {name!r}: {entry!r}") from None
        if not isinstance(dtype, str) or dtype not in ITEMSIZE:
            raise CheckpointFormatError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        if not 0 <= b <= e or start + e > size or e - b != math.prod(shape) * ITEMSIZE[dtype]:
            raise CheckpointFormatError(
                f"{path}: tensor {name!r} data_offsets {[b, e]} do not fit its shape {list(shape)} and the file size {size}"
            )
        out[name] = (dtype, shape, (start + b, start + e))
    return out, start
