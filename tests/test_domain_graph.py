"""Graphs on the domain axis: MeshGraphNet- and GraphCast-style models (plain torch, ``graph_models``) on 2, 3 and 4
ranks against one process in fp64 (outputs, loss, every parameter gradient, parameters after 3 Adam steps), with
partitions that are random assignments (uneven, one part empty) and space-filling curves; the halo traffic of a
gather equals the halo rows from the partition times the feature bytes; refusals name the op on every rank."""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F

from graph_models import GraphCastLike, MeshGraphNet, step_both, uneven_partition, weather_graphs

TOL = 1e-10


def _mgn_body(cases):
    from mesh3d import DistributedManager, domain, graphs

    import torch.distributed as dist

    d = dist.get_world_size()
    DistributedManager.initialize(batch=1, domain=d)
    mesh = graphs.channel_mesh(9, 5)
    edges = torch.from_numpy(mesh.edges)
    n, e = mesh.num_nodes, edges.shape[1]
    out = []
    for seed, kind in cases:
        part = uneven_partition(n, d, seed, empty=d - 1 if d > 2 else None) if kind == "random" else \
            graphs.sfc_partition(mesh.points, d, sizes=[n // (2 * d)] * (d - 1) + [n - n // (2 * d) * (d - 1)])
        g = graphs.Graph(edges, part)
        torch.manual_seed(seed)
        ref = MeshGraphNet(3, 2, 2).double()
        mod = copy.deepcopy(ref)
        data = [[torch.randn(n, 3, dtype=torch.float64), torch.randn(e, 2, dtype=torch.float64),
                 torch.randn(n, 2, dtype=torch.float64)] for _ in range(3)]
        ei = domain.edge_index(g)

        def run_ref(model, step):
            x, ea, t = data[step]
            y = model(x, ea, edges)
            return y, F.mse_loss(y, t)

        def run_dom(model, step):
            x, ea, t = data[step]
            y = model(domain.shard_nodes(x, part), domain.shard_edges(ea, g), ei)
            return y, F.mse_loss(y, domain.shard_nodes(t, part))

        out.append((kind, part.counts, step_both(ref, mod, run_ref, run_dom)))
    return out


def test_meshgraphnet_trains_like_one_process_on_2_3_and_4_ranks(ranks):
    for world in (2, 3, 4):
        results = ranks.run(world, _mgn_body, [(world, "random"), (10 + world, "sfc")], timeout=180)
        for kind, counts, worst in results[0]:
            assert worst < TOL, (world, kind, counts, worst)
        assert (world == 2 or results[0][0][1][-1] == 0) and len(set(results[0][1][1])) > 1  # an empty part; uneven cuts


def _graphcast_body(cases):
    from mesh3d import DistributedManager, domain, graphs

    import torch.distributed as dist

    d = dist.get_world_size()
    DistributedManager.initialize(batch=1, domain=d)
    mesh, lat, lon, grid_xyz, g2m, m2g = weather_graphs()
    ng, nm = len(grid_xyz), mesh.num_nodes
    mesh_edges = mesh.edges
    out = []
    for seed in cases:
        grid_part = uneven_partition(ng, d, seed, empty=0)
        mesh_part = uneven_partition(nm, d, seed + 1, empty=d - 1)
        gg2m, gmesh, gm2g = (graphs.Graph(g2m, grid_part, mesh_part), graphs.Graph(mesh_edges, mesh_part),
                             graphs.Graph(m2g, mesh_part, grid_part))
        torch.manual_seed(seed)
        ref = GraphCastLike(4, 2).double()
        mod = copy.deepcopy(ref)
        gpos, mpos = torch.from_numpy(grid_xyz), torch.from_numpy(mesh.points)
        mesh_e0 = torch.randn(mesh_edges.shape[1], 8, dtype=torch.float64)
        data = [(torch.randn(ng, 4, dtype=torch.float64), torch.randn(ng, 2, dtype=torch.float64)) for _ in range(3)]
        plain = [torch.from_numpy(a) for a in (g2m, mesh_edges, m2g)]
        eis = [domain.edge_index(g) for g in (gg2m, gmesh, gm2g)]

        def run_ref(model, step):
            x, t = data[step]
            y = model(x, mpos, gpos, mpos, plain[0], plain[1], mesh_e0, plain[2])
            return y, F.mse_loss(y, t)

        def run_dom(model, step):
            x, t = data[step]
            y = model(domain.shard_nodes(x, grid_part), domain.shard_nodes(mpos, mesh_part), gpos, mpos, eis[0], eis[1],
                      domain.shard_edges(mesh_e0, gmesh), eis[2])
            return y, F.mse_loss(y, domain.shard_nodes(t, grid_part))

        out.append((grid_part.counts, mesh_part.counts, step_both(ref, mod, run_ref, run_dom)))
    return out


def test_graphcast_style_model_trains_like_one_process_on_2_3_and_4_ranks(ranks):
    for world in (2, 3, 4):
        results = ranks.run(world, _graphcast_body, [world], timeout=180)
        for grid_counts, mesh_counts, worst in results[0]:
            assert worst < TOL, (world, grid_counts, mesh_counts, worst)
            assert grid_counts[0] == 0 and mesh_counts[-1] == 0


def _reference_halo(edges, owner, d):
    """Per (reader, holder): the source nodes a rank's edges read that the holder owns, from the arrays alone."""
    counts = np.zeros((d, d), dtype=np.int64)
    for r in range(d):
        mine = owner[edges[1]] == r
        for q in range(d):
            if q != r:
                srcs = edges[0][mine]
                counts[r, q] = len(np.unique(srcs[owner[srcs] == q]))
    return counts


def _traffic_body(h):
    import torch.distributed as dist

    from graph_models import MGNBlock
    from mesh3d import DistributedManager, domain, graphs

    d = dist.get_world_size()
    DistributedManager.initialize(batch=1, domain=d)
    me = dist.get_rank()
    mesh = graphs.icosahedral_mesh(2)
    edges = mesh.edges
    out = []
    for part in (graphs.sfc_partition(mesh.points, d), uneven_partition(mesh.num_nodes, d, 7, empty=1 if d > 2 else None)):
        g = graphs.Graph(edges, part)
        torch.manual_seed(0)
        block = MGNBlock(h).double()
        x = domain.shard_nodes(torch.randn(mesh.num_nodes, h, dtype=torch.float64), part).requires_grad_()
        e = domain.shard_edges(torch.randn(edges.shape[1], h, dtype=torch.float64), g)
        ei = domain.edge_index(g)
        with domain.count_traffic() as fwd:
            y, _ = block(x, e, ei)
        loss = y.sum()
        with domain.count_traffic() as bwd:
            loss.backward()
        expected = _reference_halo(edges, part.owner, d)  # [reader, holder]
        out.append((fwd.bytes_sent, bwd.bytes_sent, int(expected[:, me].sum()) * h * 8, int(expected[me].sum()) * h * 8,
                    int(expected.sum()), sum(g.halo_counts(part))))
    return out


def test_halo_traffic_per_layer_is_the_halo_rows_times_the_feature_bytes(ranks):
    h = 6
    for world in (2, 4):
        results = ranks.run(world, _traffic_body, h, timeout=120)
        for case in range(2):
            rows = results[0][case][4]
            assert rows > 0 and results[0][case][5] == rows  # the partition's own count agrees with the arrays'
            for rank in range(world):
                fwd, bwd, sends, receives, _, _ = results[rank][case]
                assert fwd == sends, (world, case, rank, fwd, sends)  # forward: the rows its peers read from it
                assert bwd == receives, (world, case, rank, bwd, receives)  # backward: its halo's gradient goes home
            assert sum(r[case][0] for r in results) == rows * h * 8  # all ranks: halo rows x feature bytes


def _refusal_body():
    import torch.distributed as dist

    from mesh3d import DistributedManager, domain, graphs

    d = dist.get_world_size()
    DistributedManager.initialize(batch=1, domain=d)
    mesh = graphs.icosahedral_mesh(1)
    part = graphs.sfc_partition(mesh.points, d)
    x = domain.shard_nodes(torch.randn(mesh.num_nodes, 3), part)
    messages = []
    for call in (lambda: torch.cumsum(x, 0), lambda: torch.sort(x, 0), lambda: F.alpha_dropout(x, 0.5, True),
                 lambda: x[torch.tensor([0, 1])], lambda: x[:3]):
        try:
            call()
            messages.append(None)
        except (NotImplementedError, ValueError) as err:
            messages.append(str(err).split(":")[0])
    return messages


def test_an_op_without_a_rule_is_refused_naming_itself_on_every_rank(ranks):
    results = ranks.run(3, _refusal_body, timeout=60)
    assert all(r == results[0] for r in results)
    assert results[0][0] == "torch.cumsum has no rule for graph layouts (nodes or edges split by a partition, along dim 0)"
    assert results[0][1].startswith("torch.sort has no rule for graph layouts")
    assert results[0][2].startswith("torch.nn.functional.alpha_dropout has no rule for graph layouts")
    assert all(m is not None for m in results[0])
