"""torch-harmonics' DISCO convolutions (``DiscreteContinuousConvS2`` and its transpose) on latitude slabs: each rank
computes the output latitudes it owns from the input latitudes their filters reach, fetched from their owners.

Usage: automatic, through torch-harmonics (the rules load the first time one of its kernels meets a domain tensor)::

    conv = torch_harmonics.DiscreteContinuousConvS2(c_in, c_out, (nlat, nlon), (nlat_out, nlon_out), kernel_shape=3)
    ys = conv(domain.shard(x, dim=2))   # (B, C_out, nlat_out, nlon_out), sharded along latitudes

The convolution is a sparse contraction with a precomputed tensor psi: output latitude ``ho`` (for basis function
``k``) sums ``vals[z] * x[hi, (wi + pscale * wo) % nlon_in]`` over its entries ``z`` (``col = hi * nlon_in + wi``).
Longitudes are whole on a latitude slab, so their periodicity is the kernel's own; along latitudes the rule reads psi
(metadata: the module's buffers, never the field) to know which input rows each rank's output rows read, fetches them
(``Rows``: their gradient goes back to their owners), and calls the same kernel on the part of psi whose rows this
rank owns, its row and column indices shifted to the fetched rows. Each output is the same sum, term by term in the
same order, as in one process; the gradient sums across ranks. The transpose reads psi the other way (its columns are
the output's latitudes). Output latitudes follow the input's sizes where the grids have as many; otherwise each goes
to the rank holding the input row at the same fraction of the sphere.

Refused by name: a slab along longitudes (the kernel shifts longitudes; shard latitudes, dim 2), strided layouts,
the pure-PyTorch path (``optimized_kernel=False``: sparse matrices mesh3d has no rules for).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils.weak import WeakTensorKeyDictionary
# NOTE: torch-harmonics' own builder of the kernel-split CSR its fused and save-x kernels take (private to it, and
# pinned by the version its rules are tested against): the local psi needs it built as the module builds it
from torch_harmonics.disco.optimized.disco_optimized import _build_kernel_split_csr, _split_csr_python_offsets

from mesh3d.domain.comm.rows import Span
from mesh3d.domain.core.connected import connected_zeros
from mesh3d.domain.core.split import offsets_of
from mesh3d.domain.core.tensor import DomainTensor
from mesh3d.domain.dispatch.step import Rows, Step
from mesh3d.domain.halo.windows import sizes_by_first_index

__all__ = ["LocalPsi", "PsiCuts", "contract_local", "contraction_args", "contraction_rule", "forward_cut", "local_psi",
           "out_sizes_for", "transpose_cut", "transpose_local", "transpose_rule"]


class LocalPsi(NamedTuple):
    """The part of psi one rank computes with (CSR row offsets, then the entries, indices shifted to its rows; for
    the fused and save-x kernels also their kernel-split CSR), and every rank's fetched input rows."""

    needs: tuple
    psi: tuple[torch.Tensor, ...]
    split: tuple
    rows_in: int    # how many input rows this rank fetches
    rows_out: int   # how many output rows it owns


