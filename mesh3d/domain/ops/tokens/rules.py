"""Op rules for token grids (``mesh3d.domain.layouts.tokens``): what a ViT does between its patch embedding and its head.

Usage (through torch)::

    t = e.flatten(2).transpose(1, 2) + pos     # pos: (1, N, C), indexed by each rank's global token indices
    q = q_proj(norm(t)).view(b, -1, heads, hd).transpose(1, 2)
    t = t + out_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, -1, c))
    g = t.transpose(1, 2).reshape(b, c, h, w)  # back to blocks (h, w from e.shape: the global grid)
    logits = head(t.mean(1))                   # replicated

Position-free ops run on the local tokens; ops that read positions use the spec's global token order.
An op without a rule here raises naming it (``registry.TOKEN_RULES``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from mesh3d.domain.ops.blocks.norms import CHANNEL_NORMS
from mesh3d.domain.ops.blocks.rules import local_reduction, reduction_rules, run_elementwise
from mesh3d.domain.ops.grid_local import LocalGrid, local_rules
from mesh3d.domain.ops.grid_reshape import localized, place_run, shape_rules
from mesh3d.domain.ops import pointwise
from mesh3d.domain.ops.pointwise import ELEMENTWISE
from mesh3d.domain.dispatch.kept_steps import metadata_rule
from mesh3d.domain.dispatch.step import AllTokens, Combining, Entering, Step, whole_operand
from mesh3d.domain.ops.reduce import global_softmax, total_step
from mesh3d.domain.dispatch.registry import TOKEN_RULES, op_name
from mesh3d.domain.core.connected import connected_zeros
from mesh3d.domain.core.specs import Layout, sharded_dims
from mesh3d.domain.core.tensor import DomainTensor, local_shape, size_of
from mesh3d.domain.core.specs import TokenSpec
from mesh3d.domain.layouts.tokens import blocks_spec
from mesh3d.domain.layouts.tokens import slab_as_tokens, token_rows

__all__ = ["elementwise_rule"]


def _spec(x: DomainTensor, scores: bool = False) -> TokenSpec:
    """``x``'s token spec; attention scores (every key along one dim) only where the rule says it handles them."""
    spec = x._spec
    assert isinstance(spec, TokenSpec)
    if spec.keys is not None and not scores:
        raise NotImplementedError(
            "this op on attention scores of a token grid (q @ k.transpose(-1, -2): every key along dim "
            f"{spec.keys_dim}, in the order they were gathered) is not supported: element-wise ops, softmax over the "
            "keys, transpose and the product with the values are; or use F.scaled_dot_product_attention")
    return spec


def _is_grid(t) -> bool:
    return isinstance(t, DomainTensor) and isinstance(t._spec, TokenSpec)


# ----------------------------------------------------------------------------- element-wise
def elementwise_rule(func: Callable) -> Callable:
    def rule(*args, **kwargs):
        pointwise.refuse_other_forms(func, args, kwargs)
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        grids = [t for t in tensors if isinstance(t, DomainTensor) and _is_grid(t)]
        ref = grids[0]
        spec = _spec(ref, scores=True)
        if any(t.ndim != ref.ndim or t._spec != spec for t in grids):
            raise ValueError(f"{op_name(func)}: token grids laid out differently ({[t._spec for t in grids]}); "
                             "combine tensors flattened from the same blocks")

        def local(o):
            if not isinstance(o, torch.Tensor) or _is_grid(o):
                return o  # NOTE: the call's own tensor, which the executor unwraps: a kept step binds the next call's
            if isinstance(o, DomainTensor) and o._spec.layout is Layout.SLAB and o.ndim == ref.ndim \
                    and o._spec.dim == spec.token_dim and spec.keys is None and o._spec.comm == spec.comm:
                return slab_as_tokens(o, spec)  # a Swin's window output (its windows ran on slabs) meets its shortcut
            if isinstance(o, DomainTensor) and sharded_dims(o._spec):
                raise ValueError(f"{op_name(func)}: a token grid meets a tensor sharded otherwise ({o._spec}); "
                                 "reshape the tokens back to the grid, or flatten the other one too")
            rows = token_rows(o, spec.token_dim - (ref.ndim - o.ndim), spec, op_name(func))
            if spec.keys is None:
                return rows
            keys_at = spec.keys_dim - (ref.ndim - o.ndim)  # scores: a (.., N, N_keys) bias follows the keys' order
            if keys_at < 0 or rows.shape[keys_at] == 1:
                return rows
            return token_rows(rows, keys_at, spec.keys, op_name(func), gathered=True)

        return run_elementwise(func, args, kwargs, local, ref, "a token grid")
    return rule


