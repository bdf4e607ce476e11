"""Op rules for token grids, blocks flattened into tokens (importing registers them), one module per op family."""

from mesh3d.domain.ops.tokens import attention, codebook, prefix, rules  # noqa: F401
