"""Naming the model and plan to plan or check: ``package.module:name`` or ``path/file.py:name``.

Usage::

    factory = load_spec("mypkg.models:make_unet")
    plan = load_plan("mypkg.plans:PLAN")          # a Plan, or a function returning one; Plan() for None
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
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
        if not os.path.isfile(where):
            raise ValueError(f"{spec!r}: there is no file {where!r} (from {os.getcwd()}); give a path to a .py file or "
                             "an importable module, e.g. examples/weather.py:model or mypkg.models:make_unet")
        # NOTE: the file's own folder on the path, as `python path/file.py` puts it: a file importing a sibling
        # (examples/meshgraphnet.py imports examples/_runs.py) loads here as it runs there
        folder = os.path.dirname(os.path.abspath(where))
        if folder not in sys.path:
            sys.path.insert(0, folder)
        module_spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(where))[0], where)
        if module_spec is None or module_spec.loader is None:
            raise ValueError(f"cannot load {where!r} as a Python file")
        obj: object = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(obj)
    else:
        try:
            obj = importlib.import_module(where)
        except ModuleNotFoundError as err:
            if err.name is None or not where.startswith(err.name):
                raise  # a module the user's module imports is missing: its own traceback says where
            raise ValueError(f"{spec!r}: no module named {err.name!r} on the Python path; give an importable module "
                             "or a path to a .py file (path/file.py:name)") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{spec!r}: {where} has no {part!r}"
                             + (f"; it has {', '.join(_public_names(obj))}" if _public_names(obj) else ""))
        obj = getattr(obj, part)
    return obj


def _public_names(obj: object) -> list[str]:
    """Up to 8 of the public callables and plans a module offers (for a message that suggests one)."""
    names = [n for n, v in vars(obj).items() if not n.startswith("_") and (callable(v) or isinstance(v, Plan))
             and getattr(v, "__module__", None) == getattr(obj, "__name__", None)]
    return names[:8]


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
