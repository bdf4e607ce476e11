"""Op rules for graph layouts (nodes and edges split by a partition; importing registers them), one module per family:
``pointwise`` (items stay), ``pieces`` (unbind, split, chunk, transposes), ``index`` (gathers, masks, new layouts),
``scatter`` (aggregation), ``counting`` (bincount, unique, nonzero), ``reduce``."""

from mesh3d.domain.ops.graph import counting, index, pieces, pointwise, reduce, scatter  # noqa: F401
