"""``mesh3d.graphs`` in one process: partitions (any assignment, uneven, empty), the partitioners (Hilbert and Morton
curves, grid blocks, lat/lon blocks, METIS and its BFS fallback), halo plans that agree between every pair of ranks,
and the meshes (icosahedral refinements, the channel, grid-to-mesh and mesh-to-grid edges); bad input named."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mesh3d import graphs
from mesh3d.domain.core.specs import grid_coords
from mesh3d.graphs.partition import sfc_keys


def test_a_partition_is_its_owner_array_with_each_rank_s_items_ascending():
    p = graphs.Partition([2, 0, 2, 0, 0], 4)
    assert p.counts == (3, 0, 2, 0) and list(p.items(0)) == [1, 3, 4] and list(p.items(1)) == []
    assert list(p.local_index) == [0, 0, 1, 1, 2] and list(p.order) == [1, 3, 4, 0, 2]
    assert p == graphs.Partition(np.array([2, 0, 2, 0, 0]), 4) and p != graphs.Partition([2, 0, 2, 0, 0], 3)
    assert p.take(np.array([True, False, True, True, False])).counts == (1, 0, 2, 0)
    assert graphs.Partition.concat([p, graphs.Partition([1], 4)]).counts == (3, 1, 2, 0)
    assert torch.equal(p.tensor("items", 2), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="owners must lie in 0..1"):
        graphs.Partition([0, 2], 2)
    with pytest.raises(ValueError, match="1-D array of ints"):
        graphs.Partition([0.5, 1.0], 2)
    with pytest.raises(ValueError, match="summing to the 5 items"):
        graphs.partition.split_order(np.arange(5), 2, sizes=(2, 2))


def test_curves_keep_neighbours_close_and_cut_into_the_sizes_asked():
    side = 16
    xy = np.stack(np.meshgrid(np.arange(side), np.arange(side), indexing="ij"), -1).reshape(-1, 2).astype(float)
    for curve in ("hilbert", "morton"):
        order = np.argsort(sfc_keys(xy, curve))
        steps = np.abs(np.diff(xy[order], axis=0)).sum(1)
        if curve == "hilbert":  # a Hilbert curve moves to a grid neighbour at every step
            assert set(steps) == {1.0}
        assert len(np.unique(sfc_keys(xy, curve))) == side * side
    p = graphs.sfc_partition(xy, 3, sizes=(10, 0, side * side - 10))
    assert p.counts == (10, 0, side * side - 10)
    with pytest.raises(ValueError, match="curve="):
        sfc_keys(xy, "peano")


def test_grid_blocks_are_owned_as_the_domain_grid_orders_its_ranks():
    sizes = ((2, 3), (4, 0, 4))
    p = graphs.grid_block_partition(sizes)
    owner = p.owner.reshape(5, 8)
    for r in range(6):
        bi, bj = grid_coords(r, (2, 3))
        rows = slice(sum(sizes[0][:bi]), sum(sizes[0][:bi + 1]))
        cols = slice(sum(sizes[1][:bj]), sum(sizes[1][:bj + 1]))
        assert (owner[rows, cols] == r).all()
    lat, lon = np.linspace(80, -80, 5), np.arange(8) * 45.0
    mesh = graphs.latlon_block_partition(np.array([80.0, -80.0, 0.0]), np.array([10.0, 350.0, 180.0]), lat, lon, sizes)
    assert list(mesh.owner) == [0, 3, 5]  # north-west block; south, wrapped to column 0; the equator's east block


def test_metis_and_its_fallback_cut_few_edges_of_a_mesh():
    mesh = graphs.icosahedral_mesh(3)
    random = graphs.Partition(np.random.default_rng(0).integers(0, 4, mesh.num_nodes), 4)
    worst = sum(graphs.Graph(mesh.edges, random).halo_counts(random))
    for method in ("metis", "bfs") if graphs.metis_available() else ("bfs",):
        p = graphs.metis_partition(mesh.edges, mesh.num_nodes, 4, method=method)
        assert sum(p.counts) == mesh.num_nodes and sum(graphs.Graph(mesh.edges, p).halo_counts(p)) < worst / 3
    with pytest.raises(ValueError, match="must be \\(2, E\\)"):
        graphs.metis_partition(np.zeros((3, 4), dtype=int), 4, 2)


def test_halo_plans_agree_between_every_pair_of_ranks_and_name_every_node_read():
    mesh = graphs.channel_mesh(12, 6)
    src = graphs.Partition(np.random.default_rng(1).integers(0, 3, mesh.num_nodes), 3)
    g = graphs.Graph(mesh.edges, src)
    plans = [g.halo(src, r) for r in range(3)]
    for r, plan in enumerate(plans):
        assert list(g.edges.items(r)) == list(np.flatnonzero(src.owner[mesh.edges[1]] == r))  # edges at destinations
        start = 0
        for q, n in plan.recv:  # what r receives from q, in order, is what q sends r
            sent = dict(plans[q].send)[r].numpy()
            assert np.array_equal(src.items(q)[sent], plan.halo_ids[start:start + n])
            assert (src.owner[plan.halo_ids[start:start + n]] == q).all()
            start += n
        read = np.unique(mesh.edges[:, g.edges.items(r)])
        assert (plan.ext_index[torch.from_numpy(read)] >= 0).all()
    assert g.halo_counts(src) == tuple(p.halo_rows for p in plans)
    with pytest.raises(ValueError, match="sources must lie in"):
        graphs.Graph(np.array([[0, 99], [1, 2]]), src)


def test_meshes_have_the_sizes_of_their_construction():
    for r, n in enumerate((12, 42, 162, 642)):
        mesh = graphs.icosahedral_mesh(r)
        assert mesh.num_nodes == n and mesh.edges.shape[1] == 2 * (3 * n - 6)  # a triangulated sphere: E = 3N - 6
        assert np.allclose(np.linalg.norm(mesh.points, axis=1), 1.0)
    channel = graphs.channel_mesh(20, 8)
    assert channel.points.shape[1] == 2 and set(np.unique(channel.node_type)) == set(range(5))
    lat, lon = np.linspace(60, -60, 4), np.arange(6) * 60.0
    mesh = graphs.icosahedral_mesh(1)
    g2m, m2g = graphs.grid_to_mesh_edges(lat, lon, mesh, 0.0), graphs.mesh_to_grid_edges(lat, lon, mesh, k=3)
    assert sorted(set(g2m[0])) == list(range(24)) and g2m.shape[1] == 24  # radius 0: each point's nearest node
    assert m2g.shape == (2, 72) and (np.bincount(m2g[1]) == 3).all()
