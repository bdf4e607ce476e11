"""Preemption and restarts resume exactly: every step's loss and the final parameters equal one uninterrupted
process (fp64), in real processes (tests/preempt_job.py).

* A stop signal (SIGUSR1) delivered to one rank of two: both save the same step with the data cursor, through
  ``CheckpointManager.maybe_save``, and exit with status 75; a second launch resumes from ``latest`` and finishes.
* ``torchrun --max-restarts 2``: a rank SIGKILLed in the middle of writing a checkpoint; torchrun restarts the job,
  which finds the latest *complete* checkpoint by itself (the partial one is never chosen) and finishes.

Each launch is bounded by a timeout; nothing is timed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from launch_helpers import clean_env, run, run_on_free_port
from preempt_job import STEPS, Field, loader, step
from mesh3d import PREEMPTED_EXIT_CODE
from mesh3d.parallel.init import capture_init_specs, materialize
from mesh3d.preempt import STOP, parse_signals

JOB = str(Path(__file__).with_name("preempt_job.py"))


def _uninterrupted() -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same STEPS steps in one process: MeshSampler's global batches, the weights ``parallelize`` draws."""
    torch.set_default_dtype(torch.float64)
    try:
        with torch.device("meta"):
            model = Field()
        materialize(model, capture_init_specs(model), seed=0, init_fn=None, device=torch.device("cpu"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses: list[float] = []
        for batch in loader():
            losses.append(step(model, opt, batch, sharded=False))
            if len(losses) == STEPS:
                break
        return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        torch.set_default_dtype(torch.float32)


def _assert_equals_uninterrupted(out: Path, final: str) -> list[dict]:
    log = [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]
    losses, params = _uninterrupted()
    for entry in log:
        want = losses[entry["step"]]
        assert abs(entry["loss"] - want) <= 1e-12 * abs(want), (entry, want)
    got = load_file(str(out / final))
    assert sorted(got) == sorted(params)
    for name, want in params.items():
        torch.testing.assert_close(got[name], want, rtol=1e-12, atol=1e-14)
    return log


def _plain(mode: str, out: Path):
    """Two plain processes (RANK, WORLD_SIZE, MASTER_ADDR/PORT set by hand, as a job script would)."""
    return run_on_free_port(lambda port: [
        ([sys.executable, JOB, mode, str(out)], clean_env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
        for r in range(2)], timeout=300)


def test_a_stop_signal_to_one_rank_saves_one_step_exits_75_and_the_resumed_run_equals_one_process(tmp_path):
    first = _plain("preempt", tmp_path)
    assert [d.returncode for d in first] == [PREEMPTED_EXIT_CODE] * 2, [d.stderr[-3000:] for d in first]
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert saved == ["latest", "step-00000003"], saved  # one checkpoint, at the step boundary after the signal
    index = json.loads((tmp_path / "ckpt" / "step-00000003" / "index.json").read_text())
    assert index["step"] == 3 and index["data"]["position"] == 3 * 2, index["data"]
    second = _plain("resume", tmp_path)
    assert [d.returncode for d in second] == [0, 0], [d.stderr[-3000:] for d in second]
    log = _assert_equals_uninterrupted(tmp_path, "final-resume.safetensors")
    assert [(e["mode"], e["step"]) for e in log] == [("preempt", s) for s in range(3)] + [("resume", s) for s in (3, 4, 5)]


def test_a_rank_killed_mid_save_under_torchrun_max_restarts_resumes_from_the_last_complete_checkpoint(tmp_path):
    done = run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
                "--monitor-interval", "0.5", JOB, "restart", str(tmp_path)], timeout=420)
    assert done.returncode == 0, done.stderr[-4000:]
    log = _assert_equals_uninterrupted(tmp_path, "final-restart.safetensors")
    # The first attempt ran steps 0-3 and died writing step 4; the restart resumed at 2, not at the partial 4.
    assert [(e["attempt"], e["step"]) for e in log] == [(0, s) for s in range(4)] + [(1, s) for s in range(2, 6)]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step-")) == [
        "step-00000002", "step-00000004", "step-00000006"]


def test_stop_signal_names_are_checked_before_anything_starts(monkeypatch):
    assert parse_signals(["usr1", "SIGTERM", 10]) == (parse_signals("SIGUSR1")[0], parse_signals(15)[0])
    monkeypatch.setenv("MESH3D_STOP_SIGNALS", "SIGUSR2, TERM")
    assert [s.name for s in parse_signals(None)] == ["SIGUSR2", "SIGTERM"]
    with pytest.raises(ValueError, match="not a signal name"):
        parse_signals(["SIGNOPE"])
    with pytest.raises(ValueError, match="cannot be caught"):
        parse_signals(["SIGKILL"])
    assert not STOP.requested
