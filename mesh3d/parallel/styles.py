"""The tensor-parallel style vocabulary, written once: names, batch modes, descriptions, weight dims.

A leaf module (it imports nothing from mesh3d), so the plan, its validation, its explanation
and the code applying it all read the same table.

Usage::

    style_kind(ColwiseParallel())                          # "colwise"
    weight_dim("rowwise", linear=True)                     # 1: a Linear weight is (out, in)
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

__all__ = ["BATCH_MODES", "STYLE_NAMES", "style_description", "style_kind", "weight_dim"]

#: What ``Plan.batch`` accepts: how parameters are spread over the batch×domain ranks.
BATCH_MODES: tuple[str | None, ...] = ("fsdp", "hsdp", "ddp", None)

#: Style names ``Plan.model`` accepts besides ``ParallelStyle`` instances.
STYLE_NAMES: tuple[str, ...] = ("colwise", "rowwise", "sequence", "replicate")

#: Which weight dim the model axis shards, by (style kind, module is nn.Linear):
#: a Linear weight is (out, in), an Embedding weight is (vocab, dim).
_WEIGHT_DIM: dict[tuple[str, bool], int] = {
    ("colwise", True): 0,
    ("rowwise", True): 1,
    ("colwise", False): 1,
    ("rowwise", False): 0,
}


def style_description(style: str | ParallelStyle) -> str:
    """A rank-independent text for ``style`` (used by the plan hash and by error messages)."""
    if isinstance(style, str):
        return style
    cls = type(style)
    # ParallelStyle subclasses in torch define no __repr__; their attributes (layouts,
    # flags) are plain values whose repr is the same on every rank.
    fields = ", ".join(f"{k}={v!r}" for k, v in sorted(vars(style).items()))
    return f"{cls.__module__}.{cls.__qualname__}({fields})"


def style_kind(style: str | ParallelStyle) -> str | None:
    """``"colwise"``/``"rowwise"``/``"sequence"``/``"replicate"`` for named styles and torch's own classes, else None."""
    if isinstance(style, str):
        return style
    # Colwise/Rowwise subclasses (e.g. the PrepareModule* helpers are not) shard the same dims.
    if isinstance(style, ColwiseParallel):
        return "colwise"
    if isinstance(style, RowwiseParallel):
        return "rowwise"
    if isinstance(style, SequenceParallel):
        return "sequence"
    return None


def weight_dim(kind: str | None, *, linear: bool, param_name: str = "weight") -> int | None:
    """Which dim of a Linear/Embedding parameter the model axis shards (None: replicated on it).

    ``linear``: the module is an ``nn.Linear`` (else an ``nn.Embedding``). A colwise bias is
    sharded on its only dim; a rowwise bias is replicated.
    """
    if kind not in ("colwise", "rowwise"):
        return None
    if param_name == "bias":
        return 0 if kind == "colwise" else None
    return _WEIGHT_DIM[(kind, linear)]
