"""Rules declare; the executor talks (issue 66): the watch that holds rules to it sees a rule that talks.

The layout sweep (``test_domain_layout_sweep.py``) runs every rule on every layout under ``rule_watch.RuleWatch``: a
rule that posts a message to another rank while it plans, and is not listed in ``rule_watch.STILL_TALKING`` for that
layout, fails there, and so does a listed rule that stopped. Here, the watch itself: a rule registered for the test that
all-reduces in its body is seen; the same value combined by a declared partial result (``step.Partial``) is not, nor is
a halo exchange the executor runs for a rule's step; and the watch leaves nothing patched behind.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _watch_body():
    from rule_watch import RuleWatch

    from mesh3d import DistributedManager, domain
    from mesh3d.domain.comm import stopping
    from mesh3d.domain.comm.collectives import reduce_to_replicated
    from mesh3d.domain.core.specs import DomainSpec
    from mesh3d.domain.dispatch import dispatcher, executor
    from mesh3d.domain.dispatch.kept import KEPT
    from mesh3d.domain.dispatch.registry import RULES
    from mesh3d.domain.dispatch.step import Partial, Step

    DistributedManager.initialize(batch=1, domain=3)
    x = torch.arange(2 * 3 * 7 * 4, dtype=torch.float64).view(2, 3, 7, 4)
    before = (stopping.post, dispatcher._run_rule_checked, executor.run_parts)
    seen, values, saved = {}, {}, RULES.snapshot()
    watch = RuleWatch()
    watch.install()
    try:
        with KEPT.off():
            @domain.register(F.softsign, override=True)
            def _talking(t):
                total = reduce_to_replicated(t.to_local().sum(), t.spec.comm)
                return Step(lambda v: total.detach().expand(()), (t,), out=DomainSpec.replicated(t.spec.comm))

            @domain.register(F.softplus, override=True)
            def _declaring(t, beta=1.0, threshold=20.0):
                return Step(lambda v: v.sum(), (t,), out=DomainSpec.replicated(t.spec.comm), partial=Partial("sum"))

            for name, call in (("talking", F.softsign), ("declaring", F.softplus),
                               ("halo", lambda t: F.avg_pool2d(t, 3, 1, 1))):
                watch.talked.clear()
                out = call(domain.shard(x, dim=2, sizes=(3, 0, 4)))
                seen[name] = sorted(watch.talked)
                values[name] = out.full_tensor() if isinstance(out, domain.DomainTensor) else out
    finally:
        watch.remove()
        RULES.restore(saved)
    after = (stopping.post, dispatcher._run_rule_checked, executor.run_parts)
    return seen, {k: float(v.sum()) for k, v in values.items()}, all(a is b for a, b in zip(before, after))


def test_the_watch_sees_a_rule_that_talks_and_not_one_that_declares(ranks):
    x = torch.arange(2 * 3 * 7 * 4, dtype=torch.float64).view(2, 3, 7, 4)
    for seen, sums, restored in ranks.run(3, _watch_body, timeout=120):
        assert seen == {"talking": ["torch.nn.functional.softsign"], "declaring": [], "halo": []}, seen
        assert sums["talking"] == sums["declaring"] == float(x.sum()), sums  # both rules gave the whole sum
        assert abs(sums["halo"] - float(F.avg_pool2d(x, 3, 1, 1).sum())) < 1e-9, sums
        assert restored


def _nested_refusal_body():
    """``torch.all`` over one of two block dims on a 2x1 grid: its composite's ``torch.sum`` refuses on every rank."""
    from mesh3d import DistributedManager, domain
    from mesh3d.domain.dispatch import executor

    DistributedManager.initialize(batch=1, domain=(2, 1))
    xs = domain.shard(torch.randn(2, 3, 7, 5, dtype=torch.float64), dims=(2, 3), sizes=((4, 3), (5,)))
    told, report = [], executor.report_failure

    def counted(comm, op, err, *args):
        told.append(op)
        return report(comm, op, err, *args)

    executor.report_failure = counted
    try:
        torch.all(xs, dim=2)
    except NotImplementedError as err:
        return told, str(err)
    finally:
        executor.report_failure = report
    return told, None


def test_a_refusal_inside_a_composite_is_told_once_naming_the_op_called(ranks):
    """The peers are told of a failure once, by the dispatcher around the op the user called, not again by each op its
    rule composes (a rule never talks, its refusals included; it was told twice, the first naming ``torch.sum``)."""
    for told, message in ranks.run(2, _nested_refusal_body, timeout=120):
        assert message is not None and "block" in message, message  # refused by name, on every rank
        assert told == ["torch.all"], told


def _combining_body(sizes):
    """A rule of the user's (``domain.register``): values centred on their mean over the sharded dim, the mean a
    statistic its step's compute asks the executor for (``domain.Combining``); forward and gradient."""
    from rule_watch import RuleWatch

    from mesh3d import DistributedManager, domain
    from mesh3d.domain.dispatch.registry import RULES

    DistributedManager.initialize(batch=1, domain=len(sizes))
    x = torch.linspace(-2, 3, 2 * 3 * sum(sizes) * 4, dtype=torch.float64).view(2, 3, sum(sizes), 4) ** 2
    saved, watch = RULES.snapshot(), RuleWatch()
    watch.install()
    try:
        @domain.register(F.softsign, override=True)
        def _centred(t):
            spec, n = t.spec, t.global_shape[t.spec.dim]

            def compute(local, combine):
                return local - combine(local.sum(spec.dim, keepdim=True), for_shards=True) / n
            return domain.Step(compute, (t, domain.Combining(spec.comm)), out=spec)

        xs = domain.shard(x, dim=2, sizes=sizes).requires_grad_()
        out = F.softsign(xs)
        (out * out * out).sum().backward()
        grad = xs.grad.full_tensor() if isinstance(xs.grad, domain.DomainTensor) else xs.grad
        return out.full_tensor(), grad, sorted(watch.talked)
    finally:
        watch.remove()
        RULES.restore(saved)


def test_a_users_rule_combines_a_statistic_through_the_executor_as_one_process(ranks):
    """``domain.Combining``: the executor combines what a step's compute asks for (uneven ranks, an empty one), the
    value and its gradient as one process; the rule posts nothing while it plans."""
    x = torch.linspace(-2, 3, 2 * 3 * 8 * 4, dtype=torch.float64).view(2, 3, 8, 4) ** 2
    x.requires_grad_(True)
    ref = x - x.mean(2, keepdim=True)
    (ref * ref * ref).sum().backward()
    for sizes in ((5, 0, 3), (8,)):
        for out, grad, talked in ranks.run(len(sizes), _combining_body, sizes, timeout=120):
            torch.testing.assert_close(out, ref.detach(), rtol=0, atol=1e-12)
            torch.testing.assert_close(grad, x.grad, rtol=0, atol=1e-12)
            assert talked == [], talked
