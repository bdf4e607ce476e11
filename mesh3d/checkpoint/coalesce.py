"""``coalesce``: stream a sharded checkpoint into Hugging Face ``model.safetensors``.

One process, no torch.distributed. The output header is built from the index (plain
state-dict keys, optional cast of floating tensors), then each tensor is assembled from
its chunks (checksums verified) and written straight after it: peak memory is about the
largest tensor plus its largest saved chunk, independent of model size. Above
``max_shard_bytes`` the output is numbered ``model-0000i-of-0000N.safetensors`` files plus
``model.safetensors.index.json``. Output is staged and renamed, so it is all or nothing.
Every safetensors dtype works (int, bool and fp8 included): sizes come from the dtype
table, never ``torch.finfo``.

Usage::

    coalesce("ckpt/step-100", "export/hf", dtype=torch.bfloat16)
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid

import torch

from mesh3d.checkpoint.chunks import Box
from mesh3d.checkpoint.errors import CheckpointError
from mesh3d.checkpoint.index import read_index
from mesh3d.checkpoint.progress import Progress
from mesh3d.checkpoint.reader import ShardReader
from mesh3d.checkpoint.save import fsync_dir
from mesh3d.checkpoint.st_format import DTYPES, ITEMSIZE, TORCH_TO_ST, plan_header

__all__ = ["coalesce", "HF_INDEX_NAME", "DEFAULT_MAX_SHARD_BYTES"]

HF_INDEX_NAME = "model.safetensors.index.json"
#: Hugging Face's own default shard size.
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def _out_dtype(saved: str, cast: torch.dtype | None) -> str:
    """Casts apply to floating tensors only: integer and bool buffers keep their dtype."""
    if cast is None or not DTYPES[saved].is_floating_point:
        return saved
    return TORCH_TO_ST[cast]


def _split(names: list[str], sizes: dict[str, int], limit: int) -> list[list[str]]:
    files: list[list[str]] = [[]]
    used = 0
    for name in names:
        if files[-1] and used + sizes[name] > limit:
            files.append([])
            used = 0
        files[-1].append(name)
        used += sizes[name]
    return files


def coalesce(
    path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = False,
) -> list[str]:
    """Write the model state of checkpoint ``path`` as HF safetensors into the new directory ``out``.

    Usage: ``checkpoint.coalesce("ckpt/step-100", "export/hf", dtype=torch.bfloat16)``

    Returns the written file names. Optimizer state is not exported.
    """
    path, out = os.path.abspath(os.fspath(path)), os.path.abspath(os.fspath(out))
    if os.path.lexists(out):
        raise CheckpointError(f"{out} already exists; coalesce writes a new directory (pick a new path)")
    if dtype is not None and dtype not in TORCH_TO_ST:
        raise CheckpointError(f"dtype={dtype} is not a safetensors dtype; use one of {sorted(map(str, TORCH_TO_ST))}")
    index = read_index(path)
    tensors = {n: e for n, e in index["tensors"].items() if e["role"] == "model"}
    out_dtype = {n: _out_dtype(e["dtype"], dtype) for n, e in tensors.items()}
    sizes = {n: math.prod(e["shape"]) * ITEMSIZE[out_dtype[n]] for n, e in tensors.items()}
    order = sorted(tensors, key=lambda n: (-ITEMSIZE[out_dtype[n]], n))
    groups = _split(order, sizes, max_shard_bytes) if sum(sizes.values()) > max_shard_bytes else [order]
    names = (["model.safetensors"] if len(groups) == 1
             else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    parent = os.path.dirname(out)
    staging = os.path.join(parent, f".{os.path.basename(out)}.tmp-{uuid.uuid4().hex[:12]}")
    os.makedirs(staging)
    bar = Progress(sum(sizes.values()), "coalesce", enabled=progress)
    try:
        with ShardReader(path, index) as reader:
            for file_name, group in zip(names, groups):
                _write_file(os.path.join(staging, file_name), group, tensors, out_dtype, reader, bar)
        if len(groups) > 1:
            weight_map = {n: f for f, g in zip(names, groups) for n in g}
            doc = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
            with open(os.path.join(staging, HF_INDEX_NAME), "w") as f:
                json.dump(doc, f, indent=2)
                f.flush()
                os.fsync(f.fileno())
            names.append(HF_INDEX_NAME)
        fsync_dir(staging)
        os.rename(staging, out)
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        bar.close()
    return names


def _write_file(file: str, group: list[str], tensors: dict, out_dtype: dict[str, str], reader: ShardReader,
                bar: Progress) -> None:
    header, ranges = plan_header({n: (out_dtype[n], tuple(tensors[n]["shape"])) for n in group}, {"format": "pt"})
    with open(file, "wb") as f:
        f.write(header)
        for name in sorted(group, key=lambda n: ranges[n][0]):
            entry = tensors[name]
            shape = tuple(entry["shape"])
            buf = torch.empty(shape, dtype=DTYPES[entry["dtype"]])
            if buf.numel():
                reader.read_into(name, Box((0,) * len(shape), shape), buf)
            buf = buf.to(DTYPES[out_dtype[name]]).reshape(-1)
            if buf.numel():
                f.write(memoryview(buf.view(torch.uint8).numpy()))
            bar.update(ranges[name][1] - ranges[name][0])
            del buf
        f.flush()
        os.fsync(f.fileno())
