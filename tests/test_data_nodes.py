"""Node fields from zarr: each domain rank reads its own nodes (and with ``halo=`` its halo) and, counted by the
store, only the chunks that hold them; the rows equal the whole array's; ``to_domain`` lays a batch out as nodes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

zarr = pytest.importorskip("zarr")

CHUNK, F = 16, 3


def test_each_rank_reads_only_the_chunks_of_its_nodes_and_halo(tmp_path):
    from mesh3d import graphs
    from mesh3d.data import NodeDataset, StoredArray

    mesh = graphs.channel_mesh(40, 16)
    n = mesh.num_nodes
    order = np.argsort(graphs.partition.sfc_keys(mesh.points))  # renumber the nodes along the curve, as a mesh file
    renumber = np.empty(n, dtype=np.int64)
    renumber[order] = np.arange(n)
    points, edges = mesh.points[order], renumber[mesh.edges]
    whole = np.random.default_rng(0).standard_normal((2, n, F)).astype(np.float32)
    path = str(tmp_path / "flow.zarr")
    zarr.create_array(path, shape=whole.shape, chunks=(1, CHUNK, F), dtype=whole.dtype, compressors=None)[:] = whole
    d = 4
    part = graphs.sfc_partition(points, d, sizes=(n // 8, n // 4, 0, n - n // 8 - n // 4))
    g = graphs.Graph(edges, part)
    chunk_bytes = CHUNK * F * 4
    for rank in range(d):
        ds = NodeDataset({"x": StoredArray(path)}, part, rank=rank, halo=g)
        before = ds.bytes_read
        sample = ds[1]
        ids, halo = part.items(rank), g.halo(part, rank).halo_ids
        assert torch.equal(sample["x"], torch.from_numpy(whole[1, ids]))
        assert torch.equal(sample["x_halo"], torch.from_numpy(whole[1, halo]))
        chunks = len(np.unique(ids // CHUNK)) + len(np.unique(halo // CHUNK))  # at most: own and halo chunks apart
        assert 0 < ds.bytes_read - before <= chunks * chunk_bytes or (len(ids) == 0 and ds.bytes_read == before)
        assert ds.bytes_read - before < whole[1].nbytes  # never the whole sample


def test_a_batch_becomes_graph_tensors_of_the_partition():
    from mesh3d import graphs
    from mesh3d.data import NodeDataset

    whole = np.arange(2 * 10 * 2, dtype=np.float32).reshape(2, 10, 2)
    part = graphs.Partition(np.zeros(10, dtype=int), 1)
    ds = NodeDataset({"x": whole}, part)
    batch = ds.to_domain({"x": torch.stack([ds[0]["x"], ds[1]["x"]]), "index": torch.tensor([0, 1])})
    assert batch["x"].spec.items == part and batch["x"].spec.dim == 1 and tuple(batch["x"].shape) == (2, 10, 2)
    with pytest.raises(ValueError, match="every array must be"):
        NodeDataset({"x": whole[:, :9]}, part)
