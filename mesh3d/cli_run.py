"""The body of ``mesh3d explain``, imported only when it runs (``mesh3d.commands``).

Usage::

    run_explain(build_parser().parse_args(["explain", "pkg.mod:make_model", "pkg.mod:PLAN", "--model", "2"]))
"""

from __future__ import annotations

import argparse


from mesh3d.parallel.explain import explain_table
from mesh3d.parallel.plan import Plan
from mesh3d.planner.spec import load_spec
from mesh3d.meta_builds import built_on_meta

__all__ = ["run_explain"]


def run_explain(args: argparse.Namespace) -> int:
    """``mesh3d explain pkg.mod:make_model pkg.mod:plan --batch 2 --model 2``."""
    factory = load_spec(args.model)
    if not callable(factory):
        raise TypeError(f"{args.model} must name a function returning an nn.Module, got {type(factory).__name__}")
    with built_on_meta():
        model = factory()
    plan = load_spec(args.plan)
    if not isinstance(plan, Plan) and callable(plan):
        plan = plan()
    if not isinstance(plan, Plan):
        raise TypeError(f"{args.plan} must be a mesh3d.Plan or a function returning one, got {type(plan).__name__}")
    sizes = {"batch": args.size_batch, "domain": args.size_domain, "model": args.size_model}
    print(explain_table(plan, model, sizes))
    return 0
