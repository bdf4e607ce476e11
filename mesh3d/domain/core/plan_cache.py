"""``plan_cache``: memoize a pure planning function and let ``torch.compile`` run it at trace time.

Usage::

    @plan_cache(maxsize=1024)
    def plan_window(sizes: tuple[int, ...], kernel: int, ...) -> WindowPlan: ...

A domain rule plans its exchanges from the spec alone (every rank's sizes, kernel, stride, padding): plain ints in,
a frozen plan out, the same plan every time. Eager calls hit an ``lru_cache``. Under ``torch.compile``, Dynamo
would otherwise trace the planner's Python line by line (and break the graph on builtins it cannot trace, such as
``bisect``); ``torch.compiler.assume_constant_result`` (``constant_in_compiled_graphs``, which does the same
without importing Dynamo) makes it call the planner once, with the concrete arguments, and bake the plan into the
graph as a constant.

NOTE: only for functions whose result depends on their arguments alone (no tensors, no global state), which is
what the ``lru_cache`` already assumed. Dynamo guards on the arguments through the specs it reads them from, so a
new layout (other sizes) recompiles rather than reusing a stale plan.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from torch.compiler import is_compiling, is_dynamo_compiling

from mesh3d._torch_private import constant_in_compiled_graphs, outside_dispatch_modes

__all__ = ["PLAN_CACHES", "PlanCaches", "plan_cache"]

F = TypeVar("F", bound=Callable[..., Any])


class PlanCaches:
    """Every ``plan_cache``'s memo, to empty when the mesh goes (``DistributedManager.on_shutdown``): plans hold the
    specs and comms of their mesh, which would otherwise live for the process (``process_hooks.py`` waits for the last
    comm to go).

    Usage: ``PLAN_CACHES.clear()``
    """

    def __init__(self) -> None:
        self._clears: list[Callable[[], None]] = []

    def add(self, clear: Callable[[], None]) -> None:
        self._clears.append(clear)

    def clear(self) -> None:
        for clear in self._clears:
            clear()


PLAN_CACHES = PlanCaches()


def plan_cache(maxsize: int, *, run_at_trace_time: bool = False) -> Callable[[F], F]:
    """Decorator: ``lru_cache(maxsize)`` for eager calls; under ``torch.compile`` Dynamo traces the planner (its result
    is a constant of the graph), or with ``run_at_trace_time`` calls it for real, once, and keeps its result.

    ``run_at_trace_time`` is for planners that compute with tensors (interpolation's source rows): traced, each
    ``int(t[i])`` would be a data-dependent value. Their arguments must be plain constants (ints, floats, strings,
    tuples of them, dtypes) and their result plain data: Dynamo guards neither an argument object nor a result.
    """

    def decorate(fn: F) -> F:
        cached = functools.lru_cache(maxsize=maxsize)(fn)

        @functools.wraps(fn)
        def planned(*args: Any, **kwargs: Any) -> Any:
            if is_dynamo_compiling() and not run_at_trace_time:
                return fn(*args, **kwargs)  # Dynamo traces the planner itself: its result is a constant
            if run_at_trace_time and is_compiling():
                # NOTE: a wrapper domain tensor's rule runs under the tracer's fake and functional modes (issue 64):
                # the planner's own tensors must be real ones, computed now
                with outside_dispatch_modes():
                    return cached(*args, **kwargs)
            return cached(*args, **kwargs)

        PLAN_CACHES.add(cached.cache_clear)
        planned.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
        planned.cache_info = cached.cache_info  # type: ignore[attr-defined]
        if run_at_trace_time:
            return constant_in_compiled_graphs(planned)
        return planned

    return decorate


class plan_property:  # noqa: N801  (a decorator, named like functools.cached_property which it replaces)
    """``functools.cached_property`` for the frozen specs and plans, which ``torch.compile`` can trace.

    Usage: ``@plan_property`` above ``def offset(self) -> int: ...`` in a frozen dataclass.

    NOTE: on Python 3.11 ``cached_property`` takes an ``RLock``, which Dynamo cannot enter; traced, the value is
    simply computed (it is a constant of the graph), and eager calls cache it in the instance as before.
    """

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn
        self.name = fn.__name__
        self.__doc__ = fn.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        if is_dynamo_compiling():
            return self.fn(obj)
        cache = obj.__dict__
        if self.name not in cache:
            cache[self.name] = self.fn(obj)
        return cache[self.name]
