"""PyTorch Geometric's layers, unchanged, on graph tensors: GCNConv (self-loops added, symmetric normalization),
SAGEConv (mean and max), GATConv (self-loops, segment softmax over incoming edges, two heads) and a MeshGraphNet
block written as a ``MessagePassing`` subclass, on 2, 3 and 4 ranks against one process (fp64, 3 Adam steps),
with a random uneven partition whose last part is empty. PyG 2.8 (pure Python, no torch-scatter)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from graph_models import mlp, step_both, uneven_partition

pyg = pytest.importorskip("torch_geometric")  # the graph extra (pip install mesh3d[graph])

TOL = 1e-10


def _models(h: int):
    from torch import nn
    from torch_geometric.nn import GATConv, GCNConv, MessagePassing, SAGEConv

    class MGNConv(MessagePassing):
        """A MeshGraphNet block in PyG's style: edge MLP in ``message``, node MLP in ``update``."""

        def __init__(self, h: int) -> None:
            super().__init__(aggr="sum")
            self.edge, self.node = mlp(3 * h, h), mlp(2 * h, h)

        def forward(self, x, edge_index, edge_attr):
            return self.propagate(edge_index, x=x, edge_attr=edge_attr)

        def message(self, x_i, x_j, edge_attr):
            return self.edge(torch.cat([x_i, x_j, edge_attr], -1))

        def update(self, aggr_out, x):
            return x + self.node(torch.cat([x, aggr_out], -1))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gcn, self.sage, self.sage_max = GCNConv(h, h), SAGEConv(h, h), SAGEConv(h, h, aggr="max")
            self.gat, self.mgn = GATConv(h, h, heads=2, concat=False), MGNConv(h)

        def forward(self, x, ei, e):
            x = torch.tanh(self.gcn(x, ei))
            x = torch.tanh(self.sage(x, ei)) + self.sage_max(x, ei)
            x = F.elu(self.gat(x, ei))
            return self.mgn(x, ei, e)

    return Net()


def _pyg_body(seed):
    import torch.distributed as dist

    from mesh3d import DistributedManager, domain, graphs

    d = dist.get_world_size()
    DistributedManager.initialize(batch=1, domain=d)
    mesh = graphs.channel_mesh(8, 5)
    edges = torch.from_numpy(mesh.edges)
    n, h = mesh.num_nodes, 4
    part = uneven_partition(n, d, seed, empty=d - 1 if d > 2 else None)
    g = graphs.Graph(edges, part)
    torch.manual_seed(seed)
    ref = _models(h).double()
    mod = copy.deepcopy(ref)
    ei = domain.edge_index(g)
    data = [(torch.randn(n, h, dtype=torch.float64), torch.randn(edges.shape[1], h, dtype=torch.float64),
             torch.randn(n, h, dtype=torch.float64)) for _ in range(3)]

    def run_ref(model, step):
        x, e, t = data[step]
        y = model(x, edges, e)
        return y, F.mse_loss(y, t)

    def run_dom(model, step):
        x, e, t = data[step]
        y = model(domain.shard_nodes(x, part), ei, domain.shard_edges(e, g))
        return y, F.mse_loss(y, domain.shard_nodes(t, part))

    return part.counts, step_both(ref, mod, run_ref, run_dom)


def test_pyg_layers_unchanged_train_like_one_process_on_2_3_and_4_ranks(ranks):
    for world in (2, 3, 4):
        counts, worst = ranks.run(world, _pyg_body, world, timeout=180)[0]
        assert worst < TOL, (world, counts, worst)
        assert world == 2 or counts[-1] == 0
