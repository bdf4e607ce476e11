"""Checks of a ``Plan`` against a model and axis sizes: local only, so they raise before any collective.

Usage::

    resolved = resolve_plan(plan, model, sizes={"batch": 2, "domain": 1, "model": 2})
    resolved.styles      # {"layers.0.attn.wq": "colwise", ...}  exact FQN -> style
    resolved.units       # FSDP units, deepest first, root ("") last
"""

from __future__ import annotations

import difflib
import fnmatch
from dataclasses import dataclass
from typing import Protocol

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle

from mesh3d.parallel.styles import style_description, style_kind, weight_dim

__all__ = ["PlanFields", "ResolvedPlan", "already_parallel", "hsdp_shard_size", "resolve_plan", "match_modules"]


class PlanFields(Protocol):
    """What the checks read of a ``mesh3d.Plan``.

    NOTE: a protocol, not the class: ``Plan.explain`` calls ``explain``, which calls these checks, so
    naming the class here would make ``plan -> explain -> validate -> plan`` a cycle.
    """

    model: dict
    batch: str | None
    units: list[str] | None
    hsdp_shard_size: int | None
    checkpoint: list[str]


@dataclass
class ResolvedPlan:
    """A plan made concrete for one model: exact module FQNs for every part."""

    styles: dict[str, str | ParallelStyle]
    units: list[str]
    checkpointed: list[str]


def _closest(pattern: str, names: list[str]) -> str:
    close = difflib.get_close_matches(pattern, names, n=5, cutoff=0.3)
    if not close:
        close = names[:5]
    return ", ".join(repr(n) for n in close) or "(the model has no submodules)"


def match_modules(patterns: list[str], model: nn.Module, what: str) -> dict[str, str]:
    """Exact FQN → the pattern that matched it; every pattern must match at least one module."""
    names = [n for n, _ in model.named_modules()]
    matched: dict[str, str] = {}
    for pattern in patterns:
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(
                f"{what} pattern {pattern!r} matches no module of {type(model).__name__}; "
                f"closest module names: {_closest(pattern, [n for n in names if n])}"
            )
        for name in hits:
            if name in matched:
                raise ValueError(
                    f"module {name!r} is matched by two {what} patterns, {matched[name]!r} and {pattern!r}; "
                    "make the patterns disjoint"
                )
            matched[name] = pattern
    return matched


def _divisors_text(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _check_style(fqn: str, module: nn.Module, style: str | ParallelStyle, model_size: int) -> None:
    kind = style_kind(style)
    label = style_description(style) if kind is None else repr(kind)
    if kind in ("colwise", "rowwise"):
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            raise ValueError(
                f"style {label} on module {fqn!r} ({type(module).__name__}) cannot shard it: colwise/rowwise "
                "shard nn.Linear and nn.Embedding only; put the style on the Linear/Embedding children, "
                "or pass a ParallelStyle instance written for this module"
            )
        dim = weight_dim(kind, linear=isinstance(module, nn.Linear))
        assert dim is not None  # colwise/rowwise always cut the weight
        shape = tuple(module.weight.shape)
        if shape[dim] % model_size:
            raise ValueError(
                f"style {label} shards parameter {fqn}.weight of shape {shape} on dim {dim} (size {shape[dim]}) "
                f"over the model axis of size {model_size}, which does not divide it; "
                f"model axis sizes that would work: {_divisors_text(shape[dim])}"
            )
    elif kind in ("sequence", "replicate"):
        if kind == "replicate" and not any(True for _ in module.parameters()):
            raise ValueError(
                f"style 'replicate' on module {fqn!r} ({type(module).__name__}) has nothing to replicate: "
                "it has no parameters; put it on a module that owns parameters"
            )


def _check_heads(fqn: str, model: nn.Module, kind: str | None, model_size: int) -> None:
    """Attention projections under a parent with ``n_heads``/``num_heads`` must split whole heads."""
    if kind not in ("colwise", "rowwise") or "." not in fqn:
        return
    parent = model.get_submodule(fqn.rsplit(".", 1)[0])
    for attr in ("n_heads", "num_heads", "n_head"):
        heads = getattr(parent, attr, None)
        if isinstance(heads, int) and heads % model_size:
            raise ValueError(
                f"style {kind!r} on {fqn!r} splits attention heads over the model axis, but "
                f"{fqn.rsplit('.', 1)[0]}.{attr}={heads} is not divisible by the model axis size {model_size}; "
                f"model axis sizes that would work: {_divisors_text(heads)}"
            )


def default_units(model: nn.Module) -> list[str]:
    """Every child (with parameters) of every ``nn.ModuleList``/``nn.Sequential``: the default FSDP units, the blocks."""
    units = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            # Children without parameters (activations, dropout) would be empty FSDP units.
            units.extend(
                f"{name}.{child}" if name else child
                for child, sub in module.named_children()
                if any(True for _ in sub.parameters())
            )
    return units


def already_parallel(model: nn.Module) -> str | None:
    """Why ``model`` counts as parallelized already (mesh3d, FSDP2 or a DTensor parameter), or None."""
    if getattr(model, "_mesh3d_parallelized", False):
        return "it was returned by mesh3d.parallelize"
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            return f"module {name or '<root>'!r} is already an FSDP module"
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            return f"parameter {name!r} is already a DTensor"
    return None


def resolve_plan(plan: PlanFields, model: nn.Module, sizes: dict[str, int]) -> ResolvedPlan:
    """Validate ``plan`` against ``model`` and the axis ``sizes``; raise ``ValueError`` saying what to change."""
    reason = already_parallel(model)
    if reason is not None:
        raise RuntimeError(f"the model is already parallelized ({reason}); parallelize the original model once")
    model_size = sizes["model"]
    matched = match_modules(list(plan.model), model, "Plan.model")
    styles = {fqn: plan.model[pattern] for fqn, pattern in matched.items()}
    for fqn, style in styles.items():
        _check_style(fqn, model.get_submodule(fqn), style, model_size)
        _check_heads(fqn, model, style_kind(style), model_size)
    if model_size > 1 and not styles:
        raise ValueError(
            f"the model axis has size {model_size} but Plan.model is empty: every model rank would hold and compute "
            "the whole model; give Plan.model styles, or use a mesh with model=1"
        )

    units: list[str] = []
    if plan.batch is not None:
        names = list(match_modules(plan.units, model, "Plan.units")) if plan.units is not None else default_units(model)
        units = sorted((n for n in names if n), key=lambda n: -n.count("."))
        units.append("")  # the root is always the last unit: it owns the parameters left over
        batch_domain = sizes["batch"] * sizes["domain"]
        if plan.batch == "hsdp" and plan.hsdp_shard_size is not None and batch_domain % plan.hsdp_shard_size:
            raise ValueError(
                f"Plan.hsdp_shard_size={plan.hsdp_shard_size} does not divide batch×domain={batch_domain}; "
                f"sizes that would work: {_divisors_text(batch_domain)}"
            )
    checkpointed = list(match_modules(plan.checkpoint, model, "Plan.checkpoint"))
    return ResolvedPlan(styles=styles, units=units, checkpointed=checkpointed)


def hsdp_shard_size(plan: PlanFields, sizes: dict[str, int]) -> int:
    """The shard-group size HSDP uses (see ``Plan.hsdp_shard_size``)."""
    if plan.hsdp_shard_size is not None:
        return plan.hsdp_shard_size
    if sizes["domain"] > 1:
        return sizes["domain"]
    batch = sizes["batch"]
    return batch // 2 if batch % 2 == 0 else batch
