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

import math
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from mesh3d._torch_private import linear_not_a_view
from mesh3d.domain.ops.blocks.norms import CHANNEL_NORMS
from mesh3d.domain.ops.blocks.rules import local_reduction, reduction_rules, run_elementwise
from mesh3d.domain.ops.grid_reshape import localized, place_run, shape_rules
from mesh3d.domain.ops import pointwise
from mesh3d.domain.ops.pointwise import ELEMENTWISE
from mesh3d.domain.dispatch.step import AllTokens, Combining, Entering, Step
from mesh3d.domain.ops.reduce import global_softmax, total_step
from mesh3d.domain.dispatch.registry import TOKEN_RULES, op_name
from mesh3d.domain.core.connected import connected_zeros
from mesh3d.domain.core.specs import Layout, sharded_dims
from mesh3d.domain.core.tensor import DomainTensor, adopt, size_of, unwrap
from mesh3d.domain.core.specs import TokenSpec
from mesh3d.domain.layouts.tokens import tokens_to_blocks
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
                return unwrap(o)
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


def _view_as(input, other):
    # NOTE: FSDP2 calls ``x.view_as(x)`` on every forward input: exact on an identically laid out grid.
    if _is_grid(input) and _is_grid(other) and input._spec == other._spec and size_of(input) == size_of(other):
        return adopt(unwrap(input).view_as(unwrap(other)), input._spec)
    raise NotImplementedError("torch.Tensor.view_as on a token grid: only onto an identically laid out token grid "
                              "of the same shape; call .full_tensor() first")


# ----------------------------------------------------------------------------- dims and shapes
def _local_unless_tokens(op: str, x: DomainTensor, dims) -> TokenSpec:
    spec = _spec(x)
    if spec.token_dim in {d % x.ndim for d in dims}:
        raise NotImplementedError(f"{op} acts along the token dim {spec.token_dim} of a token grid; this needs every "
                                  "token: call .full_tensor() first (attention has its own rule)")
    return spec


def _transpose(input, dim0, dim1):
    d0, d1 = dim0 % input.ndim, dim1 % input.ndim
    swap = {d0: d1, d1: d0}
    return adopt(torch.transpose(unwrap(input), d0, d1), _spec(input, scores=True).moved(lambda d: swap.get(d, d)))


def _permute(input, *dims):
    order = tuple(d % input.ndim for d in (dims[0] if len(dims) == 1 and isinstance(dims[0], (list, tuple)) else dims))
    return adopt(unwrap(input).permute(order), _spec(input, scores=True).moved(order.index))


def reshape_tokens(x: DomainTensor, target: list[int], op: str, view: bool) -> DomainTensor:
    """``x`` reshaped keeping its token dim, or with the tokens split back into this rank's block; else a refusal.

    Usage: ``g = reshape_tokens(t, [b, c, h, w], "torch.reshape", view=False)  # blocks again``
    """
    spec, local = _spec(x), unwrap(x)
    shape, whole, d = list(local.shape), list(size_of(x)), spec.token_dim
    reshape = local.view if view else local.reshape
    grid = list(spec.local_grid)
    placed = localized(place_run(target, whole, d, d, list(spec.grid_shape)), grid) \
        if len(grid) > 1 and not spec.prefix else None
    if placed is not None:
        at, full = placed
        blocks, bspec = tokens_to_blocks(reshape([*full[:at], math.prod(grid), *full[at + len(grid):]]),
                                         spec.with_token_dim(at))
        return adopt(blocks, bspec)
    placed = localized(place_run(target, whole, d, d, [whole[d]]), [shape[d]])
    if placed is not None:
        at, full = placed
        return adopt(reshape(full), spec.with_token_dim(at))
    raise NotImplementedError(
        f"{op}{tuple(target)} of a token grid of shape {tuple(whole)} (tokens along dim {d}, this rank's "
        f"block {tuple(grid)}{f', {spec.prefix} prefix tokens' if spec.prefix else ''}) would mix tokens with other "
        "dims. Keep the token dim (split and merge the others), or split it into this rank's block, "
        "reshape(b, c, h, w) with h, w from the patch embedding's .shape (drop prefix tokens first: t[:, 1:]); "
        "call .full_tensor() otherwise")


def _unbind(input, dim=0):
    spec = _local_unless_tokens("torch.unbind", input, [dim])
    d = dim % input.ndim
    out_spec = spec.with_token_dim(spec.token_dim - (d < spec.token_dim))
    return tuple(adopt(t, out_spec) for t in torch.unbind(unwrap(input), d))


def _splitter(func: Callable, name: str) -> Callable:
    def rule(input, split_size_or_sections, dim=0):
        spec = _local_unless_tokens(name, input, [dim])
        return tuple(adopt(t, spec) for t in func(unwrap(input), split_size_or_sections, dim))
    return rule


