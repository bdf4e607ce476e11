"""Coalesce to Hugging Face safetensors and the ``mesh3d ckpt`` CLI.

The coalesced file(s), read back with ``safetensors.torch.load_file``, must equal the
one-process ``state_dict()`` bitwise, for a checkpoint sharded by FSDP x TP on 4 ranks
and for every safetensors dtype (int, bool and fp8 included, which torch's consolidation
crashes on).
"""

from __future__ import annotations

import json
import os

import safetensors.torch
import torch
from torch import nn

from ckpt_helpers import build, full_state, shutdown, synthetic_steps
from mesh3d import checkpoint
from mesh3d.checkpoint.st_format import DTYPES
from mesh3d.cli import main


def _save_sharded(root: str) -> None:
    model, opt = build("fsdp_tp4", seed=21)
    synthetic_steps(model, opt, range(2))
    checkpoint.save(os.path.join(root, "ck"), model, opt, step=2)
    ref = {k: v for k, v in full_state(model, None).items()}
    if torch.distributed.get_rank() == 0:
        safetensors.torch.save_file(ref, os.path.join(root, "ref.safetensors"))
    shutdown()


def test_coalesce_sharded_checkpoint_equals_one_process_state_dict(ranks, tmp_path):
    root = str(tmp_path)
    ranks.run(4, _save_sharded, root)
    want = safetensors.torch.load_file(os.path.join(root, "ref.safetensors"))
    assert checkpoint.coalesce(os.path.join(root, "ck"), os.path.join(root, "hf")) == ["model.safetensors"]
    got = safetensors.torch.load_file(os.path.join(root, "hf", "model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)  # no optimizer state
    with safetensors.safe_open(os.path.join(root, "hf", "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}

    names = checkpoint.coalesce(os.path.join(root, "ck"), os.path.join(root, "hf-split"), max_shard_bytes=600)
    index = json.load(open(os.path.join(root, "hf-split", "model.safetensors.index.json")))
    assert len(names) > 3 and names[-1] == "model.safetensors.index.json"
    assert set(index["weight_map"]) == set(want)
    merged = {}
    for file in set(index["weight_map"].values()):
        merged.update(safetensors.torch.load_file(os.path.join(root, "hf-split", file)))
    assert all(torch.equal(merged[k], want[k]) for k in want) and merged.keys() == want.keys()
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in want.values())

    checkpoint.coalesce(os.path.join(root, "ck"), os.path.join(root, "hf-bf16"), dtype=torch.bfloat16)
    cast = safetensors.torch.load_file(os.path.join(root, "hf-bf16", "model.safetensors"))
    for k, v in want.items():
        expected = v.to(torch.bfloat16) if v.is_floating_point() else v  # int/bool are never cast
        assert torch.equal(cast[k], expected), k


def test_coalesce_every_dtype(tmp_path):
    module = nn.Module()
    for i, (name, dtype) in enumerate(sorted(DTYPES.items())):
        values = torch.arange(-7, 10, dtype=torch.float32).reshape(1, 17) * (i + 1) / 3
        if dtype == torch.bool:
            tensor = values > 0
        elif not (dtype.is_floating_point or dtype.is_complex):
            tensor = values.abs().to(dtype) if name.startswith("U") else values.to(dtype)
        else:
            tensor = values.to(dtype)
        module.register_buffer(f"b_{name.lower()}", tensor.repeat(3, 1))
    checkpoint.save(tmp_path / "ck", module)
    checkpoint.coalesce(tmp_path / "ck", tmp_path / "hf")
    got = safetensors.torch.load_file(tmp_path / "hf" / "model.safetensors")
    want = module.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k


def test_cli_inspect_verify_coalesce(tmp_path, capsys):
    module = nn.Linear(4, 3).double()
    checkpoint.save(tmp_path / "ck", module, step=9, extra={"tag": "cli"})
    assert main(["ckpt", "inspect", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert "step 9" in out and "weight" in out and "[3, 4]" in out and "F64" in out and "'tag': 'cli'" in out
    assert main(["ckpt", "verify", str(tmp_path / "ck")]) == 0
    assert "every element present exactly once" in capsys.readouterr().out
    assert main(["ckpt", "coalesce", str(tmp_path / "ck"), str(tmp_path / "hf"), "--dtype", "f32"]) == 0
    got = safetensors.torch.load_file(tmp_path / "hf" / "model.safetensors")
    assert torch.equal(got["weight"], module.weight.detach().float())
    shard = tmp_path / "ck" / "model" / "r00000-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["ckpt", "verify", str(tmp_path / "ck")]) == 1
    assert "checksum mismatch" in capsys.readouterr().err
    assert main(["ckpt", "coalesce", str(tmp_path / "ck"), str(tmp_path / "hf2")]) == 1
    assert not (tmp_path / "hf2").exists() and [p for p in os.listdir(tmp_path) if p.startswith(".")] == []


def test_manager_latest_and_keep_last(tmp_path):
    from mesh3d.checkpoint import CheckpointManager

    manager = CheckpointManager(tmp_path / "ckpt", keep_last=2)
    module = nn.Linear(3, 2).double()
    assert manager.load(module) is None
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / ".step-00000009.tmp-abc123").mkdir()  # garbage from a killed save
    for step in (1, 2, 3):
        with torch.no_grad():
            module.weight.fill_(step)
        manager.save(module, step=step, extra={"step": step})
    assert manager.steps() == [2, 3] and sorted(os.listdir(tmp_path / "ckpt")) == ["latest", "step-00000002", "step-00000003"]
    fresh = nn.Linear(3, 2).double()
    assert manager.load(fresh).step == 3 and fresh.weight[0, 0].item() == 3.0
    (tmp_path / "ckpt" / "latest").write_text("step-0000")  # a torn pointer falls back to a scan
    assert manager.latest() == str(tmp_path / "ckpt" / "step-00000003")
    os.remove(tmp_path / "ckpt" / "step-00000003" / "index.json")  # uncommitted: not a checkpoint
    assert manager.load(fresh).step == 2
