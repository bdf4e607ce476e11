"""Domain classes simulated in forked processes (``mesh3d.planner.fanout``, ``mesh3d plan --workers``) give the plan of
one process, figure for figure, and a child's failure is this process's failure or, if the child died, its work.

The bodies run on a rank of the pool, not in pytest's process: the planner forks whoever calls it with ``workers`` > 1,
and pytest's process is never forked (tests/README.md).
"""

from __future__ import annotations

import gc
import os

import torch

from test_plan_splice import CASES

from mesh3d.domain import attention_mode
from mesh3d.planner import plan_job
from mesh3d.planner.fanout import run_each
from mesh3d.planner.repeat import CannotSplice
from mesh3d.planner.simulate import RankSim

_NAMES = ("decoder: fsdp x ring attention over 4 uneven domain ranks x tp2, cuda",
          "conv stack: fsdp over 3 slabs with an empty one", "conv stack: no batch parallelism, 2x2 blocks")


class _CountedFork:
    """``os.fork`` counting its children, so a test knows the work was split."""

    def __init__(self) -> None:
        self.pids: list[int] = []
        self._fork = os.fork

    def __call__(self) -> int:
        pid = self._fork()
        if pid:
            self.pids.append(pid)
        return pid


def _plans(names: tuple[str, ...]) -> list[tuple[dict, dict, int]]:
    out = []
    counted = os.fork = _CountedFork()
    try:
        for name in names:
            case, reports = CASES[name], []
            for workers in (1, 3):
                with attention_mode(case.get("attention", "auto")):
                    job = plan_job(case["model"], case["plan"], case["mesh"], case["inputs"], device=case["device"],
                                   to=case["to"], device_memory=2**30, workers=workers)
                report = job.to_json()
                report.pop("seconds")
                reports.append(report)
            out.append((reports[0], reports[1], len(counted.pids)))
    finally:
        os.fork = counted._fork
    return out


def test_classes_simulated_in_three_processes_plan_as_one_process(ranks):
    for name, (one, three, forks) in zip(_NAMES, ranks.run(1, _plans, _NAMES)[0]):
        assert one == three, name
        assert forks > 0, f"{name}: nothing was forked"
        assert len(one["classes"]) > 1, name


def _sim(i: int) -> RankSim:
    return RankSim(domain_index=i, peak=1000 + i, domain_bytes={"forward": 7 * i})


def _failures() -> dict:
    parent, out, threads = os.getpid(), {}, torch.get_num_threads()
    expected = {i: _sim(i) for i in range(7)}

    def child_raises(i: int) -> RankSim:
        if i == 4 and os.getpid() != parent:
            raise CannotSplice(f"index {i} in a child")
        return _sim(i)

    try:
        run_each(child_raises, range(7), 3)
    except CannotSplice as err:
        out["raised"] = str(err)

    def child_dies(i: int) -> RankSim:
        if i == 5 and os.getpid() != parent:
            os._exit(7)
        return _sim(i)

    out["after_death"] = run_each(child_dies, list(range(7)), 3) == expected

    counted = _CountedFork()
    os.fork = counted
    try:
        def parent_raises(i: int) -> RankSim:
            if os.getpid() == parent and i == 2:  # shares[0] of 2 workers: 0, 2, 4, 6
                raise ValueError("the parent's own share")
            return _sim(i)

        try:
            run_each(parent_raises, list(range(7)), 2)
        except ValueError as err:
            out["parent_raised"] = str(err)
    finally:
        os.fork = counted._fork
    reaped = []
    for pid in counted.pids:
        try:
            os.waitpid(pid, os.WNOHANG)
            reaped.append(False)
        except ChildProcessError:
            reaped.append(True)
    out["reaped"] = reaped
    out["order"] = list(run_each(_sim, [6, 2, 4, 0], 2)) == [6, 2, 4, 0]
    out["threads"] = (torch.get_num_threads(), threads)
    return out


def test_a_child_s_error_is_raised_and_a_dead_child_s_share_is_run_here(ranks):
    """An error in a child's share is raised here, as its type; a child that dies has its share run in this process;
    an error in this process's own share kills and reaps the children; the result keeps the order asked for."""
    out = ranks.run(1, _failures)[0]
    assert out["raised"] == "index 4 in a child"
    assert out["after_death"] is True
    assert out["parent_raised"] == "the parent's own share"
    assert out["reaped"] and all(out["reaped"]), out["reaped"]
    assert out["order"] is True
    assert out["threads"][0] == out["threads"][1]  # the child's one intra-op thread stays the child's


class _FinalizedWhere:
    """An object in a reference cycle (garbage only a collection frees) that writes the pid of whoever finalizes it."""

    def __init__(self, path: str) -> None:
        self.path, self.me = path, self

    def __del__(self) -> None:
        with open(self.path, "a") as out:
            out.write(f"{os.getpid()}\n")


def _parents_garbage(path: str) -> dict:
    from mesh3d.planner.fanout import Forked

    gc.disable()  # NOTE: so the cycle is still garbage, uncollected, when the child is forked
    try:
        _FinalizedWhere(path)
        child = Forked(lambda: (gc.collect(), os.getpid())[1])
        child_pid = child.result()
    finally:
        gc.enable()
    gc.collect()
    with open(path) as f:
        finalized = [int(line) for line in f.read().split()]
    return {"parent": os.getpid(), "child": child_pid, "finalized": finalized}


def test_a_forked_child_never_collects_the_parents_garbage(ranks, tmp_path):
    """A child collecting the parent's garbage ran its finalizers there: a gloo process group left in a cycle waits
    in its destructor on threads the child does not have (a whole test run hung in ``mesh3d plan``). The parent
    finalizes its garbage itself, once; the child's collection leaves it alone."""
    out = ranks.run(1, _parents_garbage, str(tmp_path / "finalized"))[0]
    assert out["child"] != out["parent"]  # the child ran the call (a dead child's work would be run here)
    assert out["finalized"] == [out["parent"]]
