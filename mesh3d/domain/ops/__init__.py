"""Op rules for domain tensors, one module per op family (importing registers them)."""

from mesh3d.domain.ops import (  # noqa: F401
    attention, blocks, blocks_layout, blocks_resample, blocks_spectral, conv, einsum, global_index, idioms, interpolate,
    matmul, norm, pointwise, pool, random_ops, reduce, reshape, scan, spectral, strided, tokens, tokens_attention,
    tokens_prefix,
)
