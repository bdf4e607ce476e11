"""One report per cause (mesh3d/faults/summary.py): an error every rank shares is printed once, by the lowest of its
ranks, with the line of the user's code it came from; the others print nothing; an error of one rank keeps Python's
report; torchrun's report reads the cause from the error file. In-process: the hook is called as Python calls it."""

from __future__ import annotations

import io
import sys

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from mesh3d.faults.summary import ErrorSummary, mark_shared, ranks_text, shared_ranks


def _raise_from_here(err: BaseException):
    raise err  # the user's line the report names


def _hook_output(rank: int, world: int, err: BaseException, monkeypatch, tmp_path) -> tuple[str, list]:
    try:
        _raise_from_here(err)
    except BaseException as caught:
        value, tb = caught, caught.__traceback__
    hook, previous = ErrorSummary(), []
    hook.rank, hook.world_size = rank, world
    hook._previous = lambda *args: previous.append(args)
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / f"error{rank}.json"))
    monkeypatch.delenv("MESH3D_TRACEBACK", raising=False)
    hook(type(value), value, tb)
    return stderr.getvalue(), previous


def test_the_lowest_shared_rank_prints_the_cause_once_with_the_users_line(monkeypatch, tmp_path):
    err = mark_shared(ValueError("batch=3 does not divide world size 4; launch 3 processes"), range(4))
    text, previous = _hook_output(0, 4, err, monkeypatch, tmp_path)
    lines = text.splitlines()
    assert lines[0] == "mesh3d: error on ranks 0-3: ValueError: batch=3 does not divide world size 4; launch 3 processes"
    assert "test_error_summary.py line" in lines[1] and "raise err  # the user's line" in lines[1], text
    assert "MESH3D_TRACEBACK=1" in lines[2] and len(lines) == 3 and previous == []
    # torchrun's own reader of the error file finds the cause (its report prints it instead of a link)
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(tmp_path / "error0.json"))
    assert failure.message["message"] == lines[0]


def test_the_other_ranks_print_nothing_and_an_unshared_error_keeps_pythons_report(monkeypatch, tmp_path):
    err = mark_shared(RuntimeError("same everywhere"), [0, 1, 2])
    text, previous = _hook_output(2, 3, err, monkeypatch, tmp_path)
    assert text == "" and previous == [] and not (tmp_path / "error2.json").exists()
    own = RuntimeError("only mine")
    text, previous = _hook_output(1, 3, own, monkeypatch, tmp_path)
    assert text == "" and len(previous) == 1 and previous[0][1] is own
    monkeypatch.setenv("MESH3D_TRACEBACK", "1")  # every rank's traceback, as Python prints it
    hook = ErrorSummary()
    hook.rank, hook.world_size, seen = 2, 3, []
    hook._previous = lambda *args: seen.append(args)
    hook(RuntimeError, err, None)
    assert len(seen) == 1


def test_a_shared_cause_is_found_through_the_errors_raised_from_it():
    inner = mark_shared(KeyError("x"), [3, 1, 2])
    try:
        try:
            raise inner
        except KeyError as e:
            raise RuntimeError("wrapped") from e
    except RuntimeError as outer:
        assert shared_ranks(outer) == (1, 2, 3)
    assert shared_ranks(RuntimeError()) is None


@pytest.mark.parametrize("ranks, text", [([3], "rank 3"), ([0, 1], "ranks 0, 1"), ([0, 1, 2, 5], "ranks 0-2, 5"),
                                         ([7, 0, 2, 1, 8], "ranks 0-2, 7, 8")])
def test_ranks_are_named_in_runs(ranks, text):
    assert ranks_text(ranks) == text
