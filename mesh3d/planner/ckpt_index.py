"""About how large a checkpoint's ``index.json`` will be, without writing one.

The index (``mesh3d/checkpoint/index.py``) is JSON with one indent per level: every tensor's entry (dtype,
shape, layout, role), one record per saved chunk (file, key, offsets, shape, byte range, one checksum per
256 KiB block), the shard files, the optimizer's hyperparameters and step counters. Here the same document is
built without its chunk records and files, which are added per class of ranks (one class's records times its
count). Within a few percent: the layout strings and the optimizer's JSON are reconstructed, not read.

Usage::

    size = index_bytes(CheckpointLayout(layout, "adamw"), [(rank, count), ...], "adamw")
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii
from typing import Any

import torch

from mesh3d.checkpoint.index import FORMAT, VERSION
from mesh3d.checkpoint.st_format import TORCH_TO_ST
from mesh3d.checkpoint.state import encode_value
from mesh3d.planner.ckpt_plan import CheckpointLayout, Entry

__all__ = ["indented_size", "index_bytes"]

_OPTIMIZERS: dict[str, Any] = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam,
                               "sgd": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9)}


def _layout_text(ckpt: CheckpointLayout, e: Entry) -> str:
    """``str(tuple(placements))`` of the saved DTensor ("plain" for plain tensors)."""
    p, sharding, model = e.param, ckpt.layout.sharding, ckpt.layout.mesh.model
    if p is None or not (sharding.fsdp or p.tp_style):
        return "plain"
    tp = f"Shard(dim={p.tp_dim})" if p.tp_dim is not None else "Replicate()"
    if not sharding.fsdp:
        return f"({tp},)"
    first = f"_StridedShard(dim=0, sf={model})" if p.tp_dim == 0 else "Shard(dim=0)"
    parts = ([] if sharding.mode == "fsdp" else ["Replicate()"]) + [first] + ([tp] if p.tp_style else [])
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


def _optimizer_json(ckpt: CheckpointLayout, optimizer: str) -> dict[str, Any] | None:
    make = _OPTIMIZERS.get(optimizer.lower())
    if make is None:
        return None
    opt = make([torch.nn.Parameter(torch.zeros(1))])
    names = [p.name for p in ckpt.layout.params]
    group = {k: (names if k == "params" else encode_value(v, k)) for k, v in opt.param_groups[0].items()}
    step = {"step": {"__tensor__": 1.0, "dtype": "F32"}} if optimizer.lower() in ("adam", "adamw") else {}
    return {"type": type(opt).__name__, "param_groups": [group],
            "scalars": {p.name: step for p in ckpt.layout.params if p.requires_grad and step}}


def indented_size(value: Any) -> tuple[int, int]:
    """(characters, lines) of ``json.dumps(value, indent=1)`` (any ``sort_keys``), without building the text.

    NOTE: ``json.dumps`` with an indent runs the pure-Python encoder; a job of thousands of ranks has thousands of
    chunk records, and dumping each took a third of a second of ``mesh3d plan``. Lines are indented one space per
    level, so a value whose text at depth 0 has ``n`` characters and ``k`` lines takes ``n + d * (k - 1)`` at depth
    ``d`` (its first line's indent belongs to its parent).
    """
    if isinstance(value, str):
        return len(encode_basestring_ascii(value)), 1
    if value is None or isinstance(value, bool):
        return len(json.dumps(value)), 1
    if isinstance(value, int):
        return len(str(value)), 1
    if isinstance(value, float):
        return len(json.dumps(value)), 1
    if isinstance(value, dict):
        items = list(value.items())
        if not items:
            return 2, 1
        sizes = [indented_size(v) for _, v in items]
        keys = sum(len(encode_basestring_ascii(str(k))) + 2 for k, _ in items)
        return keys + sum(n + k for n, k in sizes) + 2 * len(items) + 2, 2 + sum(k for _, k in sizes)
    if isinstance(value, (list, tuple)):
        if not value:
            return 2, 1
        if all(type(v) is str for v in value):  # NOTE: a record's block checksums: one string per 256 KiB
            return sum(map(len, map(encode_basestring_ascii, value))) + 3 * len(value) + 2, 2 + len(value)
        sizes = [indented_size(v) for v in value]
        return sum(n + k for n, k in sizes) + 2 * len(value) + 2, 2 + sum(k for _, k in sizes)
    raise TypeError(f"{type(value).__name__} is not JSON")


def _nested(value: Any, depth: int) -> int:
    """Bytes of a JSON value dumped at ``depth`` levels of one-space indent, with its trailing ",\\n"."""
    chars, lines = indented_size(value)
    return chars + depth * lines + 2


def index_bytes(ckpt: CheckpointLayout, classes: list[tuple[int, int]], optimizer: str) -> int:
    """``index.json``'s size for ranks in ``classes`` ((example rank, count) pairs covering every rank)."""
    tensors: dict[str, Any] = {}
    for e in ckpt.entries:
        tensors[e.name] = {"chunks": [], "dtype": TORCH_TO_ST[e.dtype], "layout": _layout_text(ckpt, e),
                           "role": e.role, "shape": list(e.shape)}
        if e.param is not None and e.role == "optimizer":
            tensors[e.name].update(param=e.param.name, state_key=e.name.rsplit(".", 1)[1])
    mesh = ckpt.layout.mesh
    doc = {"format": FORMAT, "version": VERSION, "step": 1, "extra": None, "data": None, "checksum": "xxh3_64",
           "checksum_block_bytes": ckpt.block, "world_size": ckpt.world,
           "mesh": {"axes": ["batch", "domain", "model"], "shape": [mesh.batch, mesh.domain, mesh.model]},
           "created_unix": 1795612114.720977, "files": {}, "tensors": tensors,
           "optimizer": _optimizer_json(ckpt, optimizer), "index_crc32": 4294967295}
    total = len(json.dumps(doc, sort_keys=True, indent=1))
    for rank, count in classes:
        records = sum(_nested(r, 4) for r in ckpt.chunk_records(rank))
        files = sum(_nested({"bytes": size, "rank": rank}, 2) + len(name) + 4
                    for name, size in ckpt.files(rank).items())
        total += count * (records + files)
    return total
