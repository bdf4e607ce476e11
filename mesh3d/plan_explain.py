"""``Plan.explain``: what a plan does to each module, without running it (no collective, no mesh needed).

Usage::

    print(plan.explain(model, sizes={"batch": 2, "domain": 1, "model": 2}))
"""

from __future__ import annotations

import math

from torch import nn

from mesh3d.plan import Plan, style_description
from mesh3d.plan_validation import hsdp_shard_size, resolve_plan, style_kind

__all__ = ["explain_rows", "explain_table", "load_object", "add_explain_arguments", "run_explain"]


def load_object(spec: str) -> object:
    """``"package.module:name"`` → that object (called if it is a model factory)."""
    import importlib

    if ":" not in spec:
        raise ValueError(f"{spec!r} must look like 'package.module:name'")
    module_name, attr = spec.split(":", 1)
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def add_explain_arguments(parser) -> None:
    parser.add_argument("model", help="module:factory that returns the nn.Module (built on the meta device)")
    parser.add_argument("plan", help="module:name of a mesh3d.Plan, or of a function returning one")
    for axis in ("batch", "domain", "model"):
        parser.add_argument(f"--{axis}", dest=f"size_{axis}", type=int, default=1, help=f"{axis} axis size")


def run_explain(args) -> int:
    """``mesh3d explain pkg.mod:make_model pkg.mod:plan --batch 2 --model 2``."""
    import torch

    factory = load_object(args.model)
    with torch.device("meta"):
        model = factory()
    plan = load_object(args.plan)
    if not isinstance(plan, Plan):
        plan = plan()
    sizes = {"batch": args.size_batch, "domain": args.size_domain, "model": args.size_model}
    print(explain_table(plan, model, sizes))
    return 0


def _model_dim(kind: str | None, module: nn.Module, param_name: str) -> int | None:
    """Which dim of ``param_name`` the model axis shards (None: replicated on the model axis)."""
    if kind not in ("colwise", "rowwise"):
        return None
    linear = isinstance(module, nn.Linear)
    if param_name == "bias":
        return 0 if kind == "colwise" else None
    return {("colwise", True): 0, ("rowwise", True): 1, ("colwise", False): 1, ("rowwise", False): 0}[(kind, linear)]


def _model_text(style, kind: str | None, module: nn.Module) -> str:
    if style is None:
        return "Replicate"
    if kind in ("colwise", "rowwise"):
        return f"{kind}: weight Shard({_model_dim(kind, module, 'weight')})"
    return kind or style_description(style)


def explain_rows(plan: Plan, model: nn.Module, sizes: dict[str, int]) -> list[dict[str, str | int]]:
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
            dim = _model_dim(kind, module, name)
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


def explain_table(plan: Plan, model: nn.Module, sizes: dict[str, int] | None = None) -> str:
    """``explain_rows`` as an aligned text table with a total line."""
    if sizes is None:
        from mesh3d.manager import DistributedManager

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
