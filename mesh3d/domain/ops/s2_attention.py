"""torch-harmonics' neighbourhood attention on the sphere (``NeighborhoodAttentionS2``) on latitude slabs: each rank
attends for the query latitudes it owns, over the key and value latitudes their neighbourhoods reach, fetched from
their owners; and the library's channels-last copies (``permute_to_nhwc`` and back) around it.

Usage: automatic, through torch-harmonics (the rules load the first time one of its kernels meets a domain tensor)::

    attn = torch_harmonics.NeighborhoodAttentionS2(channels, (nlat, nlon), num_heads=2)
    ys = attn(domain.shard(x, dim=2))   # (B, C, nlat, nlon), sharded along latitudes as x is

The neighbourhoods are a sparse pattern (``psi``, the module's buffers: metadata, never the field): query latitude
``ho`` attends to the entries ``roff[ho]:roff[ho + 1]`` of ``col = hi * nlon_in + wi``, each weighted by the quadrature
weight of its latitude ``hi``. A rank keeps its query rows' entries, in their order, shifted to the key rows it
fetched (``Rows``: the gradients of keys and values go back to their owners), and calls the same kernel: each output
is the same softmax over the same neighbours, in the same order, as in one process.

Refused by name: the upsampling variant (its pattern is keyed by the input's latitudes), a query sharded otherwise
than along latitudes, keys or values laid out unlike the query.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
# NOTE: torch-harmonics' own builder of the longitude arcs its CUDA kernels read (private to it, and pinned by the
# version its rules are tested against): the local pattern's arcs are built as the module builds the whole one's
from torch_harmonics.attention._attention_utils import _build_psi_segments

from mesh3d.domain.comm.rows import Span
from mesh3d.domain.core.connected import connected_zeros
from mesh3d.domain.core.split import offsets_of
from mesh3d.domain.core.tensor import DomainTensor
from mesh3d.domain.dispatch.step import Rows, Step
from mesh3d.domain.ops.disco import LocalPsi, PsiCuts

__all__ = ["attention_psi", "attention_rule", "permute_rule"]


def permute_rule(op: Callable[..., torch.Tensor], dims: tuple[int, ...]) -> Callable[..., Step]:
    """The rule for a copy of a 4-D tensor permuted by ``dims`` (the library's ``permute_to_nhwc`` is (0, 2, 3, 1)):
    the local copy, its sharded dim where the permutation puts it."""

    def rule(x) -> Step:
        spec = x.spec
        if spec.dim is None:
            return Step(op, (x,), out=spec)
        if spec.outer > 1:
            raise NotImplementedError(f"{_name(op)} of a strided domain tensor has no rule; call .full_tensor() first")
        return Step(op, (x,), out=spec.with_sizes(spec.sizes, dim=dims.index(spec.dim)))

    return rule


def _name(op: Any) -> str:
    return f"torch.ops.attention_kernels.{getattr(op, '__name__', op)}"


def attention_psi(col: torch.Tensor, roff: torch.Tensor, quad: torch.Tensor, out_sizes: tuple[int, ...], me: int,
           nlon_in: int) -> LocalPsi:
    """Every rank's key rows (the span its query rows' neighbourhoods reach) and this rank's pattern: its rows of
    ``roff`` from 0, its entries' columns from its first key row, that row's quadrature weight first, the arcs."""
    needs = []
    for start, count in zip(offsets_of(out_sizes), out_sizes):
        hi = torch.div(col[int(roff[start]):int(roff[start + count])], nlon_in, rounding_mode="floor")
        needs.append((Span.rows(int(hi.min()), int(hi.max()) + 1),) if count and hi.numel() else ())
    start, count = offsets_of(out_sizes)[me], out_sizes[me]
    if not needs[me]:
        return LocalPsi(tuple(needs), (), (), 0, count)
    first, stop = needs[me][0].start, needs[me][0].stop
    z0, z1 = int(roff[start]), int(roff[start + count])
    local_roff = (roff[start:start + count + 1] - z0).contiguous()
    local_col = (col[z0:z1] - first * nlon_in).contiguous()
    seg, seg_off = _build_psi_segments(local_col, local_roff, nlon_in)
    return LocalPsi(tuple(needs), (quad[first:stop].contiguous(), local_col, local_roff,
                                   seg.to(col.device), seg_off.to(col.device)), (), stop - first, count)


def attention_rule(op: Callable[..., torch.Tensor]) -> Callable[..., Step]:
    """The rule for ``op(kw, vw, qw, quad_weights, col_idx, row_off, seg, seg_off, num_heads, nlon_in, nlat_out,
    nlon_out)``: keys and values (B, nlat_in, nlon_in, C), queries (B, nlat_out, nlon_out, C), channels last."""
    cuts = PsiCuts()

    def rule(kw, vw, qw, quad_weights, col_idx, row_off, seg, seg_off, nh, nlon_in, nlat_out, nlon_out) -> Step:
        args = (kw, vw, qw, quad_weights, col_idx, row_off, seg, seg_off, nh, nlon_in, nlat_out, nlon_out)
        nlat_in = kw.shape[1]
        if nlon_in % nlon_out:
            raise NotImplementedError(
                f"{_name(op)} (torch-harmonics' neighbourhood attention) upsampling ({nlat_in}x{nlon_in} to "
                f"{nlat_out}x{nlon_out}) on domain tensors has no rule: its pattern is keyed by the input's latitudes; "
                "call .full_tensor() on the query, keys and values first")
        dims = [t.spec.dim if isinstance(t, DomainTensor) else None for t in (kw, vw, qw)]
        if dims == [None, None, None] or (dims == [0, 0, 0] and kw.spec.sizes == vw.spec.sizes == qw.spec.sizes):
            return Step(op, args, out=qw.spec if isinstance(qw, DomainTensor) else kw.spec)
        if dims != [1, 1, 1] or any(t.spec.outer > 1 for t in (kw, vw, qw)):
            raise NotImplementedError(
                f"{_name(op)} (torch-harmonics' neighbourhood attention) with keys, values and queries sharded along "
                f"dims {dims}: its rule takes all three sharded along latitudes (dim 2 of the module's input); shard "
                "them with domain.shard(x, dim=2), or call .full_tensor() first")
        out_sizes, me = qw.spec.sizes, qw.spec.comm.index
        psi = (quad_weights, col_idx, row_off)
        local = cuts.get(psi, (nlat_in, nlon_in, nlat_out, nlon_out, out_sizes, me),
                         lambda: attention_psi(col_idx, row_off, quad_weights, out_sizes, me, nlon_in))

        def compute(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
            if not local.rows_in:  # no query rows here: nothing attends, zeros connected for backward
                return connected_zeros(q, [q.shape[0], local.rows_out, nlon_out, v.shape[3]], k, v, q)
            quad, col, roff, seg_l, seg_off_l = local.psi
            return op(k, v, q, quad, col, roff, seg_l, seg_off_l, nh, nlon_in, local.rows_out, nlon_out)

        return Step(compute, (Rows(kw, local.needs), Rows(vw, local.needs), qw), out=qw.spec)

    return rule
