"""Op rules for domain tensors, one module per op family (importing registers them)."""

from mesh3d.domain.ops import (  # noqa: F401
    attention, blocks, blocks_layout, blocks_resample, blocks_spectral, conv, idioms, interpolate, matmul, norm,
    pointwise, pool, reduce, reshape, spectral, tokens, tokens_attention, tokens_prefix,
)
