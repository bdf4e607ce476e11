"""``Plan``: one declarative description of how a model is spread over the (batch, domain, model) mesh.

Usage::

    plan = Plan(model={"layers.*.attn.wq": "colwise", "layers.*.attn.wo": "rowwise"}, batch="fsdp")
    print(plan.explain(model, sizes={"batch": 2, "domain": 1, "model": 2}))
    model = mesh3d.parallelize(model, plan)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from mesh3d.parallel.compile_blocks import compile_options
from mesh3d.parallel.explain import explain_table
from mesh3d.parallel.styles import BATCH_MODES, STYLE_NAMES, style_description

__all__ = ["Plan", "BATCH_MODES", "STYLE_NAMES", "style_description"]


@dataclass
class Plan:
    """How to parallelize a model: tensor parallel styles on the model axis, a data-parallel mode on the batch axis.

    Usage: ``Plan(model={"layers.*.mlp.up": "colwise", "layers.*.mlp.down": "rowwise"}, batch="fsdp")``

    Attributes:
        model: glob pattern over module FQNs (``fnmatch``; ``*`` also crosses dots) → ``"colwise"``,
            ``"rowwise"``, ``"sequence"``, ``"replicate"`` or a ``ParallelStyle`` instance.
        batch: ``"fsdp"`` (shard over batch×domain), ``"hsdp"`` (replicate across groups, shard within
            each group of ``hsdp_shard_size`` ranks), ``"ddp"`` (replicate everywhere) or ``None``.
        units: glob patterns of the modules that become FSDP units (the root always is one).
            ``None``: every child of every ``nn.ModuleList``/``nn.Sequential`` in the model.
        reshard_after_forward: FSDP's option of the same name, for every non-root unit.
        param_dtype, reduce_dtype: mixed precision (compute dtype of unsharded parameters,
            dtype of gradient reduction); ``None`` keeps the parameter dtype.
        cpu_offload: keep sharded parameters, gradients and optimizer state on the CPU.
        hsdp_shard_size: for ``batch="hsdp"``, how many consecutive batch×domain ranks shard each
            parameter (must divide batch·domain); ``None``: all ranks of one batch index
            (the domain group) when domain > 1, else half of the batch ranks (two replicas).
        checkpoint: glob patterns of modules whose activations are recomputed in backward.
        compile: ``torch.compile`` each block (the non-root FSDP units, else the whole model) after tensor
            parallelism and checkpointing, before FSDP: ``True``, or a dict of ``torch.compile`` options
            (``{"backend": "aot_eager", "fullgraph": True}``); ``dynamic=False`` unless given.
    """

    model: dict[str, str | ParallelStyle] = field(default_factory=dict)
    batch: Literal["fsdp", "hsdp", "ddp"] | None = "fsdp"
    units: list[str] | None = None
    reshard_after_forward: bool = True
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    cpu_offload: bool = False
    hsdp_shard_size: int | None = None
    checkpoint: list[str] = field(default_factory=list)
    compile: bool | dict[str, Any] = False

    def __post_init__(self) -> None:
        if self.model is None:  # "no tensor parallelism", as with batch=None
            object.__setattr__(self, "model", {})
        if not isinstance(self.model, dict):
            raise TypeError(f"Plan.model must be a dict of glob pattern -> style, got {type(self.model).__name__}")
        for pattern, style in self.model.items():
            if not isinstance(pattern, str):
                raise TypeError(f"Plan.model keys must be glob strings, got {pattern!r}")
            if isinstance(style, str):
                if style not in STYLE_NAMES:
                    raise ValueError(
                        f"Plan.model[{pattern!r}] = {style!r} is not a style; use one of {', '.join(STYLE_NAMES)} "
                        "or a torch.distributed.tensor.parallel.ParallelStyle instance"
                    )
            elif not isinstance(style, ParallelStyle):
                raise TypeError(
                    f"Plan.model[{pattern!r}] must be a style name or a ParallelStyle instance, got {type(style).__name__}"
                )
        if self.batch not in BATCH_MODES:
            raise ValueError(f"Plan.batch={self.batch!r} must be one of {BATCH_MODES}")
        if self.units is not None and (isinstance(self.units, str) or not all(isinstance(u, str) for u in self.units)):
            raise TypeError(f"Plan.units must be a list of glob strings or None, got {self.units!r}")
        if isinstance(self.checkpoint, str) or not all(isinstance(c, str) for c in self.checkpoint):
            raise TypeError(f"Plan.checkpoint must be a list of glob strings, got {self.checkpoint!r}")
        if self.hsdp_shard_size is not None and (not isinstance(self.hsdp_shard_size, int) or self.hsdp_shard_size < 1):
            raise ValueError(f"Plan.hsdp_shard_size={self.hsdp_shard_size!r} must be a positive int or None")
        if self.hsdp_shard_size is not None and self.batch != "hsdp":
            raise ValueError(f"Plan.hsdp_shard_size is only used with batch='hsdp', but batch={self.batch!r}")
        compile_options(self.compile)  # raises for a value that is not True/False/a dict of known options
        if self.batch is None and (self.param_dtype or self.reduce_dtype or self.cpu_offload):
            raise ValueError("mixed precision and cpu_offload are applied by the batch axis; they need batch='fsdp'/'hsdp'/'ddp'")

    def describe(self) -> str:
        """A canonical text of the plan: equal on two ranks exactly when their plans are equal."""
        model = ";".join(f"{p}={style_description(s)}" for p, s in self.model.items())
        return (
            f"model[{model}] batch={self.batch} units={self.units} reshard={self.reshard_after_forward} "
            f"param_dtype={self.param_dtype} reduce_dtype={self.reduce_dtype} offload={self.cpu_offload} "
            f"hsdp_shard_size={self.hsdp_shard_size} checkpoint={self.checkpoint} compile={compile_options(self.compile)}"
        )

    def fingerprint(self, model: nn.Module | None = None) -> int:
        """A 63-bit hash of the plan (and of the model's parameter names, shapes and dtypes)."""
        text = self.describe()
        if model is not None:
            text += "|" + ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in model.named_parameters())
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1

    def explain(self, model: nn.Module, sizes: dict[str, int] | None = None) -> str:
        """A table: module → placement on each axis and parameter bytes per rank.

        ``sizes`` gives the axis sizes (``{"batch": 2, "domain": 1, "model": 2}``); by default
        those of the initialized ``DistributedManager``. Validates the plan first.
        """
        return explain_table(self, model, sizes)
