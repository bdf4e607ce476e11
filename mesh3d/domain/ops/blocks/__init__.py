"""Op rules for block-sharded tensors (importing registers them), one module per op family."""

from mesh3d.domain.ops.blocks import layout, moves, norms, resample, rules, spectral, writes  # noqa: F401
