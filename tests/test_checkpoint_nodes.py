"""Node-partitioned tensors (per-node parameters and their Adam states) saved on 4 ranks with a random uneven
partition (one part empty) and loaded onto 2 and 3 ranks with other partitions, and in one process: every rank gets
exactly its rows of the whole tensors; a corrupt file or a partition of another size is refused."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from graph_models import uneven_partition

N = 57


def _whole():
    g = torch.Generator().manual_seed(3)
    return {"embed": torch.randn(N, 4, generator=g, dtype=torch.float64),
            "embed.exp_avg": torch.randn(N, 4, generator=g), "count": torch.arange(N, dtype=torch.int64)}


def _save_body(path):
    import torch.distributed as dist

    from mesh3d import DistributedManager, checkpoint, domain

    d = dist.get_world_size()
    DistributedManager.initialize(batch=1, domain=d)
    part = uneven_partition(N, d, 5, empty=2)
    me = dist.get_rank()
    rows = {k: v.index_select(0, part.tensor("items", me)) for k, v in _whole().items()}
    rows["embed"] = domain.shard_nodes(_whole()["embed"], part)  # a graph domain tensor is taken as is
    checkpoint.save_nodes(path, rows, part, extra={"step": 4})
    return part.counts


def _load_body(path, seed):
    import torch.distributed as dist

    from mesh3d import DistributedManager, checkpoint, graphs

    d = dist.get_world_size()
    DistributedManager.initialize(batch=1, domain=d)
    part = graphs.Partition(np.random.default_rng(seed).integers(0, d, N), d)
    rows, extra = checkpoint.load_nodes(path, part)
    me = dist.get_rank()
    return extra, all(torch.equal(rows[k], v.index_select(0, part.tensor("items", me))) for k, v in _whole().items()), \
        {k: (tuple(t.shape), t.dtype) for k, t in rows.items()}


def test_node_tensors_saved_on_4_ranks_load_on_2_and_3_and_in_one_process(ranks, tmp_path):
    from mesh3d import checkpoint, graphs
    from mesh3d.checkpoint import CheckpointError

    path = str(tmp_path / "nodes")
    counts = ranks.run(4, _save_body, path, timeout=60)[0]
    assert counts[2] == 0 and sorted(os.listdir(path)) == ["nodes-00000.safetensors", "nodes-00001.safetensors",
                                                         "nodes-00002.safetensors", "nodes-00003.safetensors",
                                                         "nodes.json", "partition.safetensors"]
    for world in (2, 3):
        for extra, same, shapes in ranks.run(world, _load_body, path, world, timeout=60):
            assert extra == {"step": 4} and same, shapes
    rows, _ = checkpoint.load_nodes(path, graphs.Partition(np.zeros(N, dtype=int), 1))
    assert all(torch.equal(rows[k], v) for k, v in _whole().items())
    with pytest.raises(CheckpointError, match="holds 57 nodes, the partition 56"):
        checkpoint.load_nodes(path, graphs.Partition(np.zeros(N - 1, dtype=int), 1))
    with open(os.path.join(path, "nodes-00001.safetensors"), "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"xyz")
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        checkpoint.load_nodes(path, graphs.Partition(np.zeros(N, dtype=int), 1))
