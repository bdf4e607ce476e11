"""Where every parameter lives on every rank under a ``Plan``, computed from shapes alone (no mesh, no group).

The same arithmetic the parallelized model follows: a tensor-parallel style cuts one dim of a parameter
into equal model-axis shards (``Plan`` checks that they divide); FSDP2 (``fsdp``/``hsdp``/``ddp``) then
cuts dim 0 of that shard into ``torch.chunk`` pieces over its shard group, each stored padded to the
first piece's length; a checkpoint writes each rank's box, replicas splitting its rows.

Usage::

    layout = ModelLayout.build(model_on_meta, plan, mesh)
    p = layout.params[0]; layout.rows(p, s)      # rows of p's TP shard that FSDP shard s holds
    layout.box(p, rank)                           # (global offsets, shape) that rank holds
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from mesh3d.checkpoint.chunks import Box
from mesh3d.parallel.styles import style_description, style_kind, weight_dim
from mesh3d.parallel.validate import PlanFields, hsdp_shard_size, resolve_plan
from mesh3d.mesh_shape import JobMesh

__all__ = ["BatchSharding", "ModelLayout", "ParamLayout", "optimizer_state_keys"]

#: Optimizer state tensors kept per parameter (the 0-dim ``step`` goes to the checkpoint's JSON, not a file).
_OPTIMIZER_STATES: dict[str, tuple[str, ...]] = {"adamw": ("exp_avg", "exp_avg_sq"), "adam": ("exp_avg", "exp_avg_sq"),
                                                 "sgd": ("momentum_buffer",), "none": ()}


def optimizer_state_keys(optimizer: str) -> tuple[str, ...]:
    """The per-parameter state tensors of ``optimizer`` (``adamw``, ``adam``, ``sgd`` with momentum, ``none``).

    Usage: ``optimizer_state_keys("adamw")  # ("exp_avg", "exp_avg_sq")``
    """
    try:
        return _OPTIMIZER_STATES[optimizer.lower()]
    except KeyError:
        raise ValueError(f"optimizer={optimizer!r} is not planned; use one of {', '.join(_OPTIMIZER_STATES)}") from None


@dataclass(frozen=True)
class ParamLayout:
    """One parameter: global shape, dtype, the dim the model axis shards (None: whole on every model rank), FSDP unit."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    tp_dim: int | None
    unit: str | None
    requires_grad: bool
    tp_style: bool = False  # its module has a tensor-parallel style: a DTensor on the model mesh even if whole

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize


@dataclass(frozen=True)
class BatchSharding:
    """How the batch×domain ranks hold parameters: ``shard`` consecutive ranks cut dim 0, ``replicas`` groups repeat it.

    ``mode`` is ``Plan.batch``; ``fsdp``: one shard group of batch·domain; ``hsdp``: groups of ``hsdp_shard_size``;
    ``ddp``: shard groups of one (FSDP2's machinery, nothing cut); None: no batch parallelism (plain parameters).
    """

    mode: str | None
    shard: int
    replicas: int

    @property
    def fsdp(self) -> bool:
        """FSDP2 manages the parameters (``fsdp``, ``hsdp`` and ``ddp`` all do)."""
        return self.mode is not None


