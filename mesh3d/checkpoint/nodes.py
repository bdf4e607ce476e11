"""Node-partitioned tensors (a graph layout's rows: per-node parameters, their optimizer states) saved rank by rank and
loaded onto any partition, any number of ranks.

Usage::

    checkpoint.save_nodes("ckpt/nodes", {"mesh_embed": local_rows, "mesh_embed.exp_avg": m}, part, extra={"step": 4})
    rows, extra = checkpoint.load_nodes("ckpt/nodes", new_part)   # this rank's rows of ``new_part``, ascending ids

Each domain rank writes its rows with their global node ids to ``nodes-<rank>.safetensors`` (a temporary file renamed
into place), and the partition it was written with to ``partition.safetensors``; rank 0 writes ``nodes.json`` last
(every file's xxh3 checksum, the tensors' global shapes and dtypes), atomically. A load reads the index, finds which
files hold its new rows from the saved partition, verifies each file it opens against its checksum and takes its rows.
Nothing is pickled. Every rank calls both (ranks of other batch or model indices hold copies and write nothing).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from mesh3d.checkpoint.checksum import WRITE_ALGORITHM
from mesh3d.checkpoint.comm import collective_step
from mesh3d.checkpoint.errors import CheckpointError
from mesh3d.checkpoint.save import write_file_atomic
from mesh3d.domain.core.specs import GraphSpec
from mesh3d.domain.core.tensor import DomainTensor, unwrap
from mesh3d.graphs import Partition
from mesh3d.manager import DistributedManager

__all__ = ["load_nodes", "save_nodes"]

INDEX, PARTITION, FORMAT = "nodes.json", "partition.safetensors", "mesh3d-nodes"


def _where() -> tuple[int, bool]:
    """This rank's domain index, and whether it writes (batch and model index 0)."""
    if not DistributedManager.is_initialized():
        return 0, True
    dm = DistributedManager()
    return dm.axis_rank("domain"), dm.axis_rank("batch") == 0 and dm.axis_rank("model") == 0


def _rows(name: str, t: torch.Tensor, part: Partition, me: int) -> tuple[torch.Tensor, int]:
    if isinstance(t, DomainTensor):
        spec = t._spec
        if not isinstance(spec, GraphSpec) or spec.items != part:
            raise CheckpointError(f"save_nodes: {name} is not laid out by the partition given ({part})")
        return unwrap(t).detach().contiguous(), spec.dim
    if t.ndim == 0 or t.shape[0] != part.counts[me]:
        raise CheckpointError(f"save_nodes: {name} has shape {tuple(t.shape)}; this rank's rows of the partition are "
                              f"{part.counts[me]} along dim 0 (or pass the graph domain tensor)")
    return t.detach().contiguous(), 0


