"""Graph models written in plain torch (no mesh3d in them), and the graphs the graph tests run them on.

``MeshGraphNet``: encode-process-decode with edge and node MLPs, messages summed at destinations (``index_add_``).
``GraphCastLike``: a grid-to-mesh encoder (bipartite), a mesh processor with attention over incoming edges (segment
softmax by ``scatter_reduce(amax)`` and ``index_add_``) and edge features from plain coordinate tables, and a
mesh-to-grid decoder. The same code runs on plain tensors (one process) and on domain tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from domain_cases import max_err, sum_grads_over_domain


def step_both(ref, mod, run_ref, run_dom, steps=3):
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
        sum_grads_over_domain(mod.parameters())
        for p, q in zip(ref.parameters(), mod.parameters()):
            worst = max(worst, max_err(q.grad, p.grad))
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    return max(worst, max(max_err(p, q) for p, q in zip(ref.parameters(), mod.parameters())))


def mlp(n_in: int, n_out: int, hidden: int = 16, norm: bool = True) -> nn.Sequential:
    layers = [nn.Linear(n_in, hidden), nn.SiLU(), nn.Linear(hidden, n_out)]
    return nn.Sequential(*layers, nn.LayerNorm(n_out)) if norm else nn.Sequential(*layers)


class MGNBlock(nn.Module):
    """One MeshGraphNet block: edges from (source, destination, edge), nodes from (node, sum of incoming edges)."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.edge, self.node = mlp(3 * h, h), mlp(2 * h, h)

    def forward(self, x, e, ei):
        src, dst = ei[0], ei[1]
        e = e + self.edge(torch.cat([x[src], x.index_select(0, dst), e], -1))
        agg = x.new_zeros(x.shape).index_add_(0, dst, e)
        return x + self.node(torch.cat([x, agg], -1)), e


class MeshGraphNet(nn.Module):
    def __init__(self, node_in: int, edge_in: int, out: int, h: int = 8, blocks: int = 2) -> None:
        super().__init__()
        self.enc_node, self.enc_edge = mlp(node_in, h), mlp(edge_in, h)
        self.blocks = nn.ModuleList(MGNBlock(h) for _ in range(blocks))
        self.dec = mlp(h, out, norm=False)

    def forward(self, x, e, ei):
        x, e = self.enc_node(x), self.enc_edge(e)
        for block in self.blocks:
            x, e = block(x, e, ei)
        return self.dec(x)


class Bipartite(nn.Module):
    """GraphCast's encoder or decoder: edge MLP on (source, destination, geometry), summed at destinations."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.edge, self.node, self.geo = mlp(3 * h, h), mlp(2 * h, h), mlp(3, h)

    def forward(self, xs, xd, pos_s, pos_d, ei):
        s, d = ei[0], ei[1]
        e = self.edge(torch.cat([xs[s], xd[d], self.geo(pos_s[s] - pos_d[d])], -1))
        agg = xd.new_zeros(xd.shape).index_add_(0, d, e)
        return xd + self.node(torch.cat([xd, agg], -1))


class MeshAttention(nn.Module):
    """Attention over each node's incoming edges: a segment softmax (max and sum per destination)."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.out = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h), mlp(h, h)

    def forward(self, x, ei):
        src, dst = ei[0], ei[1]
        score = (self.q(x)[dst] * self.k(x)[src]).sum(-1)
        top = score.new_zeros(x.shape[0]).scatter_reduce(0, dst, score, "amax", include_self=False)
        w = torch.exp(score - top[dst])
        den = w.new_zeros(x.shape[0]).index_add_(0, dst, w)
        msg = (w / den[dst]).unsqueeze(-1) * self.v(x)[src]
        return x + self.out(x.new_zeros(x.shape).index_add_(0, dst, msg))


