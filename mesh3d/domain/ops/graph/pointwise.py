"""Graph rules that keep every item where it is: element-wise ops, ``Linear``, norms and softmax over features,
and the views and reshapes that keep the item dim.

Usage (through torch): ``F.relu(lin(torch.cat([xs, hs], -1))) + xs``, ``h.view(-1, heads, c)``, ``idx.view(-1, 1)
.expand_as(msg)`` on tensors of one graph layout; any other layout meeting them raises, naming the op.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mesh3d.domain.core.specs import GraphSpec
from mesh3d.domain.core.tensor import DomainTensor, adopt, size_of, unwrap
from mesh3d.domain.dispatch.kept_steps import layout_rule
from mesh3d.domain.dispatch.registry import GRAPH_RULES, op_name
from mesh3d.domain.dispatch.step import Step, whole_operand
from mesh3d.domain.ops.grid_local import LocalGrid, local_rules
from mesh3d.domain.ops import pointwise
from mesh3d.domain.ops.graph.common import VALUE_KEEPING, graph_spec_of, is_graph, rows_for, sharded_at
from mesh3d.domain.ops.pointwise import ELEMENTWISE
from mesh3d.domain.ops.random_ops import dropout_mask

__all__ = ["elementwise_rule", "reshape_rule"]


def _lead(func: Callable, tensors: list) -> DomainTensor:
    graphs = [t for t in tensors if is_graph(t)]
    ref = graphs[0]
    spec = graph_spec_of(ref)
    for t in graphs[1:]:
        other = graph_spec_of(t)
        if other.items != spec.items or t.ndim - other.dim != ref.ndim - spec.dim:
            raise ValueError(
                f"{op_name(func)}: graph tensors laid out differently ({spec.items} along dim {spec.dim} of a "
                f"{ref.ndim}-D tensor vs {other.items} along dim {other.dim} of a {t.ndim}-D one); nodes and edges "
                "meet through a gather (x[src]) or a scatter (index_add_), not element by element")
    return ref


def elementwise_rule(func: Callable) -> Callable:
    keeps_values = func in VALUE_KEEPING

    def rule(*args, **kwargs):
        pointwise.refuse_other_forms(func, args, kwargs)
        ref = _lead(func, [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)])
        spec = graph_spec_of(ref)
        name = op_name(func)
        local = lambda o: unwrap(o) if is_graph(o) else rows_for(o, sharded_at(o, ref) if isinstance(o, torch.Tensor)
                                                                 else -1, spec, name)
        out = func(*[local(a) for a in args], **{k: local(v) for k, v in kwargs.items()})
        if not isinstance(out, torch.Tensor):
            return out
        keep = tuple(t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and not isinstance(t, DomainTensor))
        dim = out.ndim - (ref.ndim - spec.dim)
        return adopt(out, spec.replaced(dim=dim, endpoint=spec.endpoint if keeps_values else None), keep)
    return rule


def _features_only(op: str, x: DomainTensor, dims) -> None:
    spec = graph_spec_of(x)
    if spec.dim in {d % x.ndim for d in dims}:
        raise NotImplementedError(f"{op} along the item dim {spec.dim} of a graph tensor: its items are spread over the "
                                  "ranks; reduce over a graph's items with torch.sum/mean, aggregate with index_add_ / "
                                  "scatter_reduce, or call .full_tensor() first")


def _layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    _features_only("torch.nn.functional.layer_norm", input, range(input.ndim - len(normalized_shape), input.ndim))
    return Step(lambda t, w, b: F.layer_norm(t, normalized_shape, w, b, eps),
                (input, whole_operand(weight, "F.layer_norm"), whole_operand(bias, "F.layer_norm")),
                out=graph_spec_of(input))


def _softmax(func: Callable) -> Callable:
    def rule(input, dim=None, *args, **kwargs):
        _features_only(op_name(func), input, [input.ndim - 1 if dim is None else dim])
        return adopt(func(unwrap(input), dim, *args, **kwargs), graph_spec_of(input))
    return rule


def _along_features(func: Callable) -> Callable:
    """An op reducing or mixing along ``dim`` (a vector norm, a min over features): local when ``dim`` is not the item
    dim; over the items it is refused (a whole-graph reduction has ``sum``/``mean``/``amax``/``prod``, ``max()``/``min()``)."""
    def rule(input, *args, **kwargs):
        dim = kwargs.get("dim", args[1] if func in _NORMS and len(args) > 1 else args[0] if args else None)
        dims = list(range(input.ndim)) if dim is None else [dim] if isinstance(dim, int) else list(dim)
        _features_only(op_name(func), input, dims)
        keepdim = kwargs.get("keepdim", False)
        spec = graph_spec_of(input)
        shift = 0 if keepdim else sum(d % input.ndim < spec.dim for d in dims)
        out = func(unwrap(input), *args, **kwargs)
        return adopt(out, spec.replaced(dim=spec.dim - shift, endpoint=None)) if isinstance(out, torch.Tensor) else out
    return rule


_NORMS = (torch.norm, torch.Tensor.norm, torch.linalg.vector_norm, torch.linalg.norm)


def _dropout(input, p=0.5, training=True, inplace=False):
    """The mask one process draws for the whole tensor, this rank's items of it (random_ops.py: the domain's ranks
    share one stream after ``dm.manual_seed``, so every rank draws the same numbers in the same order)."""
    if not training or p == 0:
        return input
    spec, local = graph_spec_of(input), unwrap(input)
    mask = dropout_mask(F.dropout, size_of(input), local, p)
    own = torch.from_numpy(spec.items.items(spec.comm.index)).to(device=mask.device, dtype=torch.long)
    mask = mask.index_select(spec.dim, own)
    if inplace:
        local.mul_(mask)
        return input
    return adopt(local * mask, spec)


# ----------------------------------------------------------------------------- views and reshapes
def _shape_args(shape: tuple) -> list[int]:
    return list(shape[0]) if len(shape) == 1 and isinstance(shape[0], (list, tuple, torch.Size)) else list(shape)


def _item_dim_after(whole: list[int], d: int, target: list[int]) -> int | None:
    """Where the item dim ``d`` of a tensor of shape ``whole`` lands in ``target`` when the reshape keeps it whole and
    apart (the dims before it and the dims after it regrouped among themselves); None when it does not."""
    before, after = math.prod(whole[:d]), math.prod(whole[d + 1:])
    for k, size in enumerate(target):
        if size == whole[d] and math.prod(target[:k]) == before and math.prod(target[k + 1:]) == after:
            return k
    return None


def reshape_rule(view: bool) -> Callable:
    name = "torch.Tensor.view" if view else "torch.reshape"

    def rule(input, *shape):
        spec, local = graph_spec_of(input), unwrap(input)
        whole, target, d = list(size_of(input)), _shape_args(shape), graph_spec_of(input).dim
        if target.count(-1) == 1:
            known = math.prod(t for t in target if t != -1)
            target[target.index(-1)] = math.prod(whole) // known if known else 0
        # NOTE: (A, n, B) -> (A', n, B') with prod(A) == prod(A'), prod(B) == prod(B') maps each item's elements as
        # the local (A, n_r, B) -> (A', n_r, B') does: a (1, E) row of the edge list .view(-1), (E,) .view(1, -1)
        k = _item_dim_after(whole, d, target)
        if k is not None:
            target[k] = local.shape[d]
            return adopt(local.view(target) if view else local.reshape(target), spec.replaced(dim=k))
        raise NotImplementedError(f"{name}{tuple(_shape_args(shape))} of a graph tensor of shape {tuple(whole)} (items "
                                  f"along dim {d}): only reshapes that keep the item dim whole and apart (regrouping "
                                  "the dims before it and those after it) are supported; call .full_tensor() first")
    return rule


def _expand(input, *sizes):
    spec, local = graph_spec_of(input), unwrap(input)
    target = _shape_args(sizes)
    d = spec.dim + len(target) - input.ndim
    if target[d] not in (-1, spec.items.n):
        raise NotImplementedError(f"torch.Tensor.expand{tuple(target)} of a graph tensor along its item dim {spec.dim}")
    target[d] = local.shape[spec.dim]
    return adopt(local.expand(target), spec.replaced(dim=d))


def _expand_as(input, other):
    if not is_graph(input):  # a replicated or plain value (a global feature) broadcast over the items of ``other``
        ospec = graph_spec_of(other)
        d = ospec.dim + input.ndim - other.ndim
        if d >= 0 and size_of(input)[d] not in (1, ospec.items.n):
            raise NotImplementedError(f"torch.Tensor.expand_as of a tensor of shape {tuple(size_of(input))} onto a "
                                      f"graph tensor of shape {tuple(size_of(other))}: only a length-1 (or absent) "
                                      "item dim, or one row per item, broadcasts over the items")
        rows = rows_for(input, d, ospec, "torch.Tensor.expand_as")
        return adopt(rows.expand(unwrap(other).shape), ospec.replaced(endpoint=None))
    spec = graph_spec_of(input)
    if is_graph(other):
        if graph_spec_of(other).items != spec.items:
            raise ValueError("torch.Tensor.expand_as onto a graph tensor laid out otherwise")
        return adopt(unwrap(input).expand_as(unwrap(other)), spec.replaced(dim=graph_spec_of(other).dim))
    return _expand(input, *other.shape)


def _unsqueeze(input, dim):
    spec = graph_spec_of(input)
    d = dim % (input.ndim + 1)
    return adopt(unwrap(input).unsqueeze(d), spec.replaced(dim=spec.dim + (d <= spec.dim)))


def _squeeze(input, dim=None):
    spec = graph_spec_of(input)
    whole = size_of(input)
    if dim is None:  # every dim of global length 1; the item dim only if the graph has one item
        if whole[spec.dim] == 1:
            raise NotImplementedError("torch.squeeze() of a graph tensor of one item would drop its item dim (the rank "
                                      "holding the item and the others would disagree): name the dims to squeeze")
        dim = [d for d in range(input.ndim) if whole[d] == 1]
    dims = [d % input.ndim for d in (dim if isinstance(dim, (list, tuple)) else [dim])]
    _features_only("torch.squeeze", input, dims)
    dims = [d for d in dims if whole[d] == 1]
    return adopt(unwrap(input).squeeze(tuple(dims)), spec.replaced(dim=spec.dim - sum(d < spec.dim for d in dims)))


def _flatten(input, start_dim=0, end_dim=-1):
    spec = graph_spec_of(input)
    s, e = start_dim % input.ndim, end_dim % input.ndim
    whole = size_of(input)
    if s <= spec.dim <= e and s != e:
        if any(whole[k] != 1 for k in range(s, e + 1) if k != spec.dim):
            raise NotImplementedError(f"torch.flatten({s}, {e}) of a graph tensor would merge its item dim {spec.dim} "
                                      "with others: flatten only the feature dims")
        # the other dims are of length 1: the items stay apart (a (1, E) row of the edge list flattened)
        return adopt(torch.flatten(unwrap(input), s, e), spec.replaced(dim=s))
    return adopt(torch.flatten(unwrap(input), s, e), spec.replaced(dim=spec.dim - (max(e - s, 0) if spec.dim > e else 0)))


# NOTE: every rule here but dropout's (a draw) lays its results out from metadata alone: kept on one rank
for _f in ELEMENTWISE:
    if _f is not torch.where:  # NOTE: where(condition) alone is nonzero: counting.py's rule, which calls this one
        GRAPH_RULES.register(_f, layout_rule()(elementwise_rule(_f)))
GRAPH_RULES.register(F.dropout, _dropout)
for _funcs, _rule in (
    ((F.layer_norm,), _layer_norm),
    ((torch.Tensor.view,), reshape_rule(True)), ((torch.reshape, torch.Tensor.reshape), reshape_rule(False)),
    ((torch.Tensor.expand,), _expand), ((torch.Tensor.expand_as,), _expand_as),
    ((torch.unsqueeze, torch.Tensor.unsqueeze), _unsqueeze), ((torch.squeeze, torch.Tensor.squeeze), _squeeze),
    ((torch.flatten, torch.Tensor.flatten), _flatten),
):
    for _f in _funcs:
        GRAPH_RULES.register(_f, layout_rule()(_rule))


def _local_along_features(op: str, x: DomainTensor, dims: list) -> GraphSpec:
    _features_only(op, x, dims)
    return graph_spec_of(x).replaced(endpoint=None)  # NOTE: a Linear's output holds no node ids


_GRID = LocalGrid(graph_spec_of, _local_along_features, lambda spec, new: spec.replaced(dim=new(spec.dim)),
                  "a graph tensor")
_LOCAL_RULES = local_rules(_GRID)
for _f in (torch.transpose, torch.Tensor.transpose, torch.swapaxes, torch.Tensor.swapaxes, torch.permute,
           torch.Tensor.permute, torch.Tensor.view_as, F.linear):  # NOTE: chunk, split, unbind: graph/pieces.py's
    GRAPH_RULES.register(_f, layout_rule()(_LOCAL_RULES[_f]))
for _f in (F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, torch.Tensor.softmax, torch.Tensor.log_softmax):
    GRAPH_RULES.register(_f, layout_rule()(_softmax(_f)))
# NOTE: amax is graph/reduce.py's (over the items too, through reduction_rules); amin stays along the features.
for _f in (*_NORMS, torch.amin, torch.Tensor.amin):
    GRAPH_RULES.register(_f, layout_rule()(_along_features(_f)))