def save_nodes(path: str, tensors: Mapping[str, torch.Tensor], partition: Partition, *, extra: Any = None) -> None:
    """Write this rank's rows of every node tensor (see the module docstring); collective over every rank.

    Usage: ``save_nodes("ckpt/nodes", {"embed": rows}, part, extra={"step": 10})``
    """
    me, writes = _where()

    def write() -> dict[str, Any]:
        os.makedirs(path, exist_ok=True)
        if not writes:
            return {}
        rows = {name: _rows(name, t, partition, me) for name, t in tensors.items()}
        payload = {name: r for name, (r, _) in rows.items()}
        payload["__ids__"] = torch.from_numpy(np.array(partition.items(me), dtype=np.int64))
        data = save_bytes(payload)
        file = f"nodes-{me:05d}.safetensors"
        write_file_atomic(os.path.join(path, file), data)
        if me == 0:
            write_file_atomic(os.path.join(path, PARTITION),
                          save_bytes({"owner": torch.from_numpy(np.array(partition.owner, dtype=np.int32))}))
        meta = {name: {"dim": dim, "dtype": str(r.dtype).removeprefix("torch."),
                       "shape": [partition.n if k == dim else s for k, s in enumerate(r.shape)]}
                for name, (r, dim) in rows.items()}
        return {"rank": me, "file": file, "rows": partition.counts[me], "xxh3_64": WRITE_ALGORITHM.of(data),
                "tensors": meta}

    _, shared = collective_step("save_nodes: write this rank's rows", write, share=lambda info: info)
    files = sorted((s for s in shared if s), key=lambda s: s["rank"])

    def commit() -> None:
        if me != 0 or not writes:
            return
        with open(os.path.join(path, PARTITION), "rb") as f:
            part_sum = WRITE_ALGORITHM.of(f.read())
        index = {"format": FORMAT, "version": 1, "num_nodes": partition.n, "parts": partition.parts,
                 "partition_digest": partition.digest, "partition_xxh3_64": part_sum, "tensors": files[0]["tensors"],
                 "files": [{k: s[k] for k in ("rank", "file", "rows", "xxh3_64")} for s in files], "extra": extra}
        write_file_atomic(os.path.join(path, INDEX), json.dumps(index, indent=1).encode())

    collective_step("save_nodes: commit the index", commit)


def _verified(path: str, name: str, checksum: str) -> bytes:
    with open(os.path.join(path, name), "rb") as f:
        data = f.read()
    if WRITE_ALGORITHM.of(data) != checksum:
        raise CheckpointError(f"load_nodes: {os.path.join(path, name)} does not match its checksum in {INDEX}: the file "
                              "is corrupt or was replaced")
    return data


def load_nodes(path: str, partition: Partition, rank: int | None = None) -> tuple[dict[str, torch.Tensor], Any]:
    """This rank's rows (its items of ``partition``, ascending ids) of every saved node tensor, and the saved ``extra``.

    Usage: ``rows, extra = load_nodes("ckpt/nodes", part)``; ``domain.nodes_from_local(rows["embed"], part)``
    Reads only the files holding its rows, each verified. Not collective.
    """
    me = _where()[0] if rank is None else rank
    try:
        with open(os.path.join(path, INDEX)) as f:
            index = json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"load_nodes: no readable {INDEX} in {path} ({err}); was save_nodes completed?") from err
    if index.get("format") != FORMAT:
        raise CheckpointError(f"load_nodes: {path}/{INDEX} is not a node checkpoint (format {index.get('format')!r})")
    if index["num_nodes"] != partition.n:
        raise CheckpointError(f"load_nodes: the checkpoint holds {index['num_nodes']} nodes, the partition {partition.n}")
    old = load_bytes(_verified(path, PARTITION, index["partition_xxh3_64"]))["owner"].numpy()
    mine = partition.items(me)
    files = {f["rank"]: f for f in index["files"]}
    out: dict[str, torch.Tensor] = {}
    for source in np.unique(old[mine]) if len(mine) else []:
        entry = files[int(source)]
        data = load_bytes(_verified(path, entry["file"], entry["xxh3_64"]))
        ids = data.pop("__ids__").numpy()
        wanted = mine[old[mine] == source]
        take = torch.from_numpy(np.searchsorted(ids, wanted))
        at = torch.from_numpy(np.searchsorted(mine, wanted))
        for name, meta in index["tensors"].items():
            if name not in out:
                shape = [len(mine) if k == meta["dim"] else s for k, s in enumerate(meta["shape"])]
                out[name] = torch.empty(shape, dtype=getattr(torch, meta["dtype"]))
            out[name].index_copy_(meta["dim"], at, data[name].index_select(meta["dim"], take))
    for name, meta in index["tensors"].items():  # a rank without rows: empty tensors of the right shape
        if name not in out:
            out[name] = torch.empty([0 if k == meta["dim"] else s for k, s in enumerate(meta["shape"])],
                                    dtype=getattr(torch, meta["dtype"]))
    return out, index.get("extra")
