"""Which rules post messages to other ranks while they plan (issue 66: a rule only declares; the executor talks).

``RuleWatch`` watches the one point where messages are posted (``comm.stopping.post``): a message posted while a rule
is planning, and not inside a step the executor runs for it, names that rule. ``STILL_TALKING`` lists, per layout of the
layout sweep (``test_domain_layout_sweep.py``), the rules that still do; it only shrinks.

Usage (in a rank's body)::

    watch = RuleWatch(); watch.install()
    try: ...calls...
    finally: watch.remove()
    watch.talked   # the names (``op_name``) of the rules that talked while planning
"""

from __future__ import annotations

import sys

#: Per layout of the layout sweep, the rules that still post messages while they plan (issue 66 item 2: each becomes
#: a step with its exchange as a requirement or its partial result declared). Only ever remove names: none is left
#: (attention's modes, the last, plan from metadata and send their messages in the step the executor runs).
STILL_TALKING: dict[str, frozenset[str]] = {}


class RuleWatch:
    """Which rules post messages while they plan: ``planning`` is the stack of calls whose rule runs (None where a step
    runs inside it)."""

    def __init__(self) -> None:
        self.planning: list = []
        self.talked: set[str] = set()
        self.undo: list = []

    def install(self) -> None:
        from mesh3d.domain.comm import stopping
        from mesh3d.domain.dispatch import dispatcher, executor
        from mesh3d.domain.dispatch.registry import op_name

        post, checked, run_parts = stopping.post, dispatcher._run_rule_checked, executor.run_parts

        def watched_post(comm, outgoing, incoming):
            if self.planning and self.planning[-1] is not None and (outgoing or incoming):
                self.talked.add(op_name(self.planning[-1]))
            return post(comm, outgoing, incoming)

        def watched_rule(func, rule, lead, args, kwargs, journal):
            def planning(*a, **k):
                self.planning.append(func)
                try:
                    return rule(*a, **k)
                finally:
                    self.planning.pop()
            return checked(func, planning, lead, args, kwargs, journal)

        def watched_step(*a, **k):
            self.planning.append(None)
            try:
                return run_parts(*a, **k)
            finally:
                self.planning.pop()

        # NOTE: ``post`` is imported by name where it is called: each such module's binding is watched
        for module in [m for name, m in sys.modules.items() if name.startswith("mesh3d.domain")]:
            if getattr(module, "post", None) is post:
                self._set(module, "post", watched_post)
        self._set(dispatcher, "_run_rule_checked", watched_rule)
        self._set(executor, "run_parts", watched_step)

    def _set(self, module, name, value) -> None:
        self.undo.append((module, name, getattr(module, name)))
        setattr(module, name, value)

    def remove(self) -> None:
        for module, name, value in reversed(self.undo):
            setattr(module, name, value)
