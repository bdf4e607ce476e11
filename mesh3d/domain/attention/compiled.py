"""Attention over a sharded sequence as one custom op pair, so a compiled graph carries it (no graph break).

Usage (inside the SDPA rule, while Dynamo traces; not called directly)::

    out = compiled_sharded_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

``mesh3d::sharded_sdpa`` runs the eager sharded attention (ring, gather or Ulysses, as ``domain.attention_mode``
says when the graph runs) on the shards, without autograd; ``mesh3d::sharded_sdpa_backward`` runs it again with
autograd and returns the gradients of the shards (and of a mask that needs one). Both are opaque to Dynamo and
Inductor and keep their program order (their exchanges pair up across ranks), like ``mesh3d::exchange_rows``.

NOTE: recomputing the forward in backward (as activation checkpointing does) is what lets one op carry every
mode: each mode's backward is its own autograd graph (the ring's travelling accumulators, the gather's reversed
exchange), which no op output could hold. It costs one more attention forward per step and saves no attention
intermediates for backward (the ring's output and log-sum-exp included).

The layouts (query, key, value and mask specs) and the call's options are interned under an int key the graph
holds as a constant (``exchange_op.COMMS`` does the same for comms): a custom op takes tensors and ints only.
"""

from __future__ import annotations

from typing import Any

import torch

from mesh3d._torch_private import autograd_inside_custom_op, constant_in_compiled_graphs, keep_in_program_order
from mesh3d.domain.attention.modes import sharded_attention
from mesh3d.domain.core.group import DomainComm
from mesh3d.domain.comm.compiled_exchange import COMMS
from mesh3d.domain.core.specs import BlockSpec
from mesh3d.domain.core.specs import DomainSpec
from mesh3d.domain.core.tensor import DomainTensor, unwrap, wrap
from mesh3d.domain.core.specs import TokenSpec

__all__ = ["compiled_sharded_attention", "takes"]


def takes(*tensors: Any) -> bool:
    """Whether the op carries these operands: slabs or token grids, not blocks (a mask: none, plain or a slab)."""
    return all(t is None or not isinstance(t, DomainTensor) or not isinstance(t._spec, BlockSpec) for t in tensors)


def _comm_fields(comm: DomainComm) -> tuple:
    return (comm.axis, comm.ranks, comm.index, comm.mesh_epoch)


def _spec_fields(t: Any) -> tuple | None:
    return _encoded(t._spec) if isinstance(t, DomainTensor) else None


def _encoded(spec: DomainSpec | TokenSpec | None) -> tuple | None:
    """``spec`` as nested tuples of ints and strings (what a constant-result call may take, torch 2.11 included)."""
    if spec is None:
        return None
    if isinstance(spec, TokenSpec):
        return ("tokens", spec.token_dim, spec.sizes, tuple(_comm_fields(c) for c in spec.lines),
                _comm_fields(spec.comm), spec.prefix, _encoded(spec.keys), spec.keys_dim)
    return ("slab", spec.dim, spec.sizes, spec.outer, _comm_fields(spec.comm))


def _spec(fields: tuple) -> DomainSpec | TokenSpec:
    if fields[0] == "tokens":
        _, token_dim, sizes, lines, comm, prefix, keys, keys_dim = fields
        return TokenSpec(token_dim, sizes, tuple(DomainComm(*c) for c in lines), DomainComm(*comm), prefix,
                         None if keys is None else _spec(keys), keys_dim)
    _, dim, sizes, outer, comm = fields
    return DomainSpec(dim, sizes, DomainComm(*comm), outer)


@constant_in_compiled_graphs
def _call_key(fields: tuple) -> int:
    """The key of this call's layouts and options, interned for real while Dynamo traces (see ``comm_key``)."""
    return COMMS.key(("sdpa", fields))


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, key: int) -> DomainTensor:
    _, (qf, kf, vf, mf, dropout_p, is_causal, scale, enable_gqa) = COMMS[key]
    attn_mask = mask if mask is None or mf is None else wrap(mask, _spec(mf))
    return sharded_attention(wrap(q, _spec(qf)), wrap(k, _spec(kf)), wrap(v, _spec(vf)), attn_mask, dropout_p,
                             is_causal, scale, enable_gqa)


