"""Rules for torch-harmonics (the spherical transforms and convolutions weather models are built from), registered on
first use (``registry.SHIPPED_RULES``): its ``RealSHT`` and ``InverseRealSHT`` then run on latitude slabs as in one
process, and so do its DISCO convolutions (``DiscreteContinuousConvS2`` and ``DiscreteContinuousConvTransposeS2``).

Usage: automatic: ``torch_harmonics.RealSHT(nlat, nlon)(xs)`` of ``xs = domain.shard(x, dim=-2)`` (latitudes sharded,
longitudes whole) gives the one-process coefficients, replicated on every rank; ``InverseRealSHT`` of them gives the
field back; ``DiscreteContinuousConvS2(...)(xs)`` gives the output sharded along latitudes (``ops/disco.py``).
The transforms are einsums over the latitudes and FFTs over the longitudes, which the dispatcher already rules; what
stopped them is the library's ``_EnsureContiguous`` autograd Function around each FFT, an identity on values and
gradients (a copy to contiguous memory), so each element of its output is its input's: element-wise.
So does its neighbourhood attention (``NeighborhoodAttentionS2``, ``ops/s2_attention.py``) but for upsampling. The
DISCO kernels of CUDA's half-precision paths (``_DiscoKpacked*``) stay refused by name: no rule here reads their
packed pattern.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch_harmonics.disco.optimized.disco_optimized import _DiscoSaveXConvFn
from torch_harmonics.utils import _EnsureContiguous

from mesh3d.domain.dispatch.registry import op_name, register
from mesh3d.domain.ops.custom import CustomRule, elementwise
from mesh3d.domain.ops.disco import contraction_rule, transpose_rule
from mesh3d.domain.ops.s2_attention import attention_rule, permute_rule
from mesh3d.domain.ops.sphere_blocks import (
    attention_block_rule, contraction_block_rule, permute_block_rule, transpose_block_rule)

__all__ = ["register_rules"]


@dataclass(frozen=True)
class _OnSlabsAndBlocks(CustomRule):
    """A kernel's rule on latitude slabs and on lat x lon blocks (``domain.register`` files each in its table)."""

    slabs: Callable
    blocks: Callable

    def rules(self, func: Callable) -> dict[str, Callable]:
        return {"RULES": self.slabs, "BLOCK_RULES": self.blocks}


def _disco_rules() -> dict:
    """The DISCO kernels and their rules, made once (each rule owns the cache of its local psi)."""
    kernels = torch.ops.disco_kernels
    # NOTE: the library defines its DISCO custom ops only where its compiled kernels load; without them its modules
    # take the pure-PyTorch path (sparse matrices), which stays refused by name
    if not hasattr(kernels, "_disco_s2_contraction_optimized"):
        return {}
    forward, fused = kernels._disco_s2_contraction_optimized, kernels._disco_s2_fused_conv_optimized
    transpose, save_x = kernels._disco_s2_transpose_contraction_optimized, _DiscoSaveXConvFn.apply
    made = {}
    for func, with_weight in ((forward, False), (fused, True), (save_x, True)):
        made[func] = _OnSlabsAndBlocks(contraction_rule(func, op_name(func), with_weight=with_weight),
                                       contraction_block_rule(func, op_name(func), with_weight=with_weight))
    made[transpose] = _OnSlabsAndBlocks(transpose_rule(transpose, op_name(transpose)),
                                        transpose_block_rule(transpose, op_name(transpose)))
    return made


def _attention_rules() -> dict:
    """The neighbourhood attention kernel and the channels-last copies around it, with their rules."""
    kernels = torch.ops.attention_kernels
    if not hasattr(kernels, "_neighborhood_s2_attention_optimized"):  # NOTE: as for DISCO: its compiled kernels only
        return {}
    attention = kernels._neighborhood_s2_attention_optimized
    made = {attention: _OnSlabsAndBlocks(attention_rule(attention), attention_block_rule(attention, op_name(attention)))}
    for copy, dims in ((kernels.permute_to_nhwc, (0, 2, 3, 1)), (kernels.permute_to_nchw, (0, 3, 1, 2))):
        made[copy] = _OnSlabsAndBlocks(permute_rule(copy, dims), permute_block_rule(copy, dims))
    return made


_RULES = {**_disco_rules(), **_attention_rules()}


def register_rules() -> None:
    """Register (again: idempotent) the rules for torch-harmonics; ``registry.load_shipped_rules`` calls it."""
    register(_EnsureContiguous.apply, rule=elementwise(), override=True)
    for func, rule in _RULES.items():
        register(func, rule=rule, override=True)
