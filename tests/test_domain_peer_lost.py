"""A domain peer whose process ends mid-step (SIGKILL, as the kernel's out-of-memory killer or a scheduler ends it)
is named as gone on every survivor, not reported as a divergence, and nobody waits for the group timeout: the
survivors next to it see its connection close; the others hear it from them (``mesh3d.domain.comm.peer_lost``)."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch

from rankpool.pool import RankFailure


def _killed_mid_step_body(victim: int, late: int | None = None):
    """Three domain ranks on slabs run two convs; domain rank ``victim`` is SIGKILLed before the first. Domain rank
    ``late`` arrives a second after that, when its transport already knows the connection closed (its posts fail)."""
    from mesh3d import DistributedManager, domain

    dm = DistributedManager.initialize(batch=1, domain=-1)  # the default group timeout (minutes): nobody waits it out
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3, padding=1), torch.nn.Conv2d(2, 1, 3, padding=1))
    xs = domain.shard(torch.randn(1, 1, 12, 5), dim=2)
    if dm.axis_rank("domain") == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    if dm.axis_rank("domain") == late:
        time.sleep(1.0)
    net(xs).sum().backward()


def _outputs(text: str) -> dict[int, str]:
    """Each rank's section of a RankFailure's message."""
    marks = [(m.start(), int(m.group(1))) for m in re.finditer(r"--- rank (\d+)", text)]
    return {rank: text[start:(marks[i + 1][0] if i + 1 < len(marks) else len(text))] for i, (start, rank) in enumerate(marks)}


@pytest.mark.parametrize("victim, late", [(1, None), (2, None), (2, 1)])
def test_a_rank_killed_mid_step_is_named_as_gone_on_every_survivor(ranks, victim, late):
    """Victim 1: both survivors border it. Victim 2: domain rank 1 sees it go and tells domain rank 0, which has
    no exchange with it (rank 0 learns at its next exchange with rank 1). Late 1: domain rank 1's posts to the
    victim fail at once (gloo raises at the post, not at the wait); it is named as gone all the same (it once let
    gloo's own error escape on both survivors, one run in ten)."""
    with pytest.raises(RankFailure) as failure:
        ranks.run(3, _killed_mid_step_body, victim, late, timeout=120)
    sections = _outputs(str(failure.value))
    assert "died" in sections[victim] and "signal" in sections[victim].lower() or "-9" in sections[victim], sections[victim]
    for rank in set(range(3)) - {victim}:
        text = sections[rank]
        assert f"DomainPeerLostError: rank {victim} (batch 0, domain {victim}, model 0) is gone" \
            in text, text
        assert "DomainDivergenceError" not in text, text
        assert "restart the job from its latest complete checkpoint" in text, text
        told = victim == 2 and rank == 0
        assert ("domain rank 1 saw its connection close" in text) == told, text
        assert ("its connection closed while this rank" in text) == (not told), text


def _ended_after_an_earlier_loss_body():
    """Domain rank 2 fails inside a guard (its watch announces it); domain rank 1 ends its own process once it hears
    that (as a survivor blocked in a collective with a lost rank does: mesh3d/faults/watch.py); domain rank 0, in an
    exchange with rank 1, sees rank 1's connection close."""
    from mesh3d import DistributedManager, WatchSettings, domain
    from mesh3d.faults.attach import WATCH

    dm = DistributedManager.initialize(batch=1, domain=3, watch=WatchSettings(interval=0.25, suspect_after=1.0,
                                                                                   dead_after=4.0, grace=30.0))
    torch.manual_seed(0)
    net = torch.nn.Conv2d(1, 1, 3, padding=1)
    xs = domain.shard(torch.randn(1, 1, 12, 5), dim=2)
    me = dm.axis_rank("domain")
    if me == 2:
        with dm.guard("a step"):
            raise RuntimeError("rank 2's own failure")
    if me == 1:
        deadline = time.monotonic() + 60
        while 2 not in WATCH.current.lost and time.monotonic() < deadline:  # its watch thread read the announcement
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    net(xs).sum().backward()


def test_a_peer_that_ended_after_an_earlier_loss_is_named_with_that_loss_first(ranks):
    """The rank lost first is the cause of what followed: domain rank 0 names rank 1 as gone and rank 2's failure
    before it, whether or not its own watch thread had read rank 2's announcement yet (it reads it then)."""
    with pytest.raises(RankFailure) as failure:
        ranks.run(3, _ended_after_an_earlier_loss_body, timeout=120)
    text = _outputs(str(failure.value))[0]
    assert "DomainPeerLostError: rank 1 (batch 0, domain 1, model 0) is gone" in text, text
    assert re.search(r"Lost before it: rank 2 \(batch 0, domain 2, model 0\), failed with RuntimeError: rank 2's own "
                     r"failure", text), text
