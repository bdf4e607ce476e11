"""Graph models as their authors write them (plain torch, no mesh3d in them), for the graph zoo
(``tests/test_domain_graph_zoo.py``); with ``graph_models.MeshGraphNet`` and ``GraphCastLike`` they make six.

``InteractionNetwork``: Battaglia et al.'s relational model (senders, receivers unpacked from the edge list, effects
summed into a plain ``torch.zeros`` by ``scatter_add_`` of an expanded index), two steps, residual.
``PointNetSet``: PointNet++'s set abstraction (a shared MLP of a neighbour's features and its offset, max over each
centre's neighbourhood by ``scatter_reduce(amax)``), then a global mean feature added back.
``GAT``: multi-head graph attention written out (``view`` into heads, LeakyReLU scores, a segment softmax by
``scatter_reduce(amax)``, ``index_add_`` of exponentials, heads averaged) with a mean aggregator whose degrees come
from ``torch.bincount``.
``GraphUNet``: a fine graph, pooled into clusters (mean by ``index_add_`` over pooling edges, counts by
``bincount``), a layer on the coarse graph, unpooled by a gather back along the reversed edges, a skip connection.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from graph_models import mlp


class InteractionNetwork(nn.Module):
    def __init__(self, h: int, e_dim: int, steps: int = 2) -> None:
        super().__init__()
        self.relational = nn.ModuleList(mlp(2 * h + e_dim, h) for _ in range(steps))
        self.object = nn.ModuleList(mlp(2 * h, h) for _ in range(steps))

    def forward(self, x, edge_index, edge_attr):
        senders, receivers = edge_index
        for rel, obj in zip(self.relational, self.object):
            effects = rel(torch.cat([x[receivers], x[senders], edge_attr], dim=1))
            agg = torch.zeros(x.size(0), effects.size(1), dtype=x.dtype)
            agg.scatter_add_(0, receivers.unsqueeze(1).expand(-1, effects.size(1)), effects)
            x = x + obj(torch.cat([x, agg], dim=1))
        return x


class PointNetSet(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.local, self.glob, self.out = mlp(h + 2, h, norm=False), mlp(h, h), mlp(2 * h, h)

    def forward(self, x, pos, edge_index):
        j, i = edge_index[0], edge_index[1]
        msg = self.local(torch.cat([x[j], pos[j] - pos[i]], dim=-1))
        pooled = x.new_zeros(x.shape[0], msg.shape[-1])
        pooled = pooled.scatter_reduce(0, i.view(-1, 1).expand_as(msg), msg, "amax", include_self=False)
        g = self.glob(pooled).mean(dim=0, keepdim=True)
        return self.out(torch.cat([pooled, g.expand_as(pooled)], dim=-1))


class GATLayer(nn.Module):
    def __init__(self, h: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.lin = nn.Linear(h, heads * h, bias=False)
        self.att_src, self.att_dst = nn.Parameter(torch.randn(heads, h) * 0.3), nn.Parameter(torch.randn(heads, h) * 0.3)

    def forward(self, x, edge_index):
        src, dst = edge_index
        n = x.size(0)
        z = self.lin(x).view(n, self.heads, -1)
        score = F.leaky_relu((z[src] * self.att_src).sum(-1) + (z[dst] * self.att_dst).sum(-1), 0.2)   # (E, H)
        top = torch.full((n, self.heads), float("-inf"), dtype=x.dtype)
        top = top.scatter_reduce(0, dst.unsqueeze(-1).expand_as(score), score, "amax", include_self=True)
        w = torch.exp(score - top[dst])
        den = torch.zeros_like(top).index_add_(0, dst, w)
        alpha = w / den[dst]
        out = torch.zeros_like(z).index_add_(0, dst, alpha.unsqueeze(-1) * z[src])
        return out.mean(dim=1)


class MeanConv(nn.Module):
    """SAGE-style: the mean of the incoming neighbours (degrees by bincount) beside the node itself."""

    def __init__(self, h_in: int, h: int) -> None:
        super().__init__()
        self.self_lin, self.nb_lin = nn.Linear(h_in, h), nn.Linear(h_in, h, bias=False)

    def forward(self, x, edge_index):
        src, dst = edge_index
        deg = torch.bincount(dst, minlength=x.shape[0]).clamp(min=1).to(x.dtype)
        agg = x.new_zeros(x.shape).index_add_(0, dst, x[src]) / deg.unsqueeze(-1)
        return self.self_lin(x) + self.nb_lin(agg)


class GAT(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.att1, self.att2, self.mean = GATLayer(h), GATLayer(h), MeanConv(h, h)

    def forward(self, x, edge_index):
        x = F.elu(self.att1(x, edge_index)) + x
        x = F.elu(self.att2(x, edge_index)) + x
        return self.mean(x, edge_index)


class GraphUNet(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.down, self.mid, self.up = MeanConv(h, h), MeanConv(h, h), MeanConv(2 * h, h)

    def forward(self, x, edge_index, pool_index, coarse_index, unpool_index, num_coarse: int):
        h = torch.tanh(self.down(x, edge_index))
        fine, cluster = pool_index
        count = torch.bincount(cluster, minlength=num_coarse).clamp(min=1).to(h.dtype)
        c = h.new_zeros(num_coarse, h.shape[1]).index_add_(0, cluster, h[fine]) / count.unsqueeze(-1)
        c = torch.tanh(self.mid(c, coarse_index))
        cl, back = unpool_index
        up = torch.zeros_like(h).index_add_(0, back, c[cl])
        return self.up(torch.cat([h, up], dim=-1), edge_index)


def clusters(points: np.ndarray, edges: np.ndarray, cell: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Voxel-grid pooling: each node's cluster (the cell of side ``cell`` it falls in, renumbered), the pooling edges
    (node -> its cluster), the coarse graph's edges (clusters joined by a fine edge, no self-loops) and the cluster
    count. Numpy, whole graph (as an author's preprocessing)."""
    cells = np.floor(points[:, :2] / cell).astype(np.int64)
    _, cluster = np.unique(cells, axis=0, return_inverse=True)
    cluster = cluster.ravel()
    nc = int(cluster.max()) + 1
    pool = np.stack([np.arange(len(points)), cluster])
    pairs = np.unique(np.stack([cluster[edges[0]], cluster[edges[1]]]), axis=1)
    coarse = pairs[:, pairs[0] != pairs[1]]
    return cluster, pool, coarse, nc
