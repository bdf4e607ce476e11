"""Tests of the multi-rank harness itself: results, failures, hangs and deaths are reported right."""

from __future__ import annotations

import os
import time

import pytest

from rankpool import RankFailure, RankTimeout


def _rank_and_world():
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def _all_reduce_rank_sum():
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank(bad_rank):
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom from rank {bad_rank}")
    return "fine"


def _hang_on_rank(bad_rank, hang_s):
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        time.sleep(hang_s)  # a rank stuck here must not hang the suite
        return "woke up"  # the pool waited the whole hang out: the test sees this instead of a RankTimeout
    return "fine"


def _exit_on_rank(bad_rank):
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        os._exit(3)
    return "fine"


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_each_rank_returns_its_result(ranks, world_size):
    assert ranks.run(world_size, _rank_and_world) == [(r, world_size) for r in range(world_size)]
    expected = float(sum(range(world_size)))
    assert ranks.run(world_size, _all_reduce_rank_sum) == [expected] * world_size


def test_failing_rank_reports_its_traceback_and_pool_recovers(ranks):
    with pytest.raises(RankFailure) as info:
        ranks.run(4, _fail_on_rank, 2)
    message = str(info.value)
    assert "failed on 1 of 4 ranks" in message
    assert "--- rank 2 ---" in message and "ValueError: boom from rank 2" in message
    assert "--- rank 0 ---" not in message
    assert ranks.run(4, _all_reduce_rank_sum) == [6.0] * 4


def test_hanging_rank_times_out_with_its_stack_and_pool_recovers(ranks):
    # The hang (300 s) outlasts the timeout (3 s) by far: a pool that did not stop waiting would return results.
    with pytest.raises(RankTimeout) as info:
        ranks.run(2, _hang_on_rank, 1, 300, timeout=3)
    message = str(info.value)
    assert "timed out after 3.0 s on 2 ranks" in message and "ranks [1] did not answer (ranks [0] did)" in message
    assert "_hang_on_rank" in message, "the hung rank's stack should show where it is stuck"
    assert ranks.run(2, _all_reduce_rank_sum) == [1.0, 1.0]


def test_dead_rank_is_reported_without_waiting_for_timeout(ranks):
    # A pool that did not notice the death would wait for an answer and raise RankTimeout (not RankFailure).
    with pytest.raises(RankFailure) as info:
        ranks.run(2, _exit_on_rank, 0, timeout=60)
    assert "rank 0 died (exit code 3)" in str(info.value)
    assert ranks.run(2, _rank_and_world) == [(0, 2), (1, 2)]
