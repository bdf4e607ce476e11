"""Rules for torch-harmonics (the spherical transforms weather models are built from), registered on first use
(``registry.SHIPPED_RULES``): its ``RealSHT`` and ``InverseRealSHT`` then run on latitude slabs as in one process.

Usage: automatic: ``torch_harmonics.RealSHT(nlat, nlon)(xs)`` of ``xs = domain.shard(x, dim=-2)`` (latitudes sharded,
longitudes whole) gives the one-process coefficients, replicated on every rank; ``InverseRealSHT`` of them gives the
field back. Both are einsums over the latitudes and FFTs over the longitudes, which the dispatcher already rules; what
stopped them is the library's ``_EnsureContiguous`` autograd Function around each FFT, an identity on values and
gradients (a copy to contiguous memory), so each element of its output is its input's: element-wise.
Its DISCO convolution (``torch.ops.disco_kernels``) and S2 attention (``torch.ops.attention_kernels``) stay refused by
name: their kernels read neighbourhoods on the sphere that no rule here describes yet.
"""

from __future__ import annotations

from torch_harmonics.utils import _EnsureContiguous

from mesh3d.domain.ops.custom import elementwise
from mesh3d.domain.dispatch.registry import register

__all__ = ["register_rules"]


def register_rules() -> None:
    """Register (again: idempotent) the rules for torch-harmonics; ``registry.load_shipped_rules`` calls it."""
    register(_EnsureContiguous.apply, rule=elementwise(), override=True)
