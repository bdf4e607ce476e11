"""Background saves: the staged copy is what lands, byte for byte what ``save`` writes; failures
raise on every rank; retention spares a save being written; a process that exits finishes its save.
Kills at every stage of a background save are in test_checkpoint_faults.py, next to the synchronous ones.

Faults are injected through ``async_save``'s ``stage_hook`` parameter (called on the writer thread
at each stage), not through a module global.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
import torch

from ckpt_helpers import Net, build, full_state, shutdown, synthetic_steps, train_steps
from launch_helpers import clean_env
from mesh3d import checkpoint
from mesh3d.checkpoint import CheckpointError, CheckpointManager


def _files(path: str) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(d, f), path): open(os.path.join(d, f), "rb").read()
            for d, _, fs in os.walk(path) for f in fs}


def _index_without_time(path: str) -> dict:
    doc = json.load(open(os.path.join(path, "index.json")))
    del doc["created_unix"], doc["index_crc32"]  # the only fields that depend on when it was written
    return doc


def _async_equals_sync(root: str, config: str) -> dict[str, torch.Tensor]:
    model, opt = build(config, seed=3)
    train_steps(model, opt, range(2))
    want = full_state(model, opt)
    sync_path, async_path = os.path.join(root, f"sync-{config}"), os.path.join(root, f"async-{config}")
    checkpoint.save(sync_path, model, opt, step=2, extra={"cursor": [2]})
    extra = {"cursor": [2]}
    trained_on = threading.Event()  # the writer starts only once training has changed everything
    handle = checkpoint.async_save(async_path, model, opt, step=2, extra=extra,
                                   stage_hook=lambda s: trained_on.wait(30) if s == "staged" else None)
    extra["cursor"].append(99)  # the caller's objects may change at once too
    train_steps(model, opt, range(2, 4))  # params and optimizer moments change in place
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert not handle.done()
    trained_on.set()
    assert handle.wait() == async_path and handle.done()
    assert not torch.equal(full_state(model, opt)["up.weight"], want["up.weight"])
    if torch.distributed.get_rank() == 0:
        sync_files, async_files = _files(sync_path), _files(async_path)
        assert sorted(sync_files) == sorted(async_files)
        for rel, data in sync_files.items():
            if rel != "index.json":
                assert async_files[rel] == data, rel  # every shard byte for byte
        assert _index_without_time(sync_path) == _index_without_time(async_path)
    shutdown()
    fresh, fresh_opt = build(config, seed=77)
    info = checkpoint.load(async_path, fresh, fresh_opt)
    assert (info.step, info.extra) == (2, {"cursor": [2]})
    got = full_state(fresh, fresh_opt)
    shutdown()
    assert set(got) == set(want)
    return {k: bool(torch.equal(got[k], want[k])) for k in want}


@pytest.mark.parametrize("config", ["fsdp_tp4", "hsdp4"])
def test_async_save_lands_the_staged_copy_and_equals_save_bitwise(ranks, tmp_path, config):
    for per_rank in ranks.run(4, _async_equals_sync, str(tmp_path), config, timeout=120):
        assert per_rank and all(per_rank.values()), per_rank


def _failures(root: str) -> list[str]:
    model, opt = build("fsdp_tp4", seed=5)
    rank = torch.distributed.get_rank()
    messages = []

    def fail_on_rank_2(stage: str) -> None:
        if stage == "shards_written" and rank == 2:
            raise OSError("disk full (injected)")

    handle = checkpoint.async_save(os.path.join(root, "a"), model, opt, stage_hook=fail_on_rank_2)
    try:
        handle.wait()
    except CheckpointError as err:
        messages.append(str(err))
    assert handle.done()

    def fail_mid_shard_on_rank_1(stage: str) -> None:
        if stage == "mid_shard" and rank == 1:
            raise RuntimeError("torn write (injected)")

    checkpoint.async_save(os.path.join(root, "b"), model, opt, stage_hook=fail_mid_shard_on_rank_1)
    try:  # nobody waited: the next save reports it, on every rank, before starting
        checkpoint.save(os.path.join(root, "c"), model, opt)
    except CheckpointError as err:
        messages.append(str(err))
    checkpoint.save(os.path.join(root, "c"), model, opt)  # reported once; the next save works

    def slow(stage: str) -> None:
        if stage == "staged":
            time.sleep(0.3)

    first = checkpoint.async_save(os.path.join(root, "d"), model, opt, stage_hook=slow)
    second = checkpoint.async_save(os.path.join(root, "e"), model, opt)
    messages.append(f"first done when second returned: {first.done()} {os.path.isdir(first.path)}")
    second.wait()
    torch.distributed.barrier()
    messages.append(" ".join(sorted(os.listdir(root))))
    shutdown()
    return messages


def test_writer_failure_raises_on_every_rank_and_saves_queue(ranks, tmp_path):
    for messages in ranks.run(4, _failures, str(tmp_path), timeout=120):
        assert len(messages) == 4, messages
        assert "rank 2: OSError after writing shards: disk full (injected)" in messages[0], messages[0]
        assert "saving" in messages[0] and "/a failed" in messages[0]
        assert "rank 1: RuntimeError while writing shards: torn write (injected)" in messages[1], messages[1]
        assert messages[2] == "first done when second returned: True True"
        assert messages[3] == "c d e", messages[3]  # no a, no b, no staging left behind


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net().double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    synthetic_steps(model, opt, range(2))
    return model, opt


def test_manager_async_retention_spares_the_save_being_written(tmp_path):
    model, opt = _trained()
    root = tmp_path / "run"
    manager = CheckpointManager(str(root), keep_last=1)
    manager.save(model, opt, step=1)
    crashed = root / ".step-00000009.tmp-0123abcd"  # left by a killed save
    crashed.mkdir()
    release, seen = threading.Event(), {}

    def blocked(stage: str) -> None:
        if stage == "shards_written":
            seen["listing"] = sorted(os.listdir(root))
            release.wait(30)

    handle = manager.async_save(model, opt, step=2, stage_hook=blocked)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    synthetic_steps(model, opt, range(2, 3))
    time.sleep(0.2)
    assert not handle.done() and not os.path.exists(handle.path)
    manager._prune(5)  # retention while step 2 is being written: the stale dir goes, the live one stays
    assert os.path.isdir(handle.staging) and not crashed.exists()
    assert manager.steps() == [1] and manager.latest().endswith("step-00000001")
    release.set()
    assert manager.async_save(model, opt, step=3).path.endswith("step-00000003")  # waits for step 2 first
    assert handle.done() and seen["listing"][-1] == "step-00000001"
    manager.wait()
    assert manager.steps() == [3] and manager.latest().endswith("step-00000003")
    assert [n for n in os.listdir(root) if n.startswith(".")] == []
    fresh = Net().double()
    info = manager.load(fresh)
    assert info.step == 3 and all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())
    assert not all(torch.equal(v, want[k]) for k, v in fresh.state_dict().items())


_EXIT_WITH_PENDING_SAVE = textwrap.dedent("""
    import sys, time, torch
    from mesh3d import checkpoint
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32).double()
    checkpoint.async_save(sys.argv[1], model, stage_hook=lambda s: time.sleep(0.5) if s == "staged" else None)
    with torch.no_grad():
        model.weight.zero_()
    print("returned", flush=True)
