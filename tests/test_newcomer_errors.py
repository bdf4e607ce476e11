"""The five mistakes a newcomer most likely makes, each tried for real: the error must say what is
wrong and how to fix it (docs/troubleshooting.md quotes these messages).

1. sizes that do not fit the world, 2. forgetting ``DistributedManager.initialize``, 3. a typo in a
plan pattern, 4. a shard smaller than a conv's halo (not an error in mesh3d: it must just work, and
the related mistake, explicit sizes that do not add up, must be refused), 5. loading a checkpoint
into the wrong model.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from launch_helpers import clean_env, free_port



def _wrong_sizes_body():
    from mesh3d import DistributedManager

    try:
        DistributedManager.initialize(batch=3, domain=1, model=1)
    except ValueError as e:
        return str(e)
    return None


def test_1_sizes_that_do_not_fit_the_world(ranks):
    for message in ranks.run(4, _wrong_sizes_body, timeout=30):
        assert message is not None
        assert "batch=3" in message and "world size 4" in message  # what is wrong
        assert "1, 2, 4" in message                                   # what would be right


def test_2_forgetting_to_initialize():
    from mesh3d import DistributedManager, Plan, parallelize

    with pytest.raises(RuntimeError, match=r"call DistributedManager.initialize\(batch=..., domain=..., model=...\) first"):
        parallelize(nn.Linear(2, 2), Plan())
    # Under a launcher, domain tensors and checkpoints refuse too, instead of each rank acting alone.
    code = ("import torch\nfrom mesh3d import domain\n"
            "try:\n    domain.shard(torch.zeros(1, 1, 4, 4), dim=2)\nexcept RuntimeError as e:\n    print(e)")
    env = clean_env(RANK="1", WORLD_SIZE="4", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60).stdout
    assert "rank 1 of 4" in out and "DistributedManager.initialize(" in out and "call it first" in out, out
    assert not DistributedManager.is_initialized()


def _typo_body():
    from mesh3d import DistributedManager, Plan, parallelize

    DistributedManager.initialize(batch=1, domain=1, model=2)
    model = nn.Sequential()
    model.add_module("mlp", nn.Sequential())
    model.mlp.add_module("up_proj", nn.Linear(4, 8))
    model.mlp.add_module("down_proj", nn.Linear(8, 4))
    try:
        parallelize(model, Plan(model={"mlp.up_porj": "colwise", "mlp.down_proj": "rowwise"}))
    except ValueError as e:
        return str(e)
    return None


def test_3_plan_pattern_typo(ranks):
    for message in ranks.run(2, _typo_body, timeout=30):
        assert message is not None
        assert "'mlp.up_porj' matches no module" in message and "mlp.up_proj" in message, message


def _small_shard_body():
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=4)
    torch.manual_seed(0)
    conv = nn.Conv2d(1, 2, 7, padding=3).double()         # halo of 3 rows each side
    x = torch.randn(1, 1, 9, 5, dtype=torch.float64)
    ys = conv(domain.shard(x, dim=2, sizes=(1, 1, 2, 5)))  # shards of 1 row: smaller than the halo
    err = float((ys.full_tensor().to_local() - conv(x)).abs().max())
    try:
        domain.shard(x, dim=2, sizes=(1, 1, 2, 4))
    except ValueError as e:
        return err, str(e)
    return err, None


def test_4_shards_smaller_than_the_halo_just_work_and_bad_sizes_are_refused(ranks):
    for err, message in ranks.run(4, _small_shard_body, timeout=30):
        assert err < 1e-12
        assert message is not None and "(1, 1, 2, 4)" in message and "9" in message, message


def test_5_loading_a_checkpoint_into_the_wrong_model(tmp_path):
    from mesh3d import checkpoint
    from mesh3d.checkpoint import CheckpointError

    saved = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    checkpoint.save(tmp_path / "ck", saved)
    wider = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with pytest.raises(CheckpointError, match=r"'2.weight': checkpoint has shape \[2, 8\], the model has \[3, 8\].*mesh3d ckpt inspect"):
        checkpoint.load(tmp_path / "ck", wider)
    other = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint \['1.bias', '1.weight'\].*pass strict=False"):
        checkpoint.load(tmp_path / "ck", other)
    with pytest.raises(CheckpointError, match=r"checkpoint has dtype F32, the model has F64 \(cast the model"):
        checkpoint.load(tmp_path / "ck", saved.double())
