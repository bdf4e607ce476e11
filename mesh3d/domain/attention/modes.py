"""Attention over domain-sharded sequences and token grids: one entry point, three modes.

Usage::

    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # q, k, v: domain tensors (B, H, S, E)
    out = domain.attention(q, k, v, window=(64, 0))                  # a causal sliding window (plain tensors too)
    out = domain.attention(q, k, v, attn_mask=bias, mode="ulysses")  # one call in another mode
    with domain.attention_mode("gather"):                            # every attention inside the block
        y = model(xs)

Modes: ``ring`` (``mesh3d.domain.attention.ring``: K/V blocks travel round the domain group; memory O(S/D) per rank),
``gather`` (every rank gathers all keys/values: O(S), fastest on short sequences) and ``ulysses``
(all-to-all heads <-> rows; heads must divide by the domain size). ``auto`` (the default) picks ring once
the keys reach ``AttentionSettings.ring_min_tokens`` and gather below: the crossover measured by
``scripts/bench_attention.py`` on the 2-core CPU (docs/domain.md, "Attention"). With ``is_causal`` the ring
moves queries, keys and values into the zigzag layout for the call (every rank and every step then has the
same work) and the output back: the layers around attention never see it.

Masks: ``attn_mask`` bool or float (of the query's dtype), broadcastable to ``(B, H, S_q, S_k)`` with global
lengths: a plain or replicated tensor of the global ``(..., S_q, S_k)`` (sliced per block by global index;
a float mask's gradient is this rank's rows, summed over the domain like a parameter's), or a slab mask
sharded like the queries along its rows. ``window=(left, right)``: query ``i`` sees keys ``i-left..i+right``
(blocks outside the band are skipped); with ``is_causal``, ``right`` is 0. ``enable_gqa`` and ``scale`` as
in torch. ``dropout_p`` must be 0: per-rank random masks would not be the one-process draw.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from mesh3d.domain.attention.score_tiles import MaskRule
from mesh3d.domain.attention.collect import AttentionCall, gather_attention, local_attention, ulysses_attention
from mesh3d.domain.attention.row_order import reorder_rows, slab_order, token_order, zigzag_order
from mesh3d.domain.attention.ring import RingPlan, ring_attention
from mesh3d.domain.core.tensor import DomainTensor, adopt, unwrap
from mesh3d.domain.core.settings import ATTENTION_KERNELS, ATTENTION_MODES, SETTINGS, AttentionSettings
from mesh3d.domain.core.specs import TokenSpec, sharded_dims
from mesh3d.domain.dispatch.executor import run_step
from mesh3d.domain.dispatch.step import Entering, Step

__all__ = ["attention", "attention_mode", "attention_step", "sharded_attention"]


@contextlib.contextmanager
def attention_mode(mode: str = "ring", *, head_groups: int | None = None, kernel: str | None = None,
                   balance: bool | None = None) -> Iterator[AttentionSettings]:
    """Run attention on domain tensors in ``mode`` inside the block (and set the ring's options).

    Usage: ``with domain.attention_mode("ulysses"): y = model(xs)``; ``attention_mode("ring", head_groups=1)``
    """
    if mode not in ATTENTION_MODES:
        raise ValueError(f"attention_mode: mode={mode!r} is not one of {ATTENTION_MODES}")
    if kernel is not None and kernel not in ATTENTION_KERNELS:
        raise ValueError(f"attention_mode: kernel={kernel!r} is not one of {ATTENTION_KERNELS}")
    if head_groups is not None and (not isinstance(head_groups, int) or head_groups < 1):
        raise ValueError(f"attention_mode: head_groups={head_groups!r} must be a positive int")
    now = SETTINGS.value
    given = {"mode": mode, "head_groups": head_groups, "kernel": kernel, "balance": balance}
    attention = replace(now.attention, **{k: v for k, v in given.items() if v is not None})
    with SETTINGS.replaced(replace(now, attention=attention)):
        yield attention


def _window_rule(window, is_causal: bool, has_mask: bool, op: str) -> MaskRule:
    if window is None:
        left, right = None, None
    elif isinstance(window, int) and not isinstance(window, bool):
        left, right = window, window
    elif isinstance(window, (tuple, list)) and len(window) == 2:
        left, right = window
    else:
        raise ValueError(f"{op}: window={window!r} must be an int or a (left, right) pair of ints or None")
    for w in (left, right):
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 0):
            raise ValueError(f"{op}: window={window!r}: each side is a non-negative int or None (unbounded)")
    if is_causal:
        if right not in (None, 0):
            raise ValueError(f"{op}: is_causal=True sees no key after the query; window={window!r} asks for {right}")
        right = 0
    return MaskRule(left, right, has_mask)


def _layouts(query, key, value, op: str):
    """(comm, query layout, K/V layout) of slabs or token grids, or a ValueError naming what is wrong."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, DomainTensor):
            raise ValueError(f"{op}: the {name} is a plain tensor while the others are domain tensors: "
                             "F.scaled_dot_product_attention runs such a mix (cross-attention to plain keys, plain "
                             "latent queries over sharded keys, operands sharded along a batch-like dim); "
                             "domain.attention's modes take query, key and value all sharded along the sequence (dim -2)")
        if unwrap(t).ndim not in (3, 4) or sharded_dims(t._spec) != (unwrap(t).ndim - 2,):
            raise ValueError(f"{op}: the {name} must be a domain tensor sharded along its sequence dim only "
                             "((B, H, S, E) or (B, S, E), S at dim -2)")
    tokens = [isinstance(t._spec, TokenSpec) for t in (query, key, value)]
    if any(tokens) and not all(tokens):
        raise ValueError(f"{op}: mix of token grids and slabs; lay out query, key and value alike")
    if key._spec != value._spec:
        raise ValueError(f"{op}: key and value must be laid out alike (got {key._spec.sizes} and "
                         f"{value._spec.sizes})")
    if all(tokens):
        if query._spec.keys is not None or key._spec.keys is not None:
            raise ValueError(f"{op}: attention scores (q @ k^T on a token grid) are no query; pass the tokens")
        return query._spec.comm, token_order(query._spec), token_order(key._spec)
    if query._spec.comm.ranks != key._spec.comm.ranks:
        raise ValueError(f"{op}: query and key are sharded over different domain groups")
    return query._spec.comm, slab_order(query._spec.sizes), slab_order(key._spec.sizes)


def _mask(attn_mask, query: DomainTensor, sq: int, sk: int, q4: tuple, dtype: torch.dtype, three: bool, op: str):
    """(the step's mask argument or None, how its rows are read): validated from shapes and specs alone, before any
    communication. A replicated mask enters every shard (``step.Entering``: its gradient summed over the domain)."""
    if attn_mask is None:
        return None, None
    rows, mask = "global", attn_mask
    if isinstance(attn_mask, DomainTensor):
        dims = sharded_dims(attn_mask._spec)
        local = unwrap(attn_mask)
        if not dims:  # replicated: every shard uses it, so its gradient is summed over the domain
            mask = Entering(attn_mask)
        elif (dims == (local.ndim - 2,) and not isinstance(query._spec, TokenSpec)
              and not isinstance(attn_mask._spec, TokenSpec) and attn_mask._spec.sizes == query._spec.sizes):
            rows = "local"
        else:
            raise ValueError(f"{op}: a domain-tensor attn_mask must be replicated, or (on slabs) sharded along its "
                             f"rows (dim -2) like the queries {query._spec.sizes}; pass a plain (..., {sq}, {sk}) "
                             "tensor otherwise")
    else:
        local = attn_mask
    if local.dtype != torch.bool and local.dtype != dtype:
        raise ValueError(f"{op}: attn_mask of dtype {local.dtype}: it must be bool or the query's {dtype}")
    shape = tuple(local.shape)
    four = shape[:-2] + (1,) + shape[-2:] if three and len(shape) == 3 else shape  # (B, S_q, S_k): no head dim
    lead = four[-4:-2]
    ok = 2 <= len(four) <= 4 and shape[-2] in (1, sq if rows == "global" else shape[-2]) and shape[-1] in (1, sk) \
        and all(m in (1, n) for m, n in zip(lead[::-1], q4[:2][::-1]))
    if not ok:
        raise ValueError(f"{op}: attn_mask of shape {shape} does not broadcast to the scores "
                         f"(B, H, S_q, S_k) = ({q4[0]}, {q4[1]}, {sq}, {sk}) with global lengths; pass a "
                         f"(..., {sq}, {sk}) mask (mesh3d slices it per block)")
    return mask, rows


def _heads(q4: tuple, k4: tuple, v4: tuple, enable_gqa: bool, op: str) -> None:
    if q4[0] != k4[0] or k4[:2] != v4[:2] or q4[-1] != k4[-1]:
        raise ValueError(f"{op}: query {q4}, key {k4} and value {v4} "
                         "(local shards) disagree on batch, heads or head size")
    hq, hkv = q4[1], k4[1]
    if (enable_gqa and hq % hkv) or (not enable_gqa and hq != hkv):
        raise ValueError(f"{op}: {hq} query heads and {hkv} key/value heads: they must be equal, or "
                         "enable_gqa=True with the query heads a multiple of the key/value heads")


def attention_step(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False, *, window=None, mode=None, op="scaled_dot_product_attention") -> Step:
    """SDPA on domain tensors in the mode asked for (``mode``, else ``attention_mode``'s, else auto), as a step: planned
    from the operands' layouts, shapes and dtypes; the mode's messages are sent when the executor runs it.

    Usage: ``return attention_step(qs, ks, vs, is_causal=True)  # the rule behind F.scaled_dot_product_attention``

    Every check runs before any communication, alike on every rank, so bad input raises everywhere.
    """
    if dropout_p:
        raise NotImplementedError(
            f"{op} on domain tensors: dropout_p={dropout_p} is not supported: each rank would draw its own "
            "attention-dropout mask, unlike one process. Pass dropout_p=0 (model.eval(), or attention dropout "
            "0 while training)")
    if attn_mask is not None and is_causal:
        raise ValueError(f"{op}: pass attn_mask or is_causal, not both (as torch's SDPA)")
    comm, q_order, kv_order = _layouts(query, key, value, op)
    q, k, v = unwrap(query), unwrap(key), unwrap(value)
    three = q.ndim == 3
    q4, k4, v4 = ((t.shape[0], 1, *t.shape[1:]) if three else tuple(t.shape) for t in (q, k, v))
    _heads(q4, k4, v4, enable_gqa, op)
    sq, sk = sum(s.rows for s in q_order), sum(s.rows for s in kv_order)
    mask, rows = _mask(attn_mask, query, sq, sk, q4, q.dtype, three, op)
    rule = _window_rule(window, is_causal, mask is not None, op)
    settings = SETTINGS.value.attention
    chosen = mode or settings.mode
    if chosen not in ATTENTION_MODES:
        raise ValueError(f"{op}: attention mode {chosen!r} is not one of {ATTENTION_MODES}")
    if chosen == "auto":
        chosen = "ring" if sk >= settings.ring_min_tokens else "gather"
    if chosen == "ulysses" and comm.size > 1:
        if q4[1] % comm.size or k4[1] % comm.size:
            raise ValueError(f"{op}: attention mode 'ulysses' splits the heads over the {comm.size} domain ranks: "
                             f"the query heads ({q4[1]}) and key/value heads ({k4[1]}) must both divide "
                             f"by {comm.size}; use mode 'ring' (any number of heads)")
        if rows == "local":
            raise ValueError(f"{op}: attention mode 'ulysses' needs a plain (..., S_q, S_k) attn_mask, not one "
                             "sharded like the queries; use mode 'ring' or 'gather'")
    scale = scale if scale is not None else q4[-1] ** -0.5
    call = AttentionCall(comm, q_order, kv_order, rule, scale, enable_gqa, rows)
    attend = _Attend(call, "local" if comm.size == 1 else chosen, three, settings)
    return Step(attend, (query, key, value, mask), out=query._spec)


def sharded_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False, *, window=None, mode=None, op="scaled_dot_product_attention") -> DomainTensor:
    """``attention_step``'s step run at once: for callers outside a rule (``domain.attention``, the compiled op).

    Usage: ``out = sharded_attention(qs, ks, vs, is_causal=True)``
    """
    step = attention_step(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window=window,
                          mode=mode, op=op)
    return adopt(run_step(replace(step, out=None)), query._spec)