def _matmul(input, other, *, out=None):
    """``q @ k.transpose(-1, -2)`` (scores against every key, gathered) and ``scores @ v`` (the values gathered in the
    same order); a token grid times a plain or replicated matrix is local."""
    if out is not None:
        raise NotImplementedError("torch.matmul(out=) on a token grid")
    if not _is_grid(input):
        raise NotImplementedError("torch.matmul of a plain matrix by a token grid: transpose the product")
    spec = _spec(input, scores=True)
    nd = max(input.ndim, other.ndim)
    if not _is_grid(other):  # weights: the token rows stay
        if spec.token_dim == input.ndim - 1 or spec.keys is not None and spec.keys_dim == input.ndim - 1:
            raise NotImplementedError("torch.matmul contracting the tokens of a token grid with a plain tensor: the "
                                      "sum runs over every rank's tokens; call .full_tensor() first")
        if isinstance(other, DomainTensor) and sharded_dims(other._spec):
            raise ValueError("torch.matmul: a token grid meets a tensor sharded otherwise; gather that one first")
        return Step(torch.matmul, (input, Entering(other) if isinstance(other, DomainTensor) else other),
                    out=spec.moved(lambda d: d + nd - input.ndim))
    right = _spec(other, scores=True)
    if spec.keys is None and spec.token_dim == input.ndim - 2 and right.keys is None and right.token_dim == other.ndim - 1:
        # scores: every key, in domain rank order
        return Step(torch.matmul, (input, AllTokens(other)),
                    out=spec.with_keys(right, None).with_token_dim(nd - 2, nd - 1))
    if spec.keys is not None and spec.keys_dim == input.ndim - 1 and right.keys is None \
            and right.token_dim == other.ndim - 2 and replace(right, token_dim=0) == spec.keys:
        # the values in the same order as the scores' keys
        return Step(torch.matmul, (input, AllTokens(other)), out=spec.with_keys(None, None).with_token_dim(nd - 2))
    raise NotImplementedError("torch.matmul of two token grids: supported are q @ k.transpose(-1, -2) (queries' "
                              "tokens at dim -2, keys' at -1) and scores @ v with v the tokens the keys came from")


# ----------------------------------------------------------------------------- dims and shapes
def _local_unless_tokens(op: str, x: DomainTensor, dims) -> TokenSpec:
    spec = _spec(x)
    if spec.token_dim in {d % x.ndim for d in dims}:
        raise NotImplementedError(f"{op} acts along the token dim {spec.token_dim} of a token grid; this needs every "
                                  "token: call .full_tensor() first (attention has its own rule)")
    return spec


def reshape_tokens(x: DomainTensor, target: list[int], op: str, view: bool) -> Step:
    """``x`` reshaped keeping its token dim, or with the tokens split back into this rank's block; else a refusal.

    Usage: ``g = run_step(reshape_tokens(t, [b, c, h, w], "torch.reshape", view=False))  # blocks again``
    """
    spec = _spec(x)
    shape, whole, d = list(local_shape(x)), list(size_of(x)), spec.token_dim  # NOTE: no alias made to read it
    grid = spec.local_grid
    placed = localized(place_run(target, whole, d, d, list(spec.grid_shape)), list(grid)) \
        if len(grid) > 1 and not spec.prefix else None
    if placed is not None:
        at, full = placed
        merged = [*full[:at], math.prod(grid), *full[at + len(grid):]]
        return Step((lambda t: t.view(merged).unflatten(at, grid)) if view else
                    (lambda t: t.reshape(merged).unflatten(at, grid)), (x,), out=blocks_spec(spec.with_token_dim(at)))
    placed = localized(place_run(target, whole, d, d, [whole[d]]), [shape[d]])
    if placed is not None:
        at, full = placed
        return Step((lambda t: t.view(full)) if view else (lambda t: t.reshape(full)), (x,), out=spec.with_token_dim(at))
    raise NotImplementedError(
        f"{op}{tuple(target)} of a token grid of shape {tuple(whole)} (tokens along dim {d}, this rank's "
        f"block {tuple(grid)}{f', {spec.prefix} prefix tokens' if spec.prefix else ''}) would mix tokens with other "
        "dims. Keep the token dim (split and merge the others), or split it into this rank's block, "
        "reshape(b, c, h, w) with h, w from the patch embedding's .shape (drop prefix tokens first: t[:, 1:]); "
        "call .full_tensor() otherwise")


def _pointwise_conv1d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """A 1x1 ``conv1d`` over the tokens (channel mixing, as neural operators write it): each token on its own."""
    spec = _spec(input)
    if spec.token_dim != input.ndim - 1 or weight.shape[-1] != 1 or stride not in (1, (1,)) \
            or padding not in (0, (0,), "valid", "same"):
        raise NotImplementedError("F.conv1d on a token grid: only kernel size 1, stride 1, no padding (channel "
                                  "mixing per token) is supported; reshape the tokens back to the grid for a "
                                  "spatial convolution")
    return Step(functools.partial(_conv1d_tokens, groups=groups), (input, whole_operand(weight, "F.conv1d"),
                                                                  whole_operand(bias, "F.conv1d")), out=spec)


