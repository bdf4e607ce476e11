"""``Plan.explain``: what a plan does to each module, without running it (no collective, no mesh needed).

Usage::

    print(plan.explain(model, sizes={"batch": 2, "domain": 1, "model": 2}))
"""

from __future__ import annotations

import math

from torch import nn

from mesh3d.manager import DistributedManager
from mesh3d.parallel.styles import style_description, style_kind, weight_dim
from mesh3d.parallel.validate import PlanFields, hsdp_shard_size, resolve_plan

__all__ = ["explain_rows", "explain_table"]


def _model_text(style, kind: str | None, module: nn.Module) -> str:
    if style is None:
        return "Replicate"
    if kind in ("colwise", "rowwise"):
        return f"{kind}: weight Shard({weight_dim(kind, linear=isinstance(module, nn.Linear))})"
    return kind or style_description(style)


def explain_rows(plan: PlanFields, model: nn.Module, sizes: dict[str, int]) -> list[dict[str, str | int]]:
    """One row per module that owns parameters: its model-axis style, batch-axis placement and bytes per rank."""
    resolved = resolve_plan(plan, model, sizes)
    m, bd = sizes["model"], sizes["batch"] * sizes["domain"]
    if plan.batch == "fsdp":
        batch_shards, batch_text = bd, f"Shard(0) over batch×domain={bd}"
    elif plan.batch == "hsdp":
        s = hsdp_shard_size(plan, sizes)
        batch_shards, batch_text = s, f"Replicate×{bd // s}, Shard(0)×{s}"
    elif plan.batch == "ddp":
        batch_shards, batch_text = 1, f"Replicate×{bd}"
    else:
        batch_shards, batch_text = 1, "none"
    unit_of = {}
    for unit in resolved.units:  # deepest first: the first unit containing a module owns its params
        for name, _ in model.get_submodule(unit).named_modules(prefix=unit):
            unit_of.setdefault(name, unit or "<root>")
    rows = []
    for fqn, module in model.named_modules():
        own = [(n, p) for n, p in module.named_parameters(recurse=False)]
        if not own:
            continue
        style = resolved.styles.get(fqn)
        kind = style_kind(style) if style is not None else None
        per_rank = 0
        for name, p in own:
            shape = list(p.shape)
            dim = weight_dim(kind, linear=isinstance(module, nn.Linear), param_name=name)
            if dim is not None:
                shape[dim] = math.ceil(shape[dim] / m)
            if shape:
                shape[0] = math.ceil(shape[0] / batch_shards)
            per_rank += math.prod(shape) * p.element_size()
        rows.append({
            "module": fqn or "<root>",
            "model": _model_text(style, kind, module),
            "batch": batch_text if plan.batch else "none",
            "unit": unit_of.get(fqn, "-") if plan.batch else "-",
            "checkpointed": "yes" if any(fqn == c or fqn.startswith(c + ".") for c in resolved.checkpointed) else "",
            "params": sum(p.numel() for _, p in own),
            "bytes_per_rank": per_rank,
        })
    return rows


def explain_table(plan: PlanFields, model: nn.Module, sizes: dict[str, int] | None = None) -> str:
    """``explain_rows`` as an aligned text table with a total line."""
    if sizes is None:
        sizes = DistributedManager().shape
    rows = explain_rows(plan, model, sizes)
    header = ["module", "model", "batch", "unit", "checkpointed", "params", "bytes_per_rank"]
    cells = [header] + [[str(r[h]) for h in header] for r in rows]
    total = sum(int(r["bytes_per_rank"]) for r in rows)
    cells.append(["TOTAL", "", "", "", "", str(sum(int(r["params"]) for r in rows)), str(total)])
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    shape = ", ".join(f"{k}={v}" for k, v in sizes.items())
    lines = [f"plan on mesh ({shape})"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)