def _fresh(outs: list[torch.Tensor], *inputs: torch.Tensor | None) -> list[torch.Tensor]:
    """``outs`` as plain tensors sharing no storage with ``inputs`` or each other (a custom op's outputs may not alias
    them: the ring's dK and dV, for one, are views of one accumulator)."""
    taken = {t.untyped_storage().data_ptr() for t in inputs if t is not None and t.numel()}
    fresh = []
    for out in outs:
        out = unwrap(out).contiguous()  # NOTE: as the fake kernels say (Inductor asserts the strides it was told)
        if not out.numel():  # an empty shard's views share their base's storage all the same
            out = torch.empty_like(out)
        elif out.untyped_storage().data_ptr() in taken:
            out = out.clone()
        taken.add(out.untyped_storage().data_ptr())
        fresh.append(out)
    return fresh


@torch.library.custom_op("mesh3d::sharded_sdpa", mutates_args=())
def _sharded_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  key: int) -> torch.Tensor:
    with torch.no_grad():
        return _fresh([_run(q, k, v, mask, key)], q, k, v, mask)[0]


@_sharded_sdpa.register_fake
def _(q, k, v, mask, key):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))  # contiguous, as _fresh makes the real one


@torch.library.custom_op("mesh3d::sharded_sdpa_backward", mutates_args=())
def _sharded_sdpa_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           mask: torch.Tensor | None, key: int, mask_grad: bool) -> list[torch.Tensor]:
    with torch.enable_grad(), autograd_inside_custom_op():
        ql, kl, vl = (t.detach().requires_grad_() for t in (q, k, v))
        m = mask.detach().requires_grad_() if mask is not None and mask_grad else mask
        wanted = [ql, kl, vl] + ([m] if mask_grad and m is not None else [])
        out = unwrap(_run(ql, kl, vl, m, key))
        grads = torch.autograd.grad(out, wanted, dout, allow_unused=True)
    full = _fresh([torch.zeros_like(w) if g is None else g for g, w in zip(grads, wanted)], dout, q, k, v, mask)
    return full if len(full) == 4 else [*full, q.new_empty(0)]


@_sharded_sdpa_backward.register_fake
def _(dout, q, k, v, mask, key, mask_grad):
    dmask = mask.new_empty(mask.shape) if mask is not None and mask_grad else q.new_empty(0)
    return [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dmask]


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    q, k, v, mask, key = inputs
    ctx.save_for_backward(q, k, v, mask)
    ctx.key = key


def _backward(ctx: Any, dout: torch.Tensor) -> tuple:
    q, k, v, mask = ctx.saved_tensors
    mask_grad = bool(ctx.needs_input_grad[3])
    dq, dk, dv, dmask = _sharded_sdpa_backward(dout, q, k, v, mask, ctx.key, mask_grad)
    return dq, dk, dv, dmask if mask_grad else None, None


_sharded_sdpa.register_autograd(_backward, setup_context=_setup)
# NOTE: both exchange with every domain rank: each rank must post them in the same order, and none may be dropped.
keep_in_program_order(_sharded_sdpa)
keep_in_program_order(_sharded_sdpa_backward)


def compiled_sharded_attention(query: DomainTensor, key: DomainTensor, value: DomainTensor, attn_mask: Any,
                               dropout_p: float, is_causal: bool, scale: float | None,
                               enable_gqa: bool) -> DomainTensor:
    """SDPA on shards as ``mesh3d::sharded_sdpa`` (see the module docstring); the output is laid out as ``query``."""
    fields = (_spec_fields(query), _spec_fields(key), _spec_fields(value), _spec_fields(attn_mask), dropout_p,
              is_causal, scale, enable_gqa)
    mask = unwrap(attn_mask) if isinstance(attn_mask, torch.Tensor) else attn_mask
    out = _sharded_sdpa(unwrap(query), unwrap(key), unwrap(value), mask, _call_key(fields))
    return wrap(out, query._spec)
