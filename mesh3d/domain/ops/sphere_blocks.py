"""torch-harmonics' DISCO convolutions and neighbourhood attention on lat x lon blocks: each rank fetches the input
latitudes its output rows' filters reach, whole around the longitude ring (the filters wrap it, and near the poles
they span it), computes its output rows for every longitude with the library's kernel, and keeps its own longitudes.

Usage: automatic, through torch-harmonics::

    conv = torch_harmonics.DiscreteContinuousConvS2(c_in, c_out, (nlat, nlon), (nlat, nlon), kernel_shape=3)
    ys = conv(domain.shard(x, dims=(2, 3)))   # lat x lon blocks in, lat x lon blocks out

Along latitudes this is the slab rule (``ops/disco.py``, ``ops/s2_attention.py``): the same part of the pattern, the
same kernel, every output the same sum in the same order as in one process. Along longitudes a rank's output columns
read input columns shifted by the output's longitude, all around the ring, so the fetched rows come whole: each rank
of a grid line along longitudes computes its rows' outputs for the whole ring and keeps its columns (the kernel has
no cheaper form; the cost is the slab rule's times the longitude ranks). The gradient of the columns it drops is zero
there, and each output column is kept by exactly one rank, so gradients sum as in one process.
Refused by name: blocks over other dims than (latitude, longitude), upsampling attention.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mesh3d.domain.comm.rows import Span, block_needs
from mesh3d.domain.core.connected import connected_zeros
from mesh3d.domain.core.specs import BlockSpec
from mesh3d.domain.core.split import offsets_of
from mesh3d.domain.core.tensor import DomainTensor
from mesh3d.domain.dispatch.step import Boxes, Step
from mesh3d.domain.layouts.blocks import box_plans
from mesh3d.domain.ops.disco import (
    PsiCuts, contract_local, contraction_args, forward_cut, out_sizes_for, transpose_cut, transpose_local)
from mesh3d.domain.ops.s2_attention import attention_psi

__all__ = ["attention_block_rule", "contraction_block_rule", "permute_block_rule", "transpose_block_rule"]


def _lat_lon(name: str, x: Any, lat_dim: int) -> BlockSpec:
    spec = x._spec if isinstance(x, DomainTensor) else None
    if not isinstance(spec, BlockSpec) or spec.dims != (lat_dim, lat_dim + 1):
        dims = getattr(spec, "dims", None)
        raise NotImplementedError(
            f"{name} (torch-harmonics) on blocks over dims {dims}: its block rule takes latitude x longitude blocks "
            f"(dims {(lat_dim, lat_dim + 1)}); shard with domain.shard(x, dims=({lat_dim}, {lat_dim + 1})) or as "
            f"latitude slabs (dim={lat_dim}), or call .full_tensor() first")
    return spec


def _ring(lon_sizes: tuple[int, ...], n: int) -> tuple:
    """Every rank of a longitude line reads the whole ring."""
    return tuple((Span.rows(0, n),) for _ in lon_sizes)


def _ring_box(x: Any, spec: BlockSpec, lat_needs: tuple, n: int) -> Boxes:
    """``x``'s rows ``lat_needs`` (one row map per rank of the latitude line), whole around the longitude ring."""
    return Boxes(x, box_plans(spec, (lat_needs, _ring(spec.sizes[1], n))))


def _keep_columns(y: torch.Tensor, dim: int, out_lon: tuple[int, ...], spec: BlockSpec) -> torch.Tensor:
    me = spec.lines[1].index
    return y.narrow(dim, offsets_of(out_lon)[me], out_lon[me])


def contraction_block_rule(op: Callable[..., torch.Tensor], name: str, *, with_weight: bool) -> Callable[..., Any]:
    """The block rule of ``ops.disco.contraction_rule``'s op: (B, C, lat, lon) blocks in and out."""
    cuts = PsiCuts()

    def rule(inp, *args: Any) -> Step:
        spec = _lat_lon(name, inp, 2)
        psi, tail = contraction_args(args, with_weight)
        nlat_in, nlon_in = inp.shape[2], inp.shape[3]
        out_lat = out_sizes_for(spec.sizes[0], nlat_in, tail[1])
        out_lon = out_sizes_for(spec.sizes[1], nlon_in, tail[2])
        local = forward_cut(cuts, psi, (nlat_in, nlon_in), tail, out_lat, spec.lines[0].index, with_weight)
        out_dim = 2 if with_weight else 3

        def compute(part: torch.Tensor, *weight: torch.Tensor) -> torch.Tensor:
            return _keep_columns(contract_local(op, part, weight, local, tail), out_dim + 1, out_lon, spec)

        rows = _ring_box(inp, spec, local.needs, nlon_in)
        return Step(compute, (rows, args[0]) if with_weight else (rows,),
                    out=BlockSpec((out_dim, out_dim + 1), (out_lat, out_lon), spec.lines, spec.comm))

    return rule


