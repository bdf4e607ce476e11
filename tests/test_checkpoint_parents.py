"""``save`` creates the missing parent directories of its path; a path whose parent cannot be
created (it runs through a regular file) is refused on every rank, before anything is written."""

from __future__ import annotations

import os

import torch.distributed as dist

from ckpt_helpers import build, diff, full_state, shutdown


def _save_nested(root: str) -> list[str]:
    from mesh3d import checkpoint
    from mesh3d.checkpoint import CheckpointError

    model, opt = build("fsdp_b2", seed=3)
    want = full_state(model, opt)
    nested = os.path.join(root, "runs", "a", "b", "step-1")
    checkpoint.save(nested, model, opt, step=1)
    fresh, fresh_opt = build("fsdp_b2", seed=4)
    checkpoint.load(nested, fresh, fresh_opt)
    messages = diff(full_state(fresh, fresh_opt), want)
    if dist.get_rank() == 0:
        open(os.path.join(root, "a-file"), "w").close()
    dist.barrier()
    try:
        checkpoint.save(os.path.join(root, "a-file", "sub", "step-2"), model, opt, step=2)
        messages.append("saved under a regular file")
    except CheckpointError as err:
        messages.append(str(err))
    shutdown()
    return messages


def test_save_creates_missing_parents_and_refuses_unusable_ones_on_every_rank(ranks, tmp_path):
    results = ranks.run(2, _save_nested, str(tmp_path), timeout=60)
    for messages in results:
        assert len(messages) == 1, messages  # the nested save loaded back bitwise
        assert messages[0].startswith("saving ") and "rank 0: CheckpointError: cannot create the parent directory" \
            in messages[0], messages[0]
        assert os.path.join(str(tmp_path), "a-file", "sub") in messages[0]
    assert os.path.isfile(tmp_path / "runs" / "a" / "b" / "step-1" / "index.json")
    assert sorted(os.listdir(tmp_path)) == ["a-file", "runs"]  # nothing staged beside the refused path
