"""Order statistics on slabs and blocks: ``sort``, ``argsort``, ``topk``, ``kthvalue``, ``median``, ``nanmedian``, ``mode``,
``quantile``, ``nanquantile``, ``cummax``, ``cummin`` and ``logcumsumexp`` (and their tensor methods), the one-process
values, indices and gradients.

Usage: ``torch.sort(xs, dim=xs.spec.dim).values`` is this rank's rows of the one-process sort, sharded like ``xs``;
``torch.median(xs, dim=xs.spec.dim)`` is the one-process median, replicated.

Along any other dim each rank works on its own rows. Along the sharded dim (or over everything) an order needs every
row: each rank puts its shard at its offset in a tensor of the global length along that dim, zeros elsewhere, and one
all-reduce of those sums them into the whole (exact: each element has one non-zero term). So this moves the whole
tensor to every rank (D times the shard's memory for the call): meant for the sizes order statistics are taken
over (sequence positions, a profile, a loss's quantile), not for a full-resolution field in a training step.
The parts are a partial result the executor combines (``step.Partial``); gradients: an output sharded like the input
(``sort``, ``cummax``) uses its rows of the whole (``for_shards``: each rank's partial gradient of the whole is summed
back to the owner of each row); a replicated output (``topk``, ``median``) is passed straight back. Indices are global.

On blocks the same holds along a block dim (the whole along it from the ranks of this rank's grid line: the partial
result's ``over``) for the orders that keep the shape (``sort``, ``argsort``, the scans) and over everything
(``median()``, ``quantile(q)``: the whole tensor, replicated); ``topk`` and the reductions along one block dim are
refused by name, since blocks reduce over all their block dims or none.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mesh3d.domain.core.specs import BlockSpec, DomainSpec
from mesh3d.domain.core.tensor import DomainTensor, adopt, unwrap
from mesh3d.domain.dispatch.registry import BLOCK_RULES, op_name, register
from mesh3d.domain.dispatch.step import Partial, Step

__all__ = ["whole_part"]

# name -> (the parameters after the input, in torch's order; the default dim; the kind of output)
# kinds: "keep" (the input's shape: sharded like it), "select" (a few entries along dim), "reduce" (dim removed)
_OPS: dict[str, tuple[tuple[str, ...], int | None, str]] = {
    "sort": (("dim", "descending", "stable"), -1, "keep"),
    "argsort": (("dim", "descending", "stable"), -1, "keep"),
    "cummax": (("dim",), None, "keep"),
    "cummin": (("dim",), None, "keep"),
    "logcumsumexp": (("dim",), None, "keep"),
    "topk": (("k", "dim", "largest", "sorted"), -1, "select"),
    "kthvalue": (("k", "dim", "keepdim"), -1, "reduce"),
    "mode": (("dim", "keepdim"), -1, "reduce"),
    "median": (("dim", "keepdim"), None, "reduce"),
    "nanmedian": (("dim", "keepdim"), None, "reduce"),
    "quantile": (("q", "dim", "keepdim", "interpolation"), None, "reduce"),
    "nanquantile": (("q", "dim", "keepdim", "interpolation"), None, "reduce"),
}


#: What torch refuses on an empty input (an empty shard computes on a stand-in row; ``_on_shard``).
_NEED_ROWS = (torch.quantile, torch.Tensor.quantile, torch.nanquantile, torch.Tensor.nanquantile)


def whole_part(local: torch.Tensor, dim: int, sizes: tuple[int, ...], index: int) -> torch.Tensor:
    """This rank's part of the whole of a tensor sharded along ``dim`` (``sizes`` per rank; ``local`` the rows of rank
    ``index``): its rows at their offset, zeros elsewhere. The parts of all ranks sum to the whole, exactly.

    Usage: ``Step(lambda t: whole_part(t, 2, spec.sizes, i), (xs,), out=replicated, partial=Partial())``"""
    before, after = sum(sizes[:index]), sum(sizes[index + 1:])
    parts = [local.new_zeros([before if i == dim else s for i, s in enumerate(local.shape)])] if before else []
    parts.append(local)
    if after:
        parts.append(local.new_zeros([after if i == dim else s for i, s in enumerate(local.shape)]))
    return torch.cat(parts, dim) if len(parts) > 1 else local


def _bind(func: Callable, names: tuple[str, ...], args: tuple, kwargs: dict) -> dict:
    if len(args) > len(names):
        raise TypeError(f"{op_name(func)} takes at most {len(names) + 1} positional arguments")
    bound = dict(zip(names, args))
    for key, value in kwargs.items():
        if key not in names or key in bound:
            raise TypeError(f"{op_name(func)} got an unexpected or repeated argument {key!r}")
        bound[key] = value
    return bound


def _apply(result, fn: Callable[[torch.Tensor], DomainTensor]):
    """``fn`` on every tensor of ``result`` (a tensor, or torch's named (values, indices) pair), same type back."""
    if isinstance(result, torch.Tensor):
        return fn(result)
    return type(result)(tuple(fn(t) for t in result))


def _parsed(func: Callable, name: str, input: DomainTensor, args: tuple, kwargs: dict) -> tuple[dict, int | None]:
    """torch's arguments of ``func`` by name, and the dim (non-negative; None: over everything)."""
    names, default_dim, kind = _OPS[name]
    if kwargs.pop("out", None) is not None:
        raise NotImplementedError(f"{op_name(func)}(out=...) is not supported on a domain tensor; use the result")
    bound = _bind(func, names, args, kwargs)
    dim = bound.get("dim", default_dim)
    if dim is None and default_dim is None and kind != "reduce":
        raise TypeError(f"{op_name(func)} needs dim")
    if dim is not None:
        if not isinstance(dim, int) or not -input.ndim <= dim < input.ndim:
            raise IndexError(f"{op_name(func)}: dim={dim!r} is out of range for a {input.ndim}-D tensor")
        dim %= input.ndim
        bound["dim"] = dim
    return bound, dim


def _moved(d: int, dim: int, kind: str, bound: dict, in_ndim: int, out_ndim: int) -> int:
    """Where input dim ``d`` is in the output of an order statistic along ``dim`` (another dim than ``d``)."""
    removed = kind == "reduce" and not bound.get("keepdim", False)
    return d - (removed and dim < d) + out_ndim - (in_ndim - removed)   # NOTE: quantile's q dim comes first


def _on_shard(func: Callable, local: torch.Tensor, bound: dict, sharded: tuple[int, ...], dim: int, kind: str):
    """``func`` on this rank's shard along ``dim`` (not a sharded dim). torch's quantile refuses an empty input: an
    empty shard's is computed on one zero row along each empty sharded dim, then cut back to none (still in autograd's
    graph, as the other ranks' are)."""
    empty = [d for d in sharded if local.shape[d] == 0]
    if not empty or func not in _NEED_ROWS:
        return func(local, **bound)
    for d in empty:
        local = torch.cat([local, local.new_zeros([1 if i == d else n for i, n in enumerate(local.shape)])], d)
    result = func(local, **bound)

    def cut(t: torch.Tensor) -> torch.Tensor:
        for d in empty:
            t = t.narrow(_moved(d, dim, kind, bound, local.ndim, t.ndim), 0, 0)
        return t

    return _apply(result, cut)


def _rule(func: Callable, name: str):
    kind = _OPS[name][2]

    def rule(input: DomainTensor, *args, **kwargs):
        bound, dim = _parsed(func, name, input, args, kwargs)
        spec, comm = input.spec, input.spec.comm
        if spec.dim is None:  # replicated: every rank holds the whole
            return _apply(func(unwrap(input), **bound), lambda t: adopt(t, spec))
        if dim is not None and dim != spec.dim:  # along another dim: this rank's rows alone
            result = _on_shard(func, unwrap(input), bound, (spec.dim,), dim, kind)
            return _apply(result, lambda t: adopt(t, spec.with_sizes(
                spec.sizes, dim=_moved(spec.dim, dim, kind, bound, input.ndim, t.ndim))))
        # NOTE: the whole along the sharded dim, as the sum of each rank's part (``step.Partial``, combined by the
        # executor): this rank's rows of the result (kind "keep"), or the whole result, replicated
        d, sizes, index = spec.dim, spec.sizes, comm.index

        def part(t: torch.Tensor) -> torch.Tensor:
            return whole_part(t, d, sizes, index)

        if kind == "keep":
            start, rows = sum(sizes[:index]), sizes[index]

            def own_rows(whole: torch.Tensor):
                return _apply(func(whole, **bound), lambda t: t.narrow(d, start, rows))
            return Step(part, (input,), out=spec, partial=Partial("sum", own_rows, for_shards=True))
        return Step(part, (input,), out=DomainSpec.replicated(comm),
                    partial=Partial("sum", lambda whole: func(whole, **bound)))

    return rule


def _block_rule(func: Callable, name: str):
    kind = _OPS[name][2]

    def rule(input: DomainTensor, *args, **kwargs):
        bound, dim = _parsed(func, name, input, args, kwargs)
        spec = input._spec
        assert isinstance(spec, BlockSpec)
        if dim is None:  # over everything: the whole tensor, replicated, as the sum of each rank's part of it
            def parts(t: torch.Tensor) -> torch.Tensor:
                for d, sizes, line in zip(spec.dims, spec.sizes, spec.lines):
                    t = whole_part(t, d, sizes, line.index)
                return t
            return Step(parts, (input,), out=DomainSpec.replicated(spec.comm),
                        partial=Partial("sum", lambda whole: func(whole, **bound)))
        if dim not in spec.dims:  # along another dim: this rank's block alone
            result = _on_shard(func, unwrap(input), bound, spec.dims, dim, kind)
            return _apply(result, lambda t: adopt(t, BlockSpec(
                tuple(_moved(b, dim, kind, bound, input.ndim, t.ndim) for b in spec.dims), spec.sizes, spec.lines,
                spec.comm)))
        if kind != "keep":
            raise NotImplementedError(
                f"{op_name(func)} along block dim {dim} of a block tensor (block dims {spec.dims}) has no rule: blocks "
                "reduce over all their block dims or none; take it over everything (dim=None where it allows), "
                "shard as slabs (domain.shard(x, dim=...)), or call .full_tensor() first")
        axis = spec.dims.index(dim)
        sizes, line = spec.sizes[axis], spec.lines[axis]
        start, rows = spec.offsets[axis], spec.local_sizes[axis]

        def own_rows(whole: torch.Tensor):  # NOTE: the whole along this grid line, combined over the line alone
            return _apply(func(whole, **bound), lambda t: t.narrow(dim, start, rows))
        return Step(lambda t: whole_part(t, dim, sizes, line.index), (input,), out=spec,
                    partial=Partial("sum", own_rows, for_shards=True, over=line))

    return rule


for _name in _OPS:
    for _func in (getattr(torch, _name), getattr(torch.Tensor, _name)):
        register(_func)(_rule(_func, _name))
        BLOCK_RULES.register(_func, _block_rule(_func, _name))
