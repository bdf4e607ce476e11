"""The graph zoo (issue 65, item 7): graph models written as their authors write them (``graph_zoo``: an interaction
network, a PointNet++ set layer, a multi-head GAT with a mean aggregator, a graph U-Net pooling into voxel clusters),
unchanged, train equal to one process for 3 Adam steps (fp64: outputs, losses, every parameter gradient, parameters)
on 2, 3 and 4 ranks, on random uneven partitions of the channel mesh with an empty part from 3 ranks (the U-Net's
clusters on a partition of their own, its empty part elsewhere). With MeshGraphNet and the GraphCast-style model
(``tests/test_domain_graph.py``, the same ranks and partitions) they make the six."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from graph_models import channel_graph, step_both, uneven_partition
from graph_zoo import GAT, GraphUNet, InteractionNetwork, PointNetSet, clusters

TOL = 1e-10
H = 4


def _zoo_body(seed):
    from mesh3d import domain, graphs

    worst = {}
    with channel_graph(seed) as c:
        d, part = c.part.parts, c.part
        n, e = c.n, c.edges.shape[1]
        g = torch.Generator().manual_seed(seed)
        pos = torch.from_numpy(c.mesh.points[:, :2]).double()
        data = [(torch.randn(n, H, dtype=torch.float64, generator=g), torch.randn(e, 3, dtype=torch.float64, generator=g),
                 torch.randn(n, H, dtype=torch.float64, generator=g)) for _ in range(3)]
        cluster, pool, coarse, nc = clusters(c.mesh.points, c.mesh.edges, cell=0.9)
        coarse_part = uneven_partition(nc, d, seed + 7, empty=0 if d > 2 else None)
        pool_g = graphs.Graph(pool, part, coarse_part)
        coarse_g, unpool_g = graphs.Graph(coarse, coarse_part), graphs.Graph(pool[::-1].copy(), coarse_part, part)
        plain = {"pool": torch.from_numpy(pool), "coarse": torch.from_numpy(coarse),
                 "unpool": torch.from_numpy(pool[::-1].copy())}
        dom = {"pool": domain.edge_index(pool_g), "coarse": domain.edge_index(coarse_g),
               "unpool": domain.edge_index(unpool_g)}
        models = {
            "interaction network": (lambda: InteractionNetwork(H, 3),
                                    lambda m, x, ea, ei, ix, pz: m(x, ei, ea)),
            "pointnet++ set": (lambda: PointNetSet(H), lambda m, x, ea, ei, ix, pz: m(x, pz, ei)),
            "gat": (lambda: GAT(H), lambda m, x, ea, ei, ix, pz: m(x, ei)),
            "graph u-net": (lambda: GraphUNet(H),
                            lambda m, x, ea, ei, ix, pz: m(x, ei, ix["pool"], ix["coarse"], ix["unpool"], nc)),
        }
        for name, (make, call) in models.items():
            torch.manual_seed(seed)
            ref = make().double()
            mod = copy.deepcopy(ref)

            def run_ref(model, step, call=call):
                x, ea, t = data[step]
                y = call(model, x, ea, c.edges, plain, pos)
                return y, F.mse_loss(y, t)

            def run_dom(model, step, call=call):
                x, ea, t = data[step]
                y = call(model, domain.shard_nodes(x, part), domain.shard_edges(ea, c.g), c.ei, dom,
                         domain.shard_nodes(pos, part))
                return y, F.mse_loss(y, domain.shard_nodes(t, part))

            worst[name] = step_both(ref, mod, run_ref, run_dom)
        return part.counts, coarse_part.counts, nc, worst


def test_graph_zoo_written_as_authors_write_it_trains_like_one_process_on_2_3_and_4_ranks(ranks):
    for world in (2, 3, 4):
        counts, coarse_counts, nc, worst = ranks.run(world, _zoo_body, 20 + world, timeout=240)[0]
        assert set(worst) == {"interaction network", "pointnet++ set", "gat", "graph u-net"}
        for name, err in worst.items():
            assert err < TOL, (world, name, counts, err)
        assert 1 < nc < sum(counts)
        assert world == 2 or (counts[-1] == 0 and coarse_counts[0] == 0)  # an empty part, fine and coarse
