"""Order statistics on slabs: ``sort``, ``argsort``, ``topk``, ``kthvalue``, ``median``, ``nanmedian``, ``mode``,
``quantile``, ``nanquantile``, ``cummax``, ``cummin`` and ``logcumsumexp`` (and their tensor methods), the one-process
values, indices and gradients.

Usage: ``torch.sort(xs, dim=xs.spec.dim).values`` is this rank's rows of the one-process sort, sharded like ``xs``;
``torch.median(xs, dim=xs.spec.dim)`` is the one-process median, replicated.

Along any other dim each rank works on its own rows. Along the sharded dim (or over everything) an order needs every
row: each rank puts its shard at its offset in a tensor of the global length along that dim, zeros elsewhere, and one
all-reduce of those sums them into the whole (exact: each element has one non-zero term). So this moves the whole
tensor to every rank (D times the shard's memory for the call): meant for the sizes order statistics are taken
over (sequence positions, a profile, a loss's quantile), not for a full-resolution field in a training step.
Gradients follow ``collectives``: an output sharded like the input (``sort``, ``cummax``) gets the whole through
``reduce_for_local_use`` (each rank's partial gradient of the whole is summed back to the owner of each row); a
replicated output (``topk``, ``median``) through ``reduce_to_replicated``. Indices are global.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mesh3d.domain.comm.collectives import reduce_for_local_use, reduce_to_replicated
from mesh3d.domain.core.specs import DomainSpec
from mesh3d.domain.core.tensor import DomainTensor, adopt, unwrap
from mesh3d.domain.dispatch.registry import op_name, register

__all__ = ["whole_along"]

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


def whole_along(x: DomainTensor, for_shards: bool) -> torch.Tensor:
    """The whole of ``x`` (a slab tensor) on every rank, differentiable: for use by this rank's shard
    (``for_shards``: its gradient is summed over the domain) or as a replicated value (passed straight back)."""
    local, spec = unwrap(x), x.spec
    comm, d, sizes = spec.comm, spec.dim, spec.sizes
    before, after = sum(sizes[: comm.index]), sum(sizes[comm.index + 1:])
    parts = [local.new_zeros([before if i == d else s for i, s in enumerate(local.shape)])] if before else []
    parts.append(local)
    if after:
        parts.append(local.new_zeros([after if i == d else s for i, s in enumerate(local.shape)]))
    padded = torch.cat(parts, d) if len(parts) > 1 else local
    return (reduce_for_local_use if for_shards else reduce_to_replicated)(padded, comm)


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


def _rule(func: Callable, name: str):
    names, default_dim, kind = _OPS[name]

    def rule(input: DomainTensor, *args, out=None, **kwargs):
        if out is not None:
            raise NotImplementedError(f"{op_name(func)}(out=...) is not supported on a domain tensor; use the result")
        bound = _bind(func, names, args, kwargs)
        dim = bound.get("dim", default_dim)
        if dim is None and default_dim is None and kind != "reduce":
            raise TypeError(f"{op_name(func)} needs dim")
        spec, comm = input.spec, input.spec.comm
        if dim is not None:
            if not isinstance(dim, int) or not -input.ndim <= dim < input.ndim:
                raise IndexError(f"{op_name(func)}: dim={dim!r} is out of range for a {input.ndim}-D tensor")
            dim %= input.ndim
            bound["dim"] = dim
        if spec.dim is None:  # replicated: every rank holds the whole
            return _apply(func(unwrap(input), **bound), lambda t: adopt(t, spec))
        if dim is not None and dim != spec.dim:  # along another dim: this rank's rows alone
            result = func(unwrap(input), **bound)
            return _apply(result, lambda t: adopt(t, _local_spec(spec, t, input.ndim, dim, kind, bound)))
        if kind == "keep":  # the whole along the sharded dim, this rank's rows of the result
            start, rows = sum(spec.sizes[: comm.index]), spec.sizes[comm.index]
            result = func(whole_along(input, for_shards=True), **bound)
            return _apply(result, lambda t: adopt(t.narrow(spec.dim, start, rows), spec))
        result = func(whole_along(input, for_shards=False), **bound)
        return _apply(result, lambda t: adopt(t, DomainSpec.replicated(comm)))

    return rule


def _local_spec(spec: DomainSpec, out: torch.Tensor, ndim: int, dim: int, kind: str, bound: dict) -> DomainSpec:
    """The spec of an order statistic taken along ``dim``, another dim than the sharded one."""
    if kind != "reduce" or bound.get("keepdim", False):
        new_dim = spec.dim
    else:
        new_dim = spec.dim - (dim < spec.dim)
    new_dim += out.ndim - (ndim if kind != "reduce" or bound.get("keepdim", False) else ndim - 1)  # quantile's q dim
    return spec.with_sizes(spec.sizes, dim=new_dim)


for _name in _OPS:
    for _func in (getattr(torch, _name), getattr(torch.Tensor, _name)):
        register(_func)(_rule(_func, _name))