def _conv1d_tokens(t: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, groups: int) -> torch.Tensor:
    if t.shape[-1] == 0:  # NOTE: an empty block's tokens: torch's conv1d refuses a length-0 input
        return connected_zeros(t, [*t.shape[:-2], w.shape[0], 0], t, w, b)
    return F.conv1d(t, w, b, 1, 0, 1, groups)


def _layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    dims = range(input.ndim - len(normalized_shape), input.ndim)
    spec = _local_unless_tokens("torch.nn.functional.layer_norm", input, dims)
    return Step(lambda t, w, b: F.layer_norm(t, normalized_shape, w, b, eps),
                (input, whole_operand(weight, "F.layer_norm"), whole_operand(bias, "F.layer_norm")), out=spec)


def _softmax(func):
    def rule(input, dim=None, *args, **kwargs):
        spec = _spec(input, scores=True)  # over the scores' keys: they are all here
        if spec.token_dim == dim % input.ndim:  # over every rank's tokens: the global max and sum (as on slabs)
            if args or kwargs.get("dtype") is not None:
                raise NotImplementedError(f"{op_name(func)} over the token dim with a dtype: cast first")
            log, d, comm = "log_softmax" in op_name(func), spec.token_dim, spec.comm
            return Step(lambda t, combine: global_softmax(t, d, combine, log), (input, Combining(comm)), out=spec)
        return Step(lambda t: func(t, dim, *args, **kwargs), (input,), out=spec)
    return rule


# ----------------------------------------------------------------------------- reductions and losses
def _reduce(x: DomainTensor, kind: str, dim=None, keepdim: bool = False):
    spec = _spec(x)
    dims = list(range(x.ndim)) if dim is None or dim == [] or dim == () else sorted(
        d % x.ndim for d in ([dim] if isinstance(dim, int) else dim))
    if spec.token_dim not in dims:  # every rank reduces its own tokens
        shift, whole = 0 if keepdim else sum(d < spec.token_dim for d in dims), dim is None
        return Step(lambda t: local_reduction(t, kind, dims, keepdim, whole), (x,),
                    out=spec.with_token_dim(spec.token_dim - shift))
    return total_step(x, kind, dim, dims, keepdim, spec.comm, full_kernel=False)  # the parts combined by the executor


def _adaptive_avg_pool1d(input, output_size):
    """A pooler over the tokens (Hugging Face Swin's ``AdaptiveAvgPool1d(1)`` on (B, C, N)): their mean; over another
    dim, local. Other output sizes along the tokens would pool runs of the global token order: refused."""
    spec = _spec(input)
    size = output_size[0] if isinstance(output_size, (tuple, list)) else output_size
    if spec.token_dim != input.ndim - 1:
        def pooled(t: torch.Tensor) -> torch.Tensor:
            if t.numel() == 0:  # NOTE: torch's backward refuses an empty batch-like dim (an empty block's tokens)
                return connected_zeros(t, [*t.shape[:-1], size], t)
            return F.adaptive_avg_pool1d(t, output_size)
        return Step(pooled, (input,), out=spec)
    if size != 1:
        raise NotImplementedError(
            f"torch.adaptive_avg_pool1d to {size} outputs along the tokens of a token grid: each output would pool a "
            "run of the global token order; pool to 1 (the mean of every token), or call .full_tensor() first")
    return _reduce(input, "mean", -1, keepdim=True)


for _f in ELEMENTWISE:
    TOKEN_RULES.register(_f, elementwise_rule(_f))
for _f, _rule in local_rules(LocalGrid(lambda x: _spec(x, scores=True), _local_unless_tokens,
                                        lambda spec, new: spec.moved(new), "a token grid")).items():
    TOKEN_RULES.register(_f, _rule)
for _funcs, _rule in (
    ((torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__), _matmul),
    ((F.layer_norm,), _layer_norm),
    ((F.conv1d,), _pointwise_conv1d),
    ((F.adaptive_avg_pool1d, torch.adaptive_avg_pool1d), _adaptive_avg_pool1d),
):
    for _f in _funcs:
        TOKEN_RULES.register(_f, _rule)
for _f in (F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, torch.Tensor.softmax, torch.Tensor.log_softmax):
    TOKEN_RULES.register(_f, _softmax(_f))
for _f, _rule in reduction_rules(_reduce, "a token grid").items():
    TOKEN_RULES.register(_f, _rule)
for _f, _rule in shape_rules(reshape_tokens).items():
    TOKEN_RULES.register(_f, metadata_rule()(_rule))
for _f, _rule in CHANNEL_NORMS.items():
    TOKEN_RULES.register(_f, _rule)