def _linear(input, weight, bias=None):
    spec = _local_unless_tokens("torch.nn.functional.linear", input, [-1])  # NOTE: checked before the local product
    return adopt(linear_not_a_view(unwrap(input), weight, bias), spec)


def _pointwise_conv1d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """A 1x1 ``conv1d`` over the tokens (channel mixing, as neural operators write it): each token on its own."""
    spec = _spec(input)
    if spec.token_dim != input.ndim - 1 or weight.shape[-1] != 1 or stride not in (1, (1,)) \
            or padding not in (0, (0,), "valid", "same"):
        raise NotImplementedError("F.conv1d on a token grid: only kernel size 1, stride 1, no padding (channel "
                                  "mixing per token) is supported; reshape the tokens back to the grid for a "
                                  "spatial convolution")
    return adopt(F.conv1d(unwrap(input), weight, bias, 1, 0, 1, groups), spec)


def _layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    dims = range(input.ndim - len(normalized_shape), input.ndim)
    spec = _local_unless_tokens("torch.nn.functional.layer_norm", input, dims)
    return adopt(F.layer_norm(unwrap(input), normalized_shape, weight, bias, eps), spec)


def _softmax(func):
    def rule(input, dim=None, *args, **kwargs):
        spec = _spec(input, scores=True)  # over the scores' keys: they are all here
        if spec.token_dim == dim % input.ndim:  # over every rank's tokens: the global max and sum (as on slabs)
            if args or kwargs.get("dtype") is not None:
                raise NotImplementedError(f"{op_name(func)} over the token dim with a dtype: cast first")
            log, d, comm = "log_softmax" in op_name(func), spec.token_dim, spec.comm
            return Step(lambda t, combine: global_softmax(t, d, combine, log), (input, Combining(comm)), out=spec)
        return adopt(func(unwrap(input), dim, *args, **kwargs), spec)
    return rule


# ----------------------------------------------------------------------------- reductions and losses
def _reduce(x: DomainTensor, kind: str, dim=None, keepdim: bool = False):
    spec, local = _spec(x), unwrap(x)
    dims = list(range(x.ndim)) if dim is None or dim == [] or dim == () else sorted(
        d % x.ndim for d in ([dim] if isinstance(dim, int) else dim))
    if spec.token_dim not in dims:  # every rank reduces its own tokens
        shift = 0 if keepdim else sum(d < spec.token_dim for d in dims)
        return adopt(local_reduction(local, kind, dims, keepdim, dim is None), spec.with_token_dim(spec.token_dim - shift))
    return total_step(x, kind, dim, dims, keepdim, spec.comm, full_kernel=False)  # the parts combined by the executor


def _adaptive_avg_pool1d(input, output_size):
    """A pooler over the tokens (Hugging Face Swin's ``AdaptiveAvgPool1d(1)`` on (B, C, N)): their mean; over another
    dim, local. Other output sizes along the tokens would pool runs of the global token order: refused."""
    spec, local = _spec(input), unwrap(input)
    size = output_size[0] if isinstance(output_size, (tuple, list)) else output_size
    if spec.token_dim != input.ndim - 1:
        if local.numel() == 0:  # NOTE: torch's backward refuses an empty batch-like dim (an empty block's tokens)
            return adopt(connected_zeros(local, [*local.shape[:-1], size], local), spec)
        return adopt(F.adaptive_avg_pool1d(local, output_size), spec)
    if size != 1:
        raise NotImplementedError(
            f"torch.adaptive_avg_pool1d to {size} outputs along the tokens of a token grid: each output would pool a "
            "run of the global token order; pool to 1 (the mean of every token), or call .full_tensor() first")
    return _reduce(input, "mean", -1, keepdim=True)


for _f in ELEMENTWISE:
    TOKEN_RULES.register(_f, elementwise_rule(_f))
for _funcs, _rule in (
    ((torch.Tensor.view_as,), _view_as),
    ((torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__), _matmul),
    ((torch.transpose, torch.Tensor.transpose, torch.swapaxes, torch.Tensor.swapaxes), _transpose),
    ((torch.permute, torch.Tensor.permute), _permute),
    ((torch.unbind, torch.Tensor.unbind), _unbind),
    ((torch.chunk, torch.Tensor.chunk), _splitter(torch.chunk, "torch.chunk")),
    ((torch.split, torch.Tensor.split), _splitter(torch.split, "torch.split")),
    ((F.linear,), _linear),
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
    TOKEN_RULES.register(_f, _rule)
for _f, _rule in CHANNEL_NORMS.items():
    TOKEN_RULES.register(_f, _rule)
