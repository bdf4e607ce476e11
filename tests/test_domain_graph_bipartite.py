"""Bipartite graphs between layouts: a grid field sharded as lat x lon blocks (``BlockSpec``), a mesh partitioned over
the same ranks by the block each node falls in, and GraphCast's grid-to-mesh encoder and mesh-to-grid decoder
between them (batched ``(B, N, C)`` node tensors), against one process in fp64 (outputs, loss, input and parameter
gradients); the exchange moves only the rows the edges cross (halo rows from the partitions x feature bytes)."""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from domain_cases import domain_sum, max_err
from graph_models import mlp, weather_graphs

TOL = 1e-10


class EncodeDecode(nn.Module):
    """Grid -> mesh (sum of edge MLPs at mesh nodes) -> grid, on (B, N, C) nodes; plain torch."""

    def __init__(self, c: int, h: int = 6) -> None:
        super().__init__()
        self.embed, self.enc_edge, self.enc_node = mlp(c, h), mlp(2 * h, h), mlp(h, h)
        self.dec_edge, self.dec_node = mlp(2 * h, h), mlp(2 * h, c, norm=False)

    def forward(self, field, g2m, m2g, num_mesh):
        b, c, hh, ww = field.shape
        grid = self.embed(field.flatten(2).transpose(1, 2))                       # (B, H*W, h): tokens
        return self.decode(self.encode(grid, g2m, num_mesh), grid, m2g).transpose(1, 2).reshape(b, c, hh, ww)

    def encode(self, grid, g2m, num_mesh):
        src = grid.index_select(1, g2m[0])  # the only exchange of the encoder
        msg = self.enc_edge(torch.cat([src, src ** 2], -1))
        mesh = msg.new_zeros(msg.shape[0], num_mesh, msg.shape[2]).index_add_(1, g2m[1], msg)
        return self.enc_node(mesh)

    def decode(self, mesh, grid, m2g):
        msg = self.dec_edge(torch.cat([mesh.index_select(1, m2g[0]), grid.index_select(1, m2g[1])], -1))
        return self.dec_node(torch.cat([grid, grid.new_zeros(grid.shape).index_add_(1, m2g[1], msg)], -1))


def _bipartite_body(grid_shape, sizes):
    from mesh3d import DistributedManager, domain, graphs
    from mesh3d.domain.layouts.graph import nodes_from_tokens, tokens_from_nodes

    DistributedManager.initialize(batch=1, domain=grid_shape)
    mesh, lat, lon, _, g2m, m2g = weather_graphs(refinements=1, nlat=6, nlon=8)
    mlat, mlon = mesh.lat_lon()
    grid_part = graphs.grid_block_partition(sizes)
    mesh_part = graphs.latlon_block_partition(mlat, mlon, lat, lon, sizes)
    gg2m, gm2g = graphs.Graph(g2m, grid_part, mesh_part), graphs.Graph(m2g, mesh_part, grid_part)
    torch.manual_seed(0)
    ref = EncodeDecode(3).double()
    mod = copy.deepcopy(ref)
    field = torch.randn(2, 3, len(lat), len(lon), dtype=torch.float64, requires_grad=True)
    target = torch.randn(field.shape, dtype=torch.float64)
    loss_ref = F.mse_loss(ref(field, torch.from_numpy(g2m), torch.from_numpy(m2g), mesh.num_nodes), target)
    loss_ref.backward()

    class OnTheDomain(nn.Module):
        """The same model; the grid's tokens become the grid partition's nodes (and back): no data moves."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, field, g2m, m2g, num_mesh):
            b, c, hh, ww = field.shape
            tokens = self.inner.embed(field.flatten(2).transpose(1, 2))
            grid = nodes_from_tokens(tokens)
            with domain.count_traffic() as enc:
                mesh_nodes = self.inner.encode(grid, g2m, num_mesh)
            out = tokens_from_nodes(self.inner.decode(mesh_nodes, grid, m2g), like=tokens)
            return out.transpose(1, 2).reshape(b, c, hh, ww), enc.bytes_sent

    xi = field.detach().requires_grad_()
    ys, enc_bytes = OnTheDomain(mod)(domain.shard(xi, dims=(2, 3), sizes=sizes), domain.edge_index(gg2m),
                                     domain.edge_index(gm2g), mesh.num_nodes)
    loss = F.mse_loss(ys, domain.shard(target, dims=(2, 3), sizes=sizes))
    loss.backward()
    worst = max(abs(float(loss) - float(loss_ref)), max_err(ys.full_tensor().to_local(),
                                                            ref(field, torch.from_numpy(g2m), torch.from_numpy(m2g),
                                                                mesh.num_nodes)),
                max_err(domain_sum(xi.grad.to_local() if hasattr(xi.grad, "to_local") else xi.grad), field.grad))
    for p, q in zip(ref.parameters(), mod.parameters()):
        worst = max(worst, max_err(domain_sum(q.grad), p.grad))
    crossing = gg2m.halo_counts(grid_part)
    return worst, enc_bytes, crossing, len(lat) * len(lon), ys.spec.layout.value


def test_grid_to_mesh_and_back_between_blocks_and_a_mesh_equals_one_process(ranks):
    for grid, sizes in (((2, 2), ((3, 3), (4, 4))), ((2, 2), ((2, 4), (0, 8))), ((2, 3), ((4, 2), (3, 3, 2)))):
        results = ranks.run(int(np.prod(grid)), _bipartite_body, grid, sizes, timeout=120)
        for rank, (worst, enc_bytes, crossing, points, layout) in enumerate(results):
            assert worst < TOL, (grid, sizes, rank, worst)
            assert layout == "blocks"
        total = sum(r[1] for r in results)
        rows = sum(results[0][2])
        assert total == 2 * rows * 6 * 8, (total, rows)  # batch 2, 6 features, fp64: only the rows edges cross
        assert rows < points  # fewer than a gather of the grid's points