def transpose_block_rule(op: Callable[..., torch.Tensor], name: str) -> Callable[..., Any]:
    """The block rule of ``ops.disco.transpose_rule``'s op: (B, C, K, lat, lon) blocks in, (B, C, lat, lon) out."""
    cuts = PsiCuts()

    def rule(inp, roff, ker, row, col, vals, kernel_size, nlat_out, nlon_out) -> Step:
        spec = _lat_lon(name, inp, 3)
        tail = (kernel_size, nlat_out, nlon_out)
        nlat_in, nlon_in = inp.shape[3], inp.shape[4]
        out_lat = out_sizes_for(spec.sizes[0], nlat_in, nlat_out)
        out_lon = out_sizes_for(spec.sizes[1], nlon_in, nlon_out)
        local = transpose_cut(cuts, (roff, ker, row, col, vals), nlat_in, tail, out_lat, spec.lines[0].index)
        return Step(lambda part: _keep_columns(transpose_local(op, part, local, tail), 3, out_lon, spec),
                    (_ring_box(inp, spec, local.needs, nlon_in),),
                    out=BlockSpec((2, 3), (out_lat, out_lon), spec.lines, spec.comm))

    return rule


def attention_block_rule(op: Callable[..., torch.Tensor], name: str) -> Callable[..., Any]:
    """The block rule of ``ops.s2_attention.attention_rule``'s op: keys, values and queries channels-last
    (B, lat, lon, C) on lat x lon blocks; the output laid out as the queries."""
    cuts = PsiCuts()

    def rule(kw, vw, qw, quad_weights, col_idx, row_off, seg, seg_off, nh, nlon_in, nlat_out, nlon_out) -> Step:
        specs = [_lat_lon(name, t, 1) for t in (kw, vw, qw)]
        if nlon_in % nlon_out:
            raise NotImplementedError(f"{name} (torch-harmonics' neighbourhood attention) upsampling on domain "
                                      "tensors has no rule; call .full_tensor() on the query, keys and values first")
        nlat_in, q_spec = kw.shape[1], specs[2]
        out_lat, me = q_spec.sizes[0], q_spec.lines[0].index
        local = cuts.get((quad_weights, col_idx, row_off), (nlat_in, nlon_in, nlat_out, nlon_out, out_lat, me),
                         lambda: attention_psi(col_idx, row_off, quad_weights, out_lat, me, nlon_in))

        def compute(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
            if local.rows_in:
                quad, col, roff, seg_l, seg_off_l = local.psi
                y = op(k, v, q, quad, col, roff, seg_l, seg_off_l, nh, nlon_in, local.rows_out, nlon_out)
            else:
                y = connected_zeros(q, [q.shape[0], local.rows_out, nlon_out, v.shape[3]], k, v, q)
            return _keep_columns(y, 2, q_spec.sizes[1], q_spec)

        keys, values = (_ring_box(t, s, local.needs, nlon_in) for t, s in zip((kw, vw), specs))
        return Step(compute, (keys, values, _ring_box(qw, q_spec, block_needs(out_lat), nlon_out)), out=q_spec)

    return rule


def permute_block_rule(op: Callable[..., torch.Tensor], dims: tuple[int, ...]) -> Callable[..., Any]:
    """The block rule of the library's channels-last copies: the local copy, the block dims where ``dims`` puts them
    (in their order: latitude before longitude)."""

    def rule(x) -> Step:
        spec = x._spec
        moved = tuple(dims.index(d) for d in spec.dims)
        if list(moved) != sorted(moved):
            raise NotImplementedError(f"torch.ops.attention_kernels copy permuting block dims {spec.dims} out of "
                                      "order has no rule; call .full_tensor() first")
        return Step(op, (x,), out=BlockSpec(moved, spec.sizes, spec.lines, spec.comm))

    return rule