def _ring(call: AttentionCall, q, k, v, mask, settings: AttentionSettings) -> torch.Tensor:
    """The ring, in the zigzag layout when causal (queries, keys and values moved there and the output back)."""
    comm, rule = call.comm, call.rule
    qs, kvs = call.q_order, call.kv_order
    rows = sum(s.rows for s in qs)
    balance = settings.balance and rule == MaskRule(None, 0, rule.user) and rows == sum(s.rows for s in kvs)
    if balance:
        zig = zigzag_order(rows, comm.size)
        # NOTE: one exchange per tensor, not one for a concatenation: the concatenation and its gradient would
        # each cost three more blocks of memory (measured: +52 MB against +28 MB at D=4, S=4096)
        q, k, v = reorder_rows(q, 2, qs, zig, comm), reorder_rows(k, 2, kvs, zig, comm), reorder_rows(v, 2, kvs, zig, comm)
        if mask is not None and call.mask_rows == "local":
            mask = reorder_rows(mask, mask.ndim - 2, qs, zig, comm)
        qs = kvs = zig
    plan = RingPlan(comm, (qs[comm.index],), kvs, rule, call.scale, call.mask_rows, settings.head_groups,
                    settings.kernel == "math")
    out = ring_attention(plan, q, k, v, mask)
    return reorder_rows(out, 2, qs, call.q_order, comm) if balance else out


