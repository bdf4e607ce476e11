"""Graphs on the domain axis: MeshGraphNet- and GraphCast-style models (plain torch, ``graph_models``) on 2, 3 and 4
ranks against one process in fp64 (outputs, loss, every parameter gradient, parameters after 3 Adam steps), with
partitions that are random assignments (uneven, one part empty) and space-filling curves; the halo traffic of a
gather equals the halo rows from the partition times the feature bytes; refusals name the op on every rank."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from domain_cases import domain_sum, max_err
from graph_models import GraphCastLike, MeshGraphNet, uneven_partition, weather_graphs

TOL = 1e-10


def _step_both(ref, mod, run_ref, run_dom, steps=3):
    """``steps`` Adam steps of ``ref`` (one process) and ``mod`` (domain, grads summed over the domain): the worst
    difference of outputs, losses, gradients and parameters."""
    opt_ref, opt = torch.optim.Adam(ref.parameters(), lr=0.01), torch.optim.Adam(mod.parameters(), lr=0.01)
    worst = 0.0
    for step in range(steps):
        y_ref, loss_ref = run_ref(ref, step)
        loss_ref.backward()
        ys, loss = run_dom(mod, step)
        loss.backward()
        worst = max(worst, abs(float(loss) - float(loss_ref)), max_err(ys.full_tensor().to_local(), y_ref))
        for p, q in zip(ref.parameters(), mod.parameters()):
            q.grad = domain_sum(q.grad)
            worst = max(worst, max_err(q.grad, p.grad))
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    return max(worst, max(max_err(p, q) for p, q in zip(ref.parameters(), mod.parameters())))


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
        part = uneven_partition(n, d, seed, empty=d - 1) if kind == "random" else \
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

        out.append((kind, part.counts, _step_both(ref, mod, run_ref, run_dom)))
    return out


def test_meshgraphnet_trains_like_one_process_on_2_3_and_4_ranks(ranks):
    for world in (2, 3, 4):
        results = ranks.run(world, _mgn_body, [(world, "random"), (10 + world, "sfc")], timeout=180)
        for kind, counts, worst in results[0]:
            assert worst < TOL, (world, kind, counts, worst)
        assert results[0][0][1][-1] == 0 and len(set(results[0][1][1])) > 1  # an empty part; uneven curve cuts


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

        out.append((grid_part.counts, mesh_part.counts, _step_both(ref, mod, run_ref, run_dom)))
    return out


def test_graphcast_style_model_trains_like_one_process_on_2_3_and_4_ranks(ranks):
    for world in (2, 3, 4):
        results = ranks.run(world, _graphcast_body, [world], timeout=180)
        for grid_counts, mesh_counts, worst in results[0]:
            assert worst < TOL, (world, grid_counts, mesh_counts, worst)
            assert grid_counts[0] == 0 and mesh_counts[-1] == 0