def _reads_per_rank(out_of: torch.Tensor, in_of: torch.Tensor, out_sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    """(first, last) input row the entries of each rank's output rows read; (0, -1) for none."""
    offsets = offsets_of(out_sizes)
    owner = torch.bucketize(out_of, torch.tensor(offsets[1:], dtype=out_of.dtype), right=True)
    n = len(out_sizes)
    big = torch.iinfo(in_of.dtype).max
    first = torch.full((n,), big, dtype=in_of.dtype).scatter_reduce(0, owner, in_of, "amin")
    last = torch.full((n,), -1, dtype=in_of.dtype).scatter_reduce(0, owner, in_of, "amax")
    return [(int(a), int(b)) if b >= 0 and c > 0 else (0, -1) for a, b, c in zip(first, last, out_sizes)]


def local_psi(psi: tuple[torch.Tensor, ...], out_of: torch.Tensor, in_of: torch.Tensor, out_sizes: tuple[int, ...],
           me: int, shifts: Callable[[int, int], tuple[int, int]], kernel_size: int, split: bool) -> LocalPsi:
    """This rank's part of psi: the entries whose output row it owns, in psi's order, grouped as in psi (a CSR group
    keeps what is left of it), the row and column indices shifted by ``shifts(first input row, first output row)``."""
    roff, ker, row, col, vals = psi
    reads = _reads_per_rank(out_of, in_of, out_sizes)
    needs = tuple((Span.rows(a, b + 1),) if b >= a else () for a, b in reads)
    start, count = offsets_of(out_sizes)[me], out_sizes[me]
    first_in, last_in = reads[me]
    keep = (out_of >= start) & (out_of < start + count)
    lengths = roff[1:] - roff[:-1]
    group = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    counts = torch.bincount(group[keep], minlength=lengths.numel())
    counts = counts[counts > 0]
    row_shift, col_shift = shifts(first_in, start)
    local = (torch.cat([roff.new_zeros(1), torch.cumsum(counts, 0)]), ker[keep].contiguous(),
             (row[keep] - row_shift).contiguous(), (col[keep] - col_shift).contiguous(), vals[keep].contiguous())
    made = ()
    if split and last_in >= first_in:
        parts = _build_kernel_split_csr(*local, kernel_size, count)
        made = (*parts, *_split_csr_python_offsets(parts[1]))
    return LocalPsi(needs, local, made, max(0, last_in - first_in + 1), count)


class PsiCuts:
    """Per call signature (psi's tensors and their versions, the layouts, this rank): its ``LocalPsi``. Owned by a
    rule; keyed by psi's first tensor itself, weakly: an entry goes with the module's buffers, so a module built where
    a freed one's buffers were (same addresses, same sizes) never finds the freed one's cut."""

    def __init__(self, maxsize: int = 8) -> None:
        self._cache: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self._maxsize = maxsize

    def get(self, psi: tuple[torch.Tensor, ...], rest: tuple, make: Callable[[], LocalPsi]) -> LocalPsi:
        per_psi = self._cache.get(psi[0])
        if per_psi is None:
            per_psi = self._cache[psi[0]] = OrderedDict()
        key = (*((id(t), t._version) for t in psi), *rest)
        hit = per_psi.get(key)
        if hit is None:
            hit = per_psi[key] = make()
            if len(per_psi) > self._maxsize:  # layouts seen with these buffers: the oldest goes
                per_psi.popitem(last=False)
        else:
            per_psi.move_to_end(key)
        return hit


def out_sizes_for(in_sizes: tuple[int, ...], n_in: int, n_out: int) -> tuple[int, ...]:
    """Output latitudes per rank: the input's sizes on as many latitudes; else output ``o`` goes to the rank holding
    input row ``floor(o * n_in / n_out)`` (the row at the same fraction of the sphere)."""
    if n_in == n_out:
        return in_sizes
    return sizes_by_first_index(in_sizes, n_out, lambda row: -(-(row * n_out) // n_in))


def _refuse_unless_latitudes(name: str, inp: DomainTensor, lat_dim: int, *, channels: bool) -> None:
    spec = inp.spec
    fine = (None, 0, lat_dim, 1) if channels else (None, 0, lat_dim)
    if spec.outer > 1 or spec.dim not in fine:
        raise NotImplementedError(
            f"{name} (torch-harmonics' DISCO convolution) on a domain tensor sharded along dim {spec.dim}"
            f"{' (strided)' if spec.outer > 1 else ''}: its rule takes latitudes sharded (dim {lat_dim}) with "
            f"longitudes whole, or samples{' or channels' if channels else ''}; shard with "
            f"domain.shard(x, dim={lat_dim}), or call .full_tensor() first")


def contraction_args(args: tuple, with_weight: bool) -> tuple[tuple[torch.Tensor, ...], tuple]:
    """psi (its five tensors) and the arguments after the CSR, of a forward contraction's arguments after ``inp``."""
    head = 1 if with_weight else 0
    return tuple(args[head:head + 5]), tuple(args[head + 5 + (6 if with_weight else 0):])


def forward_cut(cuts: PsiCuts, psi: tuple[torch.Tensor, ...], shape: tuple[int, int], tail: tuple,
                out_sizes: tuple[int, ...], me: int, with_weight: bool) -> LocalPsi:
    """This rank's part of a forward contraction's psi (cached in ``cuts``): output rows are psi's rows, input rows
    its columns' latitudes; ``shape``: the input's (nlat, nlon)."""
    nlat_in, nlon_in = shape
    _, _, row, col, _ = psi
    return cuts.get(psi, (nlat_in, nlon_in, tail[1], out_sizes, me), lambda: local_psi(
        psi, row, torch.div(col, nlon_in, rounding_mode="floor"), out_sizes, me,
        lambda first_in, first_out: (first_out, first_in * nlon_in), tail[0], with_weight))


def transpose_cut(cuts: PsiCuts, psi: tuple[torch.Tensor, ...], nlat_in: int, tail: tuple, out_sizes: tuple[int, ...],
                  me: int) -> LocalPsi:
    """This rank's part of a transpose contraction's psi (cached in ``cuts``): output rows are its columns'
    latitudes, input rows psi's rows; ``tail``: (K, nlat_out, nlon_out)."""
    _, _, row, col, _ = psi
    nlon_out = tail[2]
    return cuts.get(psi, (nlat_in, tail[1], nlon_out, out_sizes, me), lambda: local_psi(
        psi, torch.div(col, nlon_out, rounding_mode="floor"), row, out_sizes, me,
        lambda first_in, first_out: (first_in, first_out * nlon_out), tail[0], False))


def contraction_rule(op: Callable[..., torch.Tensor], name: str, *, with_weight: bool) -> Callable[..., Step]:
    """The rule for a forward contraction ``op(inp, [weight,] roff, ker, row, col, vals, [kernel-split CSR x 6,] K,
    nlat_out, nlon_out, [groups, groupsize, split offsets x 2])`` of ``inp`` (B, C, nlat_in, nlon_in). ``with_weight``:
    the fused and save-x variants, which also contract the channels with the weight (B, C_out, nlat_out, nlon_out)."""
    cuts = PsiCuts()

    def rule(inp, *args: Any) -> Step:
        _refuse_unless_latitudes(name, inp, 2, channels=not with_weight)
        spec = inp.spec
        if spec.dim != 2:  # samples, channels or whole: every rank its own, as it is
            return Step(op, (inp, *args), out=spec)
        psi, tail = contraction_args(args, with_weight)
        out_sizes = out_sizes_for(spec.sizes, inp.shape[2], tail[1])
        local = forward_cut(cuts, psi, (inp.shape[2], inp.shape[3]), tail, out_sizes, spec.comm.index, with_weight)

        def compute(part: torch.Tensor, *weight: torch.Tensor) -> torch.Tensor:
            return contract_local(op, part, weight, local, tail)

        reads = Rows(inp, local.needs)
        return Step(compute, (reads, args[0]) if with_weight else (reads,),
                    out=spec.with_sizes(out_sizes, dim=2 if with_weight else 3))

    return rule


def contract_local(op: Callable[..., torch.Tensor], part: torch.Tensor, weight: tuple, local: LocalPsi,
                   tail: tuple) -> torch.Tensor:
    """The forward contraction of the fetched input rows ``part`` with this rank's psi, for every output longitude
    (``weight``: the fused and save-x variants' weight, or empty; ``tail``: the op's arguments after the CSR)."""
    kernel_size, nlon_out = tail[0], tail[2]
    if not local.rows_in:  # no entry reads a row here (or no output rows): zeros, connected for backward
        channels = [tail[3] * weight[0].shape[1]] if weight else [part.shape[1], kernel_size]
        return connected_zeros(part, [part.shape[0], *channels, local.rows_out, nlon_out], part, *weight)
    if weight:
        return op(part, weight[0], *local.psi, *local.split[:6], kernel_size, local.rows_out, nlon_out, *tail[3:5],
                  *local.split[6:])
    return op(part, *local.psi, kernel_size, local.rows_out, nlon_out)


def transpose_local(op: Callable[..., torch.Tensor], part: torch.Tensor, local: LocalPsi, tail: tuple) -> torch.Tensor:
    """The transpose contraction of the fetched input rows ``part`` with this rank's psi, every output longitude."""
    if not local.rows_in:
        return connected_zeros(part, [part.shape[0], part.shape[1], local.rows_out, tail[2]], part)
    return op(part, *local.psi, tail[0], local.rows_out, tail[2])


def transpose_rule(op: Callable[..., torch.Tensor], name: str) -> Callable[..., Step]:
    """The rule for the transpose contraction ``op(inp, roff, ker, row, col, vals, K, nlat_out, nlon_out)`` of ``inp``
    (B, C, K, nlat_in, nlon_in), latitudes along dim 3; psi's rows are the input's latitudes, its columns the
    output's (``col = ho * nlon_out + wo``): (B, C, nlat_out, nlon_out)."""
    cuts = PsiCuts()

    def rule(inp, roff, ker, row, col, vals, kernel_size, nlat_out, nlon_out) -> Step:
        _refuse_unless_latitudes(name, inp, 3, channels=True)
        psi, tail, spec = (roff, ker, row, col, vals), (kernel_size, nlat_out, nlon_out), inp.spec
        if spec.dim != 3:
            return Step(op, (inp, *psi, *tail), out=spec)
        out_sizes = out_sizes_for(spec.sizes, inp.shape[3], nlat_out)
        local = transpose_cut(cuts, psi, inp.shape[3], tail, out_sizes, spec.comm.index)
        return Step(lambda part: transpose_local(op, part, local, tail), (Rows(inp, local.needs),),
                    out=spec.with_sizes(out_sizes, dim=2))

    return rule
