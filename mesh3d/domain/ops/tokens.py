"""Op rules for token grids (``mesh3d.domain.tokens``): what a ViT does between its patch embedding and its head.

Usage (through torch)::

    t = e.flatten(2).transpose(1, 2) + pos     # pos: (1, N, C), indexed by each rank's global token indices
    q = q_proj(norm(t)).view(b, -1, heads, hd).transpose(1, 2)
    t = t + out_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, -1, c))
    g = t.transpose(1, 2).reshape(b, c, h, w)  # back to blocks (h, w from e.shape: this rank's block)
    logits = head(t.mean(1))                   # replicated

Position-free ops run on the local tokens; ops that read positions use the spec's global token order.
An op without a rule here raises naming it (``registry.TOKEN_RULES``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mesh3d.domain.collectives import reduce_to_replicated, sum_grad
from mesh3d.domain.ops.blocks import reduction_rules, run_elementwise
from mesh3d.domain.ops.blocks_layout import _dropout
from mesh3d.domain.ops.grid_reshape import find_run, resolve_target, shape_rules
from mesh3d.domain.ops.pointwise import ELEMENTWISE
from mesh3d.domain.registry import TOKEN_RULES, op_name
from mesh3d.domain.tensor import DomainSpec, DomainTensor, adopt, unwrap
from mesh3d.domain.tokens import TokenSpec, tokens_to_blocks

__all__: list[str] = []


def _spec(x: DomainTensor) -> TokenSpec:
    spec = x._spec
    assert isinstance(spec, TokenSpec)
    return spec


def _is_grid(t) -> bool:
    return isinstance(t, DomainTensor) and isinstance(t._spec, TokenSpec)


def token_rows(o: torch.Tensor, dim: int, spec: TokenSpec, op: str) -> torch.Tensor:
    """This rank's rows of ``o`` along ``dim``: ``o`` as is when its size there is 1, its rows at this rank's global
    token indices when it has one per token (a position embedding); a replicated value's gradient is summed.

    Usage: ``pos = token_rows(pos_embedding, 1, t.spec, "torch.add")``
    """
    plain = sum_grad(unwrap(o), spec.comm) if isinstance(o, DomainTensor) and o.requires_grad else unwrap(o)
    if dim < 0 or plain.shape[dim] == 1:
        return plain
    if plain.shape[dim] == spec.global_tokens:
        return plain.index_select(dim, spec.global_index.to(plain.device))
    raise ValueError(f"{op}: a tensor of shape {tuple(plain.shape)} meets a token grid of {spec.global_tokens} tokens "
                     f"along dim {dim}; give it {spec.global_tokens} rows there (one per token, in global order) or 1")


# ----------------------------------------------------------------------------- element-wise
def _elementwise(func: Callable) -> Callable:
    def rule(*args, **kwargs):
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        grids = [t for t in tensors if isinstance(t, DomainTensor) and _is_grid(t)]
        ref = grids[0]
        spec = _spec(ref)
        if any(t.ndim != ref.ndim or t._spec != spec for t in grids):
            raise ValueError(f"{op_name(func)}: token grids laid out differently ({[t._spec for t in grids]}); "
                             "combine tensors flattened from the same blocks")

        def local(o):
            if not isinstance(o, torch.Tensor) or _is_grid(o):
                return unwrap(o)
            if isinstance(o, DomainTensor) and (hasattr(o._spec, "dims") or o._spec.dim is not None):
                raise ValueError(f"{op_name(func)}: a token grid meets a tensor sharded otherwise ({o._spec}); "
                                 "reshape the tokens back to the grid, or flatten the other one too")
            return token_rows(o, spec.token_dim - (ref.ndim - o.ndim), spec, op_name(func))

        return run_elementwise(func, args, kwargs, local, ref, "a token grid")
    return rule


def _view_as(input, other):
    # NOTE: FSDP2 calls ``x.view_as(x)`` on every forward input: exact on an identically laid out grid.
    if _is_grid(input) and _is_grid(other) and input._spec == other._spec and input.shape == other.shape:
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
    spec = _spec(input)
    d0, d1 = dim0 % input.ndim, dim1 % input.ndim
    new = {d0: d1, d1: d0}.get(spec.token_dim, spec.token_dim)
    return adopt(torch.transpose(unwrap(input), d0, d1), spec.with_token_dim(new))


def _permute(input, *dims):
    order = tuple(d % input.ndim for d in (dims[0] if len(dims) == 1 and isinstance(dims[0], (list, tuple)) else dims))
    return adopt(unwrap(input).permute(order), _spec(input).with_token_dim(order.index(_spec(input).token_dim)))


def reshape_tokens(x: DomainTensor, target: list[int], op: str, view: bool) -> DomainTensor:
    """``x`` reshaped keeping its token dim, or with the tokens split back into this rank's block; else a refusal.

    Usage: ``g = reshape_tokens(t, [b, c, h, w], "torch.reshape", view=False)  # blocks again``
    """
    spec, local = _spec(x), unwrap(x)
    shape, d = list(local.shape), spec.token_dim
    target = resolve_target(target, local.numel())
    reshape = local.view if view else local.reshape
    grid = list(spec.local_grid)
    at = find_run(target, shape, d, d, grid) if len(grid) > 1 and not spec.prefix else None
    if at is not None:
        blocks, bspec = tokens_to_blocks(reshape([*target[:at], math.prod(grid), *target[at + len(grid):]]),
                                         spec.with_token_dim(at))
        return adopt(blocks, bspec)
    at = find_run(target, shape, d, d, [shape[d]])
    if at is not None:
        return adopt(reshape([shape[d] if k == -1 else k for k in target]), spec.with_token_dim(at))
    raise NotImplementedError(
        f"{op}{tuple(target)} of a token grid of local shape {tuple(shape)} (tokens along dim {d}, this rank's "
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
    return adopt(F.linear(unwrap(input), weight, bias), _local_unless_tokens("torch.nn.functional.linear", input, [-1]))


def _layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    dims = range(input.ndim - len(normalized_shape), input.ndim)
    spec = _local_unless_tokens("torch.nn.functional.layer_norm", input, dims)
    return adopt(F.layer_norm(unwrap(input), normalized_shape, weight, bias, eps), spec)


def _softmax(func):
    def rule(input, dim=None, *args, **kwargs):
        return adopt(func(unwrap(input), dim, *args, **kwargs), _local_unless_tokens("softmax", input, [dim]))
    return rule


# ----------------------------------------------------------------------------- reductions and losses
def _reduce(x: DomainTensor, kind: str, dim=None, keepdim: bool = False):
    spec, local = _spec(x), unwrap(x)
    dims = list(range(x.ndim)) if dim is None or dim == [] or dim == () else sorted(
        d % x.ndim for d in ([dim] if isinstance(dim, int) else dim))
    fn = torch.sum if kind == "sum" else torch.mean
    if spec.token_dim not in dims:  # every rank reduces its own tokens
        shift = 0 if keepdim else sum(d < spec.token_dim for d in dims)
        return adopt(fn(local, dims, keepdim=keepdim), spec.with_token_dim(spec.token_dim - shift))
    count = math.prod(x.global_shape[d] for d in dims)
    total = reduce_to_replicated(local.sum(dims, keepdim=keepdim), spec.comm)
    return adopt(total / count if kind == "mean" else total, DomainSpec(None, None, spec.comm))



for _f in ELEMENTWISE:
    TOKEN_RULES.register(_f, _elementwise(_f))
for _funcs, _rule in (
    ((torch.Tensor.view_as,), _view_as),
    ((torch.transpose, torch.Tensor.transpose, torch.swapaxes, torch.Tensor.swapaxes), _transpose),
    ((torch.permute, torch.Tensor.permute), _permute),
    ((torch.unbind, torch.Tensor.unbind), _unbind),
    ((torch.chunk, torch.Tensor.chunk), _splitter(torch.chunk, "torch.chunk")),
    ((torch.split, torch.Tensor.split), _splitter(torch.split, "torch.split")),
    ((F.linear,), _linear),
    ((F.layer_norm,), _layer_norm),
    ((F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout), _dropout),
):
    for _f in _funcs:
        TOKEN_RULES.register(_f, _rule)
for _f in (F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, torch.Tensor.softmax, torch.Tensor.log_softmax):
    TOKEN_RULES.register(_f, _softmax(_f))
for _f, _rule in reduction_rules(_reduce, "a token grid").items():
    TOKEN_RULES.register(_f, _rule)
for _f, _rule in shape_rules(reshape_tokens).items():
    TOKEN_RULES.register(_f, _rule)
