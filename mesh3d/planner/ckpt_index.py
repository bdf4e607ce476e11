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
from typing import Any

import torch

from mesh3d.checkpoint.index import FORMAT, VERSION
from mesh3d.checkpoint.st_format import TORCH_TO_ST
from mesh3d.checkpoint.state import encode_value
from mesh3d.planner.ckpt_plan import CheckpointLayout, Entry

__all__ = ["index_bytes"]

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


def _nested(text: str, depth: int) -> int:
    """Bytes of a JSON value dumped at ``depth`` levels of one-space indent, with its trailing ",\\n"."""
    return len(text) + depth * (text.count("\n") + 1) + 2


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
        records = sum(_nested(json.dumps(r, sort_keys=True, indent=1), 4) for r in ckpt.chunk_records(rank))
        files = sum(_nested(json.dumps({"bytes": size, "rank": rank}, indent=1), 2) + len(name) + 4
                    for name, size in ckpt.files(rank).items())
        total += count * (records + files)
    return total
