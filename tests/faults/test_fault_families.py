"""Fault cells for every collective family on a (2, 2, 1) mesh (tests/fault_families.py): the domain all-reduce, ring
and Ulysses exchanges, FSDP's reduce-scatter, the HSDP and DDP all-reduce, a checkpoint's commit and the background
writer. The victim (rank 3) is killed, raises or hangs; every survivor, two of them on the other batch row, must raise
the named error (or, blocked inside a collective, print it and exit with PEER_LOST_EXIT_CODE), and nothing hangs: the
pool's timeout bounds each cell. No wall-clock asserts (scripts/bench_faults.py measures the bounds)."""

from __future__ import annotations

import pytest

from fault_cells import ACTIONS
from fault_families import POINTS, VICTIM, WORLD, check_family_outcome, run_family_cell


#: A hang waits out the group timeout, the same path for every collective: a point per kind of wait (the domain's
#: point-to-point, a gloo collective over batch x domain, the replicas' all-reduce, the writer thread's commit).
HANGS = ("domain_reduce", "reduce_scatter", "hsdp", "async")
CELLS = [(point, action) for point in POINTS for action in ACTIONS if action != "hang" or point in HANGS]


@pytest.mark.parametrize(("point", "action"), CELLS)
def test_every_survivor_on_either_batch_row_names_the_fault(ranks, tmp_path, point, action):
    outcomes = run_family_cell(lambda fn, *args, **kw: ranks.run(WORLD, fn, *args, **kw), str(tmp_path), point, action,
                               f"{point}-{action}")
    # NOTE: a cell whose ranks all returned leaves their aftermath in the pool's processes (a victim's writer thread
    # woken from its hang, groups that timed out): the next body, in any order, gets new processes.
    ranks.pool(WORLD).close()
    assert sorted(outcomes) == sorted(set(range(WORLD)) - {VICTIM})
    for rank, out in outcomes.items():
        check_family_outcome(rank, out, action)