class GraphCastLike(nn.Module):
    def __init__(self, grid_in: int, out: int, h: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.grid_embed, self.mesh_embed = mlp(grid_in, h), mlp(3, h)
        self.encoder, self.decoder = Bipartite(h), Bipartite(h)
        self.processor = nn.ModuleList(MeshAttention(h) for _ in range(layers))
        self.mesh_blocks = nn.ModuleList(MGNBlock(h) for _ in range(1))
        self.head = mlp(h, out, norm=False)

    def forward(self, grid, mesh_xyz, grid_pos, mesh_pos, g2m, mesh_ei, mesh_e, m2g):
        g = self.grid_embed(grid)
        m = self.encoder(g, self.mesh_embed(mesh_xyz), grid_pos, mesh_pos, g2m)
        for layer in self.processor:
            m = layer(m, mesh_ei)
        for block in self.mesh_blocks:
            m, mesh_e = block(m, mesh_e, mesh_ei)
        return self.head(self.decoder(m, g, mesh_pos, grid_pos, m2g))


def weather_graphs(refinements: int = 1, nlat: int = 6, nlon: int = 12):
    """A small lat x lon grid and an icosahedral mesh with GraphCast's three edge sets (numpy arrays)."""
    from mesh3d import graphs

    mesh = graphs.icosahedral_mesh(refinements)
    lat = np.linspace(75, -75, nlat)
    lon = np.arange(nlon) * 360.0 / nlon
    g2m = graphs.grid_to_mesh_edges(lat, lon, mesh, 0.6 * mesh.longest_edge())
    m2g = graphs.mesh_to_grid_edges(lat, lon, mesh)
    glat, glon = np.meshgrid(lat, lon, indexing="ij")
    grid_xyz = graphs.lat_lon_to_xyz(glat.ravel(), glon.ravel())
    return mesh, lat, lon, grid_xyz, g2m, m2g


@contextmanager
def channel_graph(seed: int) -> Iterator[SimpleNamespace]:
    """On every rank of a pool body: a manager with the domain over every rank, the 8x5 channel mesh's edges whole
    (``edges``) and as a graph tensor (``ei``), its node count ``n``, a random uneven partition ``part`` (its last part
    empty from 3 ranks) and the graph ``g``; shut down afterwards.

    Usage: ``with channel_graph(seed) as c: y = model(domain.shard_nodes(x, c.part), c.ei)``
    """
    import torch.distributed as dist

    from mesh3d import DistributedManager, domain, graphs

    d = dist.get_world_size()
    dm = DistributedManager.initialize(batch=1, domain=d)
    try:
        mesh = graphs.channel_mesh(8, 5)
        edges = torch.from_numpy(mesh.edges)
        part = uneven_partition(mesh.num_nodes, d, seed, empty=d - 1 if d > 2 else None)
        g = graphs.Graph(edges, part)
        yield SimpleNamespace(dm=dm, mesh=mesh, edges=edges, n=mesh.num_nodes, part=part, g=g,
                              ei=domain.edge_index(g))
    finally:
        DistributedManager.shutdown()


def uneven_partition(n: int, parts: int, seed: int, empty: int | None = None):
    """A random assignment (not contiguous), uneven, with part ``empty`` holding nothing."""
    from mesh3d import graphs

    rng = np.random.default_rng(seed)
    choices = [r for r in range(parts) if r != empty] or [0]
    weights = rng.uniform(0.3, 1.0, len(choices))
    return graphs.Partition(rng.choice(choices, size=n, p=weights / weights.sum()), parts)


class NodeGNN(nn.Module):
    """``model(x, edge_index)``: a MeshGraphNet whose edge features come from the node features (for ``mesh3d check``)."""

    def __init__(self, f: int = 3, h: int = 8) -> None:
        super().__init__()
        self.enc, self.edge_enc, self.block, self.dec = mlp(f, h), mlp(f, h), MGNBlock(h), mlp(h, 2, norm=False)

    def forward(self, x, edge_index):
        e = self.edge_enc(x[edge_index[0]] - x[edge_index[1]])
        h, _ = self.block(self.enc(x), e, edge_index)
        return self.dec(h)


def make_gnn() -> nn.Module:
    return NodeGNN()