@dataclass
class ModelLayout:
    """Every parameter's and buffer's layout for one (model, plan, mesh)."""

    mesh: JobMesh
    sharding: BatchSharding
    params: list[ParamLayout]
    buffers: list[tuple[str, tuple[int, ...], torch.dtype, bool]]  # (name, shape, dtype, persistent)
    units: list[str]  # FSDP units, deepest first, root ("") last; [] without batch parallelism
    styles: dict[str, object]  # module FQN -> style (Plan.model resolved)
    checkpointed: list[str]
    warnings: list[str] = field(default_factory=list)

    @classmethod
    def build(cls, model: nn.Module, plan: PlanFields, mesh: JobMesh) -> ModelLayout:
        """Validate ``plan`` against ``model`` (on meta) and the mesh, as ``parallelize`` would, and lay it out."""
        sizes = mesh.sizes()
        resolved = resolve_plan(plan, model, sizes)
        if plan.batch == "fsdp":
            sharding = BatchSharding("fsdp", mesh.batch_domain, 1)
        elif plan.batch == "hsdp":
            s = hsdp_shard_size(plan, sizes)
            sharding = BatchSharding("hsdp", s, mesh.batch_domain // s)
        else:
            sharding = BatchSharding(plan.batch, 1, mesh.batch_domain)
        unit_of: dict[str, str] = {}
        for unit in resolved.units:  # deepest first: the first unit containing a module owns its parameters
            for name, _ in model.get_submodule(unit).named_modules(prefix=unit):
                unit_of.setdefault(name, unit)
        warnings: list[str] = []
        params: list[ParamLayout] = []
        seen: set[int] = set()  # a parameter shared by two modules (tied weights) is one parameter
        for fqn, module in model.named_modules():
            style = resolved.styles.get(fqn)
            kind = style_kind(style) if style is not None else None
            if style is not None and kind is None:
                warnings.append(f"module {fqn!r}: style {style_description(style)} is not modeled; its parameters are "
                                "planned as whole on every model rank and its collectives are not counted")
            elif style is not None and not isinstance(style, str):
                warnings.append(f"module {fqn!r}: a {type(style).__name__} instance is planned as the named style "
                                f"{kind!r} (default layouts); other input/output layouts' collectives are not counted")
            elif kind == "sequence":
                warnings.append(f"module {fqn!r}: 'sequence' style: its parameters are planned, its collectives are not")
            for pname, p in module.named_parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                dim = weight_dim(kind, linear=isinstance(module, nn.Linear), param_name=pname)
                if sharding.fsdp and p.dim() == 0:
                    raise ValueError(f"parameter {fqn}.{pname} is 0-dim; FSDP shards dim 0, so the planner cannot lay it out")
                params.append(ParamLayout(f"{fqn}.{pname}" if fqn else pname, tuple(p.shape), p.dtype, dim,
                                          unit_of.get(fqn) if sharding.fsdp else None, p.requires_grad,
                                          style is not None and mesh.model > 1))
        persistent = set(model.state_dict(keep_vars=True))
        buffers = [(n, tuple(b.shape), b.dtype, n in persistent) for n, b in model.named_buffers()]
        return cls(mesh, sharding, params, buffers, resolved.units if sharding.fsdp else [], dict(resolved.styles),
                   list(resolved.checkpointed), warnings)

    # ------------------------------------------------------------------ shapes on one rank
    def tp_shape(self, p: ParamLayout) -> tuple[int, ...]:
        """The shape each model rank holds before FSDP (the unsharded parameter FSDP gathers)."""
        shape = list(p.shape)
        if p.tp_dim is not None:
            shape[p.tp_dim] //= self.mesh.model
        return tuple(shape)

    def chunk(self, p: ParamLayout) -> int:
        """FSDP's padded rows per shard: ``torch.chunk``'s first piece of the TP shard's dim 0."""
        rows = self.tp_shape(p)[0]
        return -(-rows // self.sharding.shard)

    def rows(self, p: ParamLayout, s: int) -> int:
        """Rows of dim 0 that FSDP shard ``s`` holds (fewer, or none, at the end of an uneven cut)."""
        rows, c = self.tp_shape(p)[0], self.chunk(p)
        return max(0, min(c, rows - s * c))

    def rest(self, p: ParamLayout) -> int:
        """Elements per row of the TP shard (the product of its dims after 0)."""
        return math.prod(self.tp_shape(p)[1:])

    def shard_index(self, bd: int) -> int:
        """The FSDP shard a batch×domain index holds (HSDP: its place in its group)."""
        return bd % self.sharding.shard

    def param_storage(self, p: ParamLayout) -> int:
        """Bytes of a parameter's storage on any rank (FSDP stores every shard padded to the first's length)."""
        if not self.sharding.fsdp:
            return math.prod(self.tp_shape(p)) * p.itemsize
        return self.chunk(p) * self.rest(p) * p.itemsize

    def unit_params(self, unit: str) -> list[ParamLayout]:
        """The parameters one FSDP unit manages (its modules' own, minus deeper units')."""
        return [p for p in self.params if p.unit == unit]

    # ------------------------------------------------------------------ global boxes (checkpoints)
    def box(self, p: ParamLayout, rank: int) -> Box:
        """The global (offsets, shape) of ``p`` that ``rank`` holds."""
        _, _, m = self.mesh.coords(rank)
        bd = rank // self.mesh.model
        offsets, shape = [0] * len(p.shape), list(self.tp_shape(p))
        if p.tp_dim is not None:
            offsets[p.tp_dim] = m * shape[p.tp_dim]
        if self.sharding.fsdp:
            s = self.shard_index(bd)
            offsets[0] += s * self.chunk(p)
            shape[0] = self.rows(p, s)
            if shape[0] == 0:
                offsets[0] = min(offsets[0], p.shape[0])
        return Box(tuple(offsets), tuple(shape))

    def replica_position(self, p: ParamLayout, rank: int) -> tuple[int, int]:
        """(how many ranks hold ``rank``'s box of ``p``, its place among them in rank order)."""
        bd, m = divmod(rank, self.mesh.model)
        rep = bd // self.sharding.shard
        if p.tp_dim is not None:
            return self.sharding.replicas, rep
        return self.sharding.replicas * self.mesh.model, rep * self.mesh.model + m
