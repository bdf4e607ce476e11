"""Op rules for domain tensors, one module per op family (importing registers them)."""

from mesh3d.domain.ops import (  # noqa: F401
    attention, blocks, composite, conv, conversions, custom, distances, einsum, finite_differences,
    global_index, graph, grid_sample, grid_variance, idioms, interpolate, local_index, logical_reductions, matmul, mixed_attention,
    multihead, norm, order, pieces, pointwise, pool, random_fills, random_ops, reduce, reshape, scan, spectral, strided,
    strided_losses, tokens, unfold, vector_norms,
    weighted_resample,
)
