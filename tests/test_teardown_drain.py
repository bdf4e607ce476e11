"""The teardown's drain posts one barrier on every distinct gloo backend it is given (mesh3d/teardown.py).

A group skipped on one rank and not on its peer leaves the peer's barrier waiting out the whole drain timeout: that
was a ``DistributedManager.shutdown()`` taking 60 s about once in twenty after a background save, because the drain
compared the ids of backend wrappers it had already dropped, and Python gives a freed object's id to the next one.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from mesh3d.teardown import Teardown


def _barriers_posted(count: int) -> tuple[list[int], int]:
    groups = [dist.new_group([0], backend="gloo") for _ in range(count)]
    try:
        late = Teardown.drain(groups + groups[:2], timedelta(seconds=30))  # two of them given twice
        # NOTE: a group's sequence number counts the collectives posted on it (the barrier is one)
        return [group._get_sequence_number_for_group() for group in groups], len(late)
    finally:
        for group in groups:
            dist.destroy_process_group(group)


def test_drain_posts_one_barrier_on_each_distinct_backend_however_python_reuses_ids(ranks):
    # NOTE: with the ids of dropped wrappers compared, four of six fresh groups went without their barrier
    assert ranks.run(1, _barriers_posted, 6) == [([1] * 6, 0)]
