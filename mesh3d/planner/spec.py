"""Naming the model and plan to plan or check: ``package.module:name`` or ``path/file.py:name``.

Usage::

    factory = load_spec("mypkg.models:make_unet")
    plan = load_plan("mypkg.plans:PLAN")          # a Plan, or a function returning one; Plan() for None
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable

from torch import nn

from mesh3d.parallel.plan import Plan

__all__ = ["load_model_factory", "load_plan", "load_spec"]


def load_spec(spec: str) -> object:
    """``"package.module:name"`` or ``"path/to/file.py:name"`` → that object (``name`` may be dotted).

    Usage: ``factory = load_spec("mypkg.models:make_unet")``
    """
    if ":" not in spec:
        raise ValueError(f"{spec!r} must look like 'package.module:name' or 'path/file.py:name'")
    where, attr = spec.rsplit(":", 1)
    if where.endswith(".py") or os.sep in where:
        module_spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(where))[0], where)
        if module_spec is None or module_spec.loader is None:
            raise ValueError(f"cannot load {where!r} as a Python file")
        obj: object = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(obj)
    else:
        obj = importlib.import_module(where)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def load_plan(spec: str | Plan | None) -> Plan:
    """A Plan named by ``spec`` (a Plan object or a function returning one); ``Plan()`` for None.

    Usage: ``plan = load_plan("mypkg.plans:PLAN")``
    """
    if spec is None:
        return Plan()
    plan = load_spec(spec) if isinstance(spec, str) else spec
    if not isinstance(plan, Plan) and callable(plan):
        plan = plan()
    if not isinstance(plan, Plan):
        raise TypeError(f"plan {spec!r} must be a mesh3d.Plan or a function returning one, got {type(plan).__name__}")
    return plan


def load_model_factory(spec: str | Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """The model factory named by ``spec`` (or ``spec`` itself when it is callable).

    Usage: ``make = load_model_factory("mypkg.models:make_unet"); model = make()``
    """
    factory = load_spec(spec) if isinstance(spec, str) else spec
    if not callable(factory):
        raise TypeError(f"{spec!r} must name a function returning an nn.Module, got {type(factory).__name__}")
    return factory
