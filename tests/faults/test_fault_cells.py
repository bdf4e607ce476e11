"""The fault-injection suite: one rank of three is killed, raises or hangs at each point of a step; every survivor
must raise the named error (or, blocked inside a collective, print it and exit with PEER_LOST_EXIT_CODE), and
nothing hangs: the pool's timeout bounds each cell. The documented time bounds are checked by
scripts/bench_faults.py, not here (no wall-clock asserts in tests). See tests/fault_cells.py."""

from __future__ import annotations

import pytest

from fault_cells import ACTIONS, FREEZE, POINTS, check_outcome, run_cell


@pytest.mark.parametrize("action", ACTIONS)
@pytest.mark.parametrize("point", POINTS)
def test_every_survivor_names_the_fault(ranks, tmp_path, point, action):
    outcomes = run_cell(lambda fn, *args, **kw: ranks.run(3, fn, *args, **kw), str(tmp_path), point, action,
                        f"{point}-{action}")
    # NOTE: a cell whose ranks all returned leaves their aftermath in the pool's processes (a victim's writer thread
    # woken from its hang, groups that timed out): the next body, in any order, gets new processes.
    ranks.pool(3).close()
    assert sorted(outcomes) == [0, 2]
    for rank, out in outcomes.items():
        check_outcome(rank, out, action, point)


@pytest.mark.parametrize("point", ["forward", "fsdp"])
def test_every_survivor_names_a_rank_frozen_holding_the_gil(ranks, tmp_path, point):
    """The victim hangs in native code holding the GIL, so its own watch thread cannot beat or say where it waits:
    the survivors still name it (its silence, or their collective's timeout), within the pool's bound."""
    outcomes = run_cell(lambda fn, *args, **kw: ranks.run(3, fn, *args, **kw), str(tmp_path), point, FREEZE,
                        f"{point}-{FREEZE}")
    ranks.pool(3).close()  # as above
    assert sorted(outcomes) == [0, 2]
    for rank, out in outcomes.items():
        check_outcome(rank, out, FREEZE, point)
