"""``torch.cdist`` with rows of a domain tensor (a codebook lookup after ``x.view(-1, c)``), on slabs and strided slabs.

Usage: automatic: ``d = torch.cdist(xs.view(-1, c), codebook)`` gives each rank its rows' distances to every code.

Distances are row by row: rows sharded (along the row dim or a batch dim, strided or not) against whole rows
(plain or replicated) are local; whole rows against sharded ones give the columns sharded; two sharded sets of
rows gather the second whole (O(its rows) per rank). A sharded feature dim (the one summed over) is refused.
"""

from __future__ import annotations

import torch

from mesh3d.domain.comm.rows import Span
from mesh3d.domain.core.tensor import DomainTensor
from mesh3d.domain.dispatch.registry import RULES, STRIDED_RULES, op_name
from mesh3d.domain.ops import idioms  # noqa: F401  (F.embedding's rule, shared with strided layouts)
from mesh3d.domain.dispatch.step import Entering, Rows, Step
from mesh3d.domain.ops.reduce import domain_reduce

__all__: list[str] = []


def _sharded(t) -> bool:
    return isinstance(t, DomainTensor) and t.spec.dim is not None


def _cdist(x1, x2, p=2.0, compute_mode="use_mm_for_euclid_dist_if_necessary"):
    for t in (x1, x2):
        if _sharded(t) and t.spec.dim == t.ndim - 1:
            raise NotImplementedError("torch.cdist over a sharded feature dim (the last one, summed over) is not "
                                      "supported; shard the rows (dim -2) or a batch dim")

    def run(a, b):  # NOTE: aten.cdist's compute_mode=None (torch.ops calls) is torch.cdist's default
        return torch.cdist(a, b, p, compute_mode or "use_mm_for_euclid_dist_if_necessary")

    whole2 = Entering(x2) if isinstance(x2, DomainTensor) and not _sharded(x2) else x2
    if _sharded(x1):
        if _sharded(x2):
            if x2.spec.dim != x2.ndim - 2 or x2.spec.outer != 1:
                raise NotImplementedError("torch.cdist of two sharded sets of rows: the second must be sharded along "
                                          "its rows (dim -2) as a slab")
            everything = tuple((Span.rows(0, sum(x2.spec.sizes)),) for _ in x2.spec.sizes)
            whole2 = Rows(x2, everything)
        shift = max(x1.ndim, x2.ndim) - x1.ndim
        return Step(run, (x1, whole2), out=x1.spec.with_sizes(x1.spec.sizes, dim=x1.spec.dim + shift),
                    keep=(x2,) if not isinstance(x2, DomainTensor) else ())
    spec = x2.spec
    if spec.dim != x2.ndim - 2:
        raise NotImplementedError("torch.cdist of whole rows against rows sharded along a batch dim: shard both alike")
    whole1 = Entering(x1) if isinstance(x1, DomainTensor) else x1
    out_ndim = max(x1.ndim, x2.ndim)
    return Step(run, (whole1, x2), out=spec.with_sizes(spec.sizes, dim=out_ndim - 1),
                keep=(x1,) if not isinstance(x1, DomainTensor) else ())


for _table in (RULES, STRIDED_RULES):
    _table.register(torch.cdist, _cdist)


def _strided_reduction(func):
    """``sum``/``mean`` of a strided layout over dims other than the strided one (einops' ``reduce`` of the feature
    dim of ``(b n) d`` rows): local; over every dim (a loss's mean of per-row losses): one sum over the domain, as
    on slabs; over the strided dim and not all others it is refused (reshape back first)."""
    def rule(input, dim=None, keepdim=False, *, dtype=None):
        dims = range(input.ndim) if dim is None else [d % input.ndim for d in ((dim,) if isinstance(dim, int) else dim)]
        if len(set(dims)) == input.ndim and not keepdim and dtype is None:  # NOTE: the rows' order does not matter
            return domain_reduce(input, "mean" if func is torch.mean else "sum")
        if input.spec.dim in dims:
            raise NotImplementedError(f"{func.__name__} over the strided sharded dim {input.spec.dim}: reshape to the "
                                      "unstrided shape first")
        new = input.spec.dim if keepdim else input.spec.dim - sum(d < input.spec.dim for d in dims)
        return Step(lambda t: func(t, tuple(dims), keepdim, dtype=dtype), (input,),
                    out=input.spec.with_sizes(input.spec.sizes, dim=new))

    return rule


for _f, _g in ((torch.sum, torch.sum), (torch.Tensor.sum, torch.sum), (torch.mean, torch.mean),
               (torch.Tensor.mean, torch.mean)):
    STRIDED_RULES.register(_f, _strided_reduction(_g))


def _arg_extreme(func):
    """``argmin``/``argmax`` along a dim that is not sharded (the nearest code of each row): local, indices of that dim;
    along the sharded dim (a global index) or over every element it is refused."""
    def rule(input, dim=None, keepdim=False):
        if dim is None or dim % input.ndim == input.spec.dim:
            raise NotImplementedError(f"{op_name(func)} along the sharded dim {input.spec.dim} (or of every element) "
                                      "on a domain tensor: its global index depends on every rank's rows; call "
                                      ".full_tensor() first")
        d = dim % input.ndim
        new = input.spec.dim if keepdim or d > input.spec.dim else input.spec.dim - 1
        return Step(lambda t: func(t, d, keepdim), (input,), out=input.spec.with_sizes(input.spec.sizes, dim=new))

    return rule


for _table in (RULES, STRIDED_RULES):
    for _f, _g in ((torch.argmin, torch.argmin), (torch.Tensor.argmin, torch.argmin), (torch.argmax, torch.argmax),
                   (torch.Tensor.argmax, torch.argmax)):
        _table.register(_f, _arg_extreme(_g))
STRIDED_RULES.register(torch.nn.functional.embedding, RULES.get(torch.nn.functional.embedding))