""")


def _run_script_then_load(script: str, target: str, stdout: str) -> tuple[torch.nn.Module, torch.nn.Module, Any]:
    """Run ``script`` (which saves a seed-0 ``Linear(64, 32)`` to ``target``) in a fresh process that exits normally;
    (the seed-0 model, the checkpoint loaded into another, the load's info)."""
    proc = subprocess.run([sys.executable, "-c", script, target], env=clean_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout == stdout, proc.stderr
    torch.manual_seed(0)
    want = torch.nn.Linear(64, 32).double()
    got = torch.nn.Linear(64, 32).double()
    return want, got, checkpoint.load(target, got)


def test_a_process_that_exits_with_a_pending_save_finishes_it(tmp_path):
    want, got, _ = _run_script_then_load(_EXIT_WITH_PENDING_SAVE, str(tmp_path / "ck"), "returned\n")
    assert torch.equal(got.weight, want.weight) and got.weight.abs().sum() > 0


_SAVE_FROM_ATEXIT = textwrap.dedent("""
    import atexit, sys
    import torch
    from mesh3d import checkpoint
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32).double()
    # atexit handlers run after Python has joined its threads: no new writer thread can be started there
    atexit.register(lambda: print("saving", checkpoint.async_save(sys.argv[1], model, step=7).path == sys.argv[1],
                                  flush=True))
""")


def test_a_save_started_by_an_atexit_handler_is_written_before_the_process_ends(tmp_path):
    want, got, info = _run_script_then_load(_SAVE_FROM_ATEXIT, str(tmp_path / "ck"), "saving True\n")
    assert info.step == 7
    assert torch.equal(got.weight, want.weight) and torch.equal(got.bias, want.bias)


def test_a_failed_staging_copy_fails_the_save_without_leaving_anything(tmp_path):
    from mesh3d.checkpoint.inflight import IN_FLIGHT

    class NoMemory:
        def snapshot(self, tensors):
            raise MemoryError("cannot allocate the host buffer (injected)")

    model, opt = _trained()
    kept, IN_FLIGHT.host = IN_FLIGHT.host, NoMemory()
    try:
        handle = checkpoint.async_save(str(tmp_path / "ck"), model, opt)
    finally:
        IN_FLIGHT.host = kept
    with pytest.raises(CheckpointError, match="MemoryError while staging the state in host memory: cannot allocate"):
        handle.wait()
    assert os.listdir(tmp_path) == []
    checkpoint.save(str(tmp_path / "ck"), model, opt)  # reported once; the next save works


def _shutdown_with_pending_saves(root: str) -> list[str]:
    from mesh3d import DistributedManager

    rank = torch.distributed.get_rank()
    seen = []
    DistributedManager.initialize(batch=2)
    model, opt = _trained()
    handle = checkpoint.async_save(os.path.join(root, "landed"), model, opt, step=1,
                                   stage_hook=lambda s: time.sleep(0.3) if s == "staged" else None)
    DistributedManager.shutdown()  # finishes the save before the groups go
    seen.append(f"{handle.done()} {os.path.isdir(handle.path)}")

    def fail_on_rank_1(stage: str) -> None:
        if stage == "shards_written" and rank == 1:
            raise OSError("disk full (injected)")

    DistributedManager.initialize(batch=2)
    checkpoint.async_save(os.path.join(root, "failed"), model, opt, step=2, stage_hook=fail_on_rank_1)
    try:  # nobody waited for it: shutdown reports it, on every rank, after tearing down
        DistributedManager.shutdown()
        seen.append("shutdown raised nothing")
    except CheckpointError as err:
        seen.append(str(err))
    seen.append(f"initialized after: {DistributedManager.is_initialized()}")
    DistributedManager.initialize(batch=2)  # and a new mesh works
    total = torch.ones(1)
    torch.distributed.all_reduce(total, group=DistributedManager().group("batch"))
    seen.append(f"sum {int(total)}; {' '.join(sorted(os.listdir(root)))}")
    return seen


def test_shutdown_finishes_a_pending_save_and_raises_an_unseen_failure_on_every_rank(ranks, tmp_path):
    for seen in ranks.run(2, _shutdown_with_pending_saves, str(tmp_path), timeout=120):
        assert seen[0] == "True True", seen
        assert "rank 1: OSError after writing shards: disk full (injected)" in seen[1], seen
        assert seen[2:] == ["initialized after: False", "sum 2; landed"], seen


def _commit_under_each_managers_timeout(root: str) -> list[str]:
    from mesh3d import DistributedManager
    from mesh3d._torch_private import default_store, live_process_groups

    rank, store, seen = torch.distributed.get_rank(), default_store(), []
    groups_before = len(live_process_groups())
    DistributedManager.initialize(batch=2, timeout=600)
    model, opt = _trained()
    checkpoint.async_save(os.path.join(root, "first"), model, opt, step=1).wait()  # commits over a 600 s group
    DistributedManager.shutdown()
    seen.append(f"groups left by the first manager: {len(live_process_groups()) - groups_before}")

    def hang_on_rank_1(stage: str) -> None:  # until rank 0 has its verdict (at most 60 s)
        deadline = time.monotonic() + 60
        while stage == "mid_shard" and rank == 1 and time.monotonic() < deadline and store.add("verdict", 0) < 1:
            time.sleep(0.05)

    DistributedManager.initialize(batch=2, timeout=3)
    handle = checkpoint.async_save(os.path.join(root, "second"), model, opt, step=2, stage_hook=hang_on_rank_1)
    try:
        handle.wait()
        seen.append("committed")
    except CheckpointError as err:
        seen.append(str(err))
    finally:
        if rank == 0:  # NOTE: the verdict came from rank 0's own timeout, before rank 1 woke: it names no failure of rank 1
            store.add("verdict", 1)
    try:
        DistributedManager.shutdown()
    except CheckpointError:
        pass
    seen.append(f"groups left by the second manager: {len(live_process_groups()) - groups_before}")
    return seen


def test_a_background_commit_waits_for_the_current_managers_timeout_and_its_group_goes_at_shutdown(ranks, tmp_path):
    """A default group made outside mesh3d outlives each manager: the checkpoint group must not (it carried the first
    manager's 600 s timeout into the second's, whose survivors then waited for the hung rank instead of 3 s)."""
    seen = ranks.run(2, _commit_under_each_managers_timeout, str(tmp_path), timeout=120)
    assert seen[0][0] == seen[1][0] == "groups left by the first manager: 0", seen
    assert "timed out" in seen[0][1].lower() and "rank 1 (batch 1, domain 0, model 0): the likely hang" in seen[0][1]
    assert "while writing shards" not in seen[0][1], seen[0]  # rank 0's own timeout, not rank 1's later failure
    assert seen[0][1].startswith("saving") and "/second failed" in seen[0][1], seen[0]
    assert seen[0][2] == seen[1][2] == "groups left by the second manager: 0", seen
