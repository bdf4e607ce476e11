"""Op rules for domain tensors, one module per op family (importing registers them)."""

from mesh3d.domain.ops import attention, conv, interpolate, norm, pointwise, pool, reduce, reshape  # noqa: F401