_MODES = {"local": local_attention, "gather": gather_attention, "ulysses": ulysses_attention}


@dataclass(frozen=True)
class _Attend:
    """An attention step's local function: its mode on this rank's rows, (B, H, rows, E) (``three``: (B, rows, E),
    given a head dim for the call). The mode's messages are sent here, as the executor runs the step (the ring
    interleaves them with its blocks)."""

    call: AttentionCall
    mode: str
    three: bool
    settings: AttentionSettings

    def __call__(self, q, k, v, mask):
        if self.three:
            q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
            mask = mask.unsqueeze(-3) if mask is not None and mask.ndim == 3 else mask
        out = _ring(self.call, q, k, v, mask, self.settings) if self.mode == "ring" else \
            _MODES[self.mode](self.call, q, k, v, mask)
        return out.squeeze(1) if self.three else out


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
              *, window: int | tuple[int | None, int | None] | None = None, mode: str | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with a sliding ``window`` and a ``mode``, on domain or plain tensors.

    Usage: ``out = domain.attention(q, k, v, is_causal=True, window=(256, 0), mode="ring")``

    On plain tensors it is the one-process computation (the reference the domain modes equal).
    """
    if isinstance(query, DomainTensor):
        return sharded_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                 window=window, mode=mode, op="domain.attention")
    rule = _window_rule(window, is_causal, attn_mask is not None, "domain.attention")
    if not rule.banded or (rule.left is None and rule.right == 0 and attn_mask is None):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    i = torch.arange(query.shape[-2], device=query.device)[:, None]
    j = torch.arange(key.shape[-2], device=query.device)[None, :]
    band = torch.ones(i.shape[0], j.shape[1], dtype=torch.bool, device=query.device)
    if rule.right is not None:
        band &= j <= i + rule.right
    if rule.left is not None:
        band &= j >= i - rule.left
    mask = band if attn_mask is None else attn_mask & band if attn_mask.dtype == torch.bool else \
        attn_mask.masked_fill(~band, float("-inf"))
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                          enable_gqa=enable_gqa)
