"""Rules declare; the executor talks (issue 66): no rule posts a message to another rank while it plans.

A rule returns a ``Step``: its exchanges are requirements the executor resolves, and its partial results are declared
(``step.Partial``) and combined by the executor. Rules written before that contract still combine inside their own body
(a whole gathered by an all-reduce, then torch's op on it); they are listed here (``STILL_TALKING``) and the list only
shrinks: a rule that starts talking while it plans fails this test, and so does a listed rule that stopped (take it
off the list).

How it is seen: every ruled slab call of the layout sweep (``layout_cases.calls``) runs on 3 real ranks with an empty
shard, the kept path off (so every call plans), with the one point where messages are posted (``comm.stopping.post``)
watched: a message posted while a rule is planning, and not inside a step the executor runs for it, names that rule. A
rule registered for the test that all-reduces in its body is seen (the watch can fail).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

#: Slab rules that still post messages while they plan (issue 66 item 2: each becomes a step with its exchange as a
#: requirement or its partial result declared). Only ever remove names.
STILL_TALKING = frozenset({
    # the sampled rows gathered by what the grid reads; attention's ring
    "torch.nn.functional.grid_sample", "torch.scaled_dot_product_attention",
})


class _Watch:
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


def _talkers_body(sizes):
    from layout_cases import calls

    from mesh3d import DistributedManager, domain
    from mesh3d.domain.comm.collectives import reduce_to_replicated
    from mesh3d.domain.dispatch.kept import KEPT
    from mesh3d.domain.dispatch.registry import RULES, op_name
    from mesh3d.domain.dispatch.step import Step

    DistributedManager.initialize(batch=1, domain=len(sizes))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, sum(sizes), 4, dtype=torch.float64, generator=g)
    y = torch.randn(2, 3, sum(sizes), 4, dtype=torch.float64, generator=g).abs() + 0.5
    watch, saved = _Watch(), RULES.snapshot()
    watch.install()
    try:
        with KEPT.off():
            for func in sorted(RULES, key=op_name):
                for call in calls(func, x, y, 2):
                    try:
                        call(x.clone(), y.clone())
                    except Exception:  # noqa: BLE001  (not a call this function takes)
                        continue
                    failed = torch.tensor([0])
                    try:
                        call(domain.shard(x.clone(), dim=2, sizes=sizes), domain.shard(y.clone(), dim=2, sizes=sizes))
                    except Exception:  # noqa: BLE001  (refused alike on every rank, or failed here: started afresh)
                        failed[0] = 1
                    dist.all_reduce(failed)
                    if int(failed):  # NOTE: a rank that failed alone leaves notices in flight: start the mesh afresh
                        DistributedManager.shutdown()
                        DistributedManager.initialize(batch=1, domain=len(sizes))
            swept = set(watch.talked)
            watch.talked.clear()

            @domain.register(F.softsign, override=True)
            def _talking(t):  # the control: a rule that all-reduces in its body
                total = reduce_to_replicated(t.to_local().sum(), t.spec.comm)
                return Step(lambda v: v * 0.0 + total.detach(), (t,), out=t.spec)

            F.softsign(domain.shard(x, dim=2, sizes=sizes))
            control = set(watch.talked)
    finally:
        watch.remove()
        RULES.restore(saved)
    return swept, control


def test_no_rule_posts_a_message_while_it_plans_but_those_listed(ranks):
    for swept, control in ranks.run(3, _talkers_body, (3, 0, 4), timeout=600):
        assert control == {"torch.nn.functional.softsign"}, control  # the watch sees a rule that talks
        assert swept - STILL_TALKING == set(), f"rules that now talk while they plan: {sorted(swept - STILL_TALKING)}"
        assert STILL_TALKING - swept == set(), f"rules that stopped talking (take them off): {sorted(STILL_TALKING - swept)}"
