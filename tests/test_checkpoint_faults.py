"""Fault tests: flipped bytes and truncation in every kind of file, missing files, key /
shape / dtype mismatches, saves (synchronous and background) killed at every stage, and errors
raised on every rank.

A failed load must raise CheckpointError naming the file or tensor, in both load modes; with
``in_place=False`` it must also leave the model untouched (nothing is applied before every read
and checksum succeeded). The default in-place load may have overwritten part of the state, and
its message says so.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import threading
import zlib

import pytest
import torch
import xxhash
from torch import nn

from ckpt_helpers import Net, build, exit_code_of_child, shutdown, synthetic_steps
from mesh3d import checkpoint
from mesh3d.checkpoint import CheckpointError
from mesh3d.checkpoint.chunks import Box
from mesh3d.checkpoint.index import encode_index, read_index
from mesh3d.checkpoint.reader import ShardReader


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net().double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    synthetic_steps(model, opt, range(2))
    return model, opt


def _fresh() -> tuple[nn.Module, torch.optim.Optimizer, dict[str, torch.Tensor]]:
    torch.manual_seed(1)
    model = Net().double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    return model, opt, {k: v.clone() for k, v in model.state_dict().items()}


def _files(path: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


def _assert_load_fails(path: str, match: str | None = None) -> str:
    model, opt, before = _fresh()
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(path, model, opt, in_place=False)
    for k, v in model.state_dict().items():  # all or nothing: never a partial or silent wrong load
        assert torch.equal(v, before[k]), k
    with pytest.raises(CheckpointError) as err_in_place:  # the default: just as loud
        checkpoint.load(path, *_fresh()[:2])
    for message in (str(err.value), str(err_in_place.value)):
        if match:
            assert match in message, message
    return str(err.value)


def test_flipped_bytes_and_truncation_in_every_file(tmp_path):
    model, opt = _trained()
    good = str(tmp_path / "good")
    checkpoint.save(good, model, opt, step=2)
    files = _files(good)
    assert files == ["index.json", "model/r00000-of-00001.safetensors", "optimizer/r00000-of-00001.safetensors"]
    rng = random.Random(0)
    for rel in files:
        file = os.path.join(good, rel)
        data = open(file, "rb").read()
        # Length prefix, JSON header, header padding, tensor data, last byte: 40 positions per file.
        positions = sorted({0, 3, 7, 8, 9, len(data) // 2, len(data) - 1, *rng.sample(range(len(data)), 33)})
        for pos in positions:
            with open(file, "r+b") as f:
                f.seek(pos)
                f.write(bytes([data[pos] ^ 0xFF]))
            _assert_load_fails(good)
            with pytest.raises(CheckpointError):
                checkpoint.verify(good)
            with open(file, "wb") as f:
                f.write(data)
        for size in (0, 4, 8, 100, len(data) // 2, len(data) - 1):
            with open(file, "r+b") as f:
                f.truncate(size)
            message = _assert_load_fails(good)
            assert rel.split("/")[-1] in message, message
            with open(file, "wb") as f:
                f.write(data)
    # After restoring every byte the checkpoint is whole again (the failures were real).
    model2, opt2, _ = _fresh()
    checkpoint.load(good, model2, opt2)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))


def test_missing_file_mismatches_and_bad_requests(tmp_path):
    model, opt = _trained()
    path = str(tmp_path / "ck")
    checkpoint.save(path, model, opt, step=2, extra={"note": "x"})
    broken = str(tmp_path / "broken")
    shutil.copytree(path, broken)
    os.remove(os.path.join(broken, "model/r00000-of-00001.safetensors"))
    _assert_load_fails(broken, "missing shard file")
    _assert_load_fails(str(tmp_path / "nowhere"), "checkpoint directory '" + str(tmp_path / "nowhere") + "' does not exist")
    os.makedirs(tmp_path / "empty")
    _assert_load_fails(str(tmp_path / "empty"), "index.json does not exist")  # a directory, but no checkpoint
    flipped = str(tmp_path / "flipped")
    shutil.copytree(path, flipped)
    shard = os.path.join(flipped, "optimizer/r00000-of-00001.safetensors")
    data = bytearray(open(shard, "rb").read())
    data[-5] ^= 0x01  # a single bit, in the last optimizer tensor
    open(shard, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch in .*optimizer/r00000-of-00001.safetensors for tensor"):
        checkpoint.load(flipped, *_fresh()[:2], in_place=True)  # in place: still loud, on every rank

    class Bigger(Net):
        def __init__(self):
            super().__init__()
            self.extra_layer = nn.Linear(2, 2)

    with pytest.raises(CheckpointError, match=r"missing from the checkpoint \['extra_layer.bias', 'extra_layer.weight'\]"):
        checkpoint.load(path, Bigger().double())
    relaxed = Bigger().double()
    info = checkpoint.load(path, relaxed, strict=False)
    assert info.missing == ["extra_layer.bias", "extra_layer.weight"]
    assert torch.equal(relaxed.up.weight, model.up.weight)
    small = nn.Module()
    small.up = nn.Linear(6, 10).double()
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint \[\], unexpected in the checkpoint \['counts', 'down.bias'"):
        checkpoint.load(path, small)
    checkpoint.load(path, small, strict=False)
    assert torch.equal(small.up.weight, model.up.weight)
    wrong_shape = Net().double()
    wrong_shape.emb = nn.Embedding(14, 6).double()
    with pytest.raises(CheckpointError, match=r"tensor 'emb.weight': checkpoint has shape \[13, 6\], the model has \[14, 6\]"):
        checkpoint.load(path, wrong_shape)
    with pytest.raises(CheckpointError, match=r"tensor 'emb.weight': checkpoint has dtype F64, the model has F32"):
        checkpoint.load(path, Net())
    with pytest.raises(CheckpointError, match="already exists"):
        checkpoint.save(path, model)
    with pytest.raises(CheckpointError, match="JSON-serializable"):
        checkpoint.save(str(tmp_path / "other"), model, extra={"bad": object()})
    assert not os.path.exists(tmp_path / "other") and sorted(os.listdir(tmp_path)) == ["broken", "ck", "empty", "flipped"]


def _downgrade_to_version_1(path: str) -> None:
    """Rewrite a checkpoint's index in format version 1 (per-block zlib.crc32 integers), as older mesh3d wrote it."""
    doc = json.load(open(os.path.join(path, "index.json")))
    block = doc.pop("checksum_block_bytes")
    assert doc.pop("checksum") == "xxh3_64" and doc.pop("index_crc32") is not None
    for entry in doc["tensors"].values():
        for chunk in entry["chunks"]:
            b, e = chunk["data_offsets"]
            data = open(os.path.join(path, chunk["file"]), "rb").read()[b:e]
            del chunk["checksums"]
            chunk["crc32"] = [zlib.crc32(data[i : i + block]) for i in range(0, len(data), block)]
    doc.update(version=1, crc_block_bytes=block)
    open(os.path.join(path, "index.json"), "wb").write(encode_index(doc))


def test_xxh3_index_fields_and_version_1_crc32_checkpoints(tmp_path):
    """Version 2 stores xxh3_64 of each block as 16 hex digits; version-1 (crc32) checkpoints still load.

    512-byte blocks make emb.weight (13x6 fp64, 624 bytes) span two blocks, the last one short,
    so reads stream a checksum across the scatter-read pieces and across block boundaries.
    """
    model, opt = _trained()
    v2 = str(tmp_path / "v2")
    checkpoint.save(v2, model, opt, step=2, checksum_block_bytes=512)
    index = json.load(open(os.path.join(v2, "index.json")))
    assert (index["version"], index["checksum"], index["checksum_block_bytes"]) == (2, "xxh3_64", 512)
    assert "crc_block_bytes" not in index
    for entry in index["tensors"].values():
        for chunk in entry["chunks"]:
            b, e = chunk["data_offsets"]
            data = open(os.path.join(v2, chunk["file"]), "rb").read()[b:e]
            assert "crc32" not in chunk
            assert chunk["checksums"] == [f"{xxhash.xxh3_64_intdigest(data[i : i + 512]):016x}"
                                          for i in range(0, len(data), 512)]
    assert len(index["tensors"]["emb.weight"]["chunks"][0]["checksums"]) == 2
    v1 = str(tmp_path / "v1")
    shutil.copytree(v2, v1)
    _downgrade_to_version_1(v1)
    want = model.state_dict()
    for path, version, algorithm in ((v2, 2, "xxh3_64"), (v1, 1, "crc32")):
        assert f"format version {version} ({algorithm} per 512 B block)" in checkpoint.describe(path)
        checkpoint.verify(path)
        for in_place in (True, False):
            fresh, fresh_opt, _ = _fresh()
            checkpoint.load(path, fresh, fresh_opt, in_place=in_place)
            assert all(torch.equal(v, want[k]) for k, v in fresh.state_dict().items())
        index = read_index(path)
        with ShardReader(path, index) as reader:  # partial boxes: one run across a block edge, and strided runs
            for box in (Box((5, 0), (8, 6)), Box((3, 1), (9, 4)), Box((12, 5), (1, 1))):
                out = torch.empty(box.shape, dtype=torch.float64)
                reader.read_into("emb.weight", box, out)
                (r, c), (nr, nc) = box.offsets, box.shape
                assert torch.equal(out, model.emb.weight.detach()[r : r + nr, c : c + nc])
        shard = os.path.join(path, "model/r00000-of-00001.safetensors")
        pristine = open(shard, "rb").read()
        start = min(c["data_offsets"][0] for e in index["tensors"].values() for c in e["chunks"] if c["file"].startswith("model"))
        for pos in random.Random(version).sample(range(start, len(pristine)), 8):
            data = bytearray(pristine)
            data[pos] ^= 1 << (pos % 8)
            open(shard, "wb").write(bytes(data))
            with pytest.raises(CheckpointError, match="checksum mismatch in .*model/r00000-of-00001.safetensors"):
                checkpoint.verify(path)
        _assert_load_fails(path, "checksum mismatch")
        open(shard, "wb").write(pristine)
        checkpoint.verify(path)


STAGES = ("staged", "mid_shard", "shards_written", "before_index", "index_written", "committed")


def _digest(path: str) -> dict[str, str]:
    return {rel: hashlib.sha256(open(os.path.join(path, rel), "rb").read()).hexdigest() for rel in _files(path)}


def _save_and_crash(target: str, stage: str, mode: str) -> None:
    """In a child process: save step 2 of ``_trained()`` (the state the parent holds too), dying at ``stage``."""
    model, opt = _trained()
    if mode == "sync":
        checkpoint.save(target, model, opt, step=2, stage_hook=lambda s: os._exit(17) if s == stage else None)
        return

    trained_on = threading.Event()

    def die(s: str) -> None:
        if s == "staged":
            trained_on.wait(30)  # the writer starts only once training has changed the state in place
        if s == stage:
            os._exit(17)

    handle = checkpoint.async_save(target, model, opt, step=2, stage_hook=die)
    synthetic_steps(model, opt, range(2, 4))
    trained_on.set()
    handle.wait()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_save_killed_at_every_stage_leaves_nothing_or_a_complete_checkpoint(tmp_path, mode):
    """A child process saves step-2 next to step-1 and dies (os._exit) at each stage of the protocol.

    ``async``: the child starts a background save, trains on, and its writer thread dies at the stage.
    """
    model, opt = _trained()
    root = tmp_path / "run"
    root.mkdir()
    checkpoint.save(str(root / "step-1"), model, opt, step=1)
    before = _digest(str(root / "step-1"))
    for stage in STAGES:
        target = root / f"step-2-{stage}"
        assert exit_code_of_child(_save_and_crash, str(target), stage, mode) == 17, stage
        if stage == "committed":
            fresh = _fresh()[0]
            assert checkpoint.load(str(target), fresh).step == 2
            checkpoint.verify(str(target))  # the state at the call, not the child's later steps:
            assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())
        else:
            assert not os.path.exists(target), stage
        assert _digest(str(root / "step-1")) == before, stage
        checkpoint.verify(str(root / "step-1"))
    leftovers = [n for n in os.listdir(root) if n.startswith(".")]
    assert len(leftovers) == len(STAGES) - 1  # staging garbage only, never at a checkpoint path


def _errors_on_every_rank(root: str) -> list[str]:
    """Bad input seen by one rank only must raise the same error everywhere, without hanging."""
    model, opt = build("fsdp_b2", seed=5)
    rank = torch.distributed.get_rank()
    messages = []
    try:  # only rank 1 passes a non-JSON extra
        checkpoint.save(os.path.join(root, "a"), model, opt, extra={"x": object() if rank == 1 else 1})
    except CheckpointError as err:
        messages.append(str(err))
    checkpoint.save(os.path.join(root, "b"), model, opt)
    torch.distributed.barrier()
    if rank == 0:  # corrupt bytes that only rank 1 reads (its own shard, same mesh)
        file = os.path.join(root, "b", "model", "r00001-of-00002.safetensors")
        data = bytearray(open(file, "rb").read())
        data[-3] ^= 0xFF
        open(file, "wb").write(bytes(data))
    torch.distributed.barrier()
    try:
        checkpoint.load(os.path.join(root, "b"), model, opt)
    except CheckpointError as err:
        messages.append(str(err))
    try:
        checkpoint.load(os.path.join(root, "missing"), model, opt)
    except CheckpointError as err:
        messages.append(str(err))
    shutdown()
    return messages


def test_errors_raise_on_every_rank(ranks, tmp_path):
    results = ranks.run(2, _errors_on_every_rank, str(tmp_path), timeout=60)
    for messages in results:
        assert len(messages) == 3, messages
        assert "rank 1: CheckpointError: extra must be JSON-serializable" in messages[0]
        assert "rank 1: CheckpointError: checksum mismatch in" in messages[1] and "r00001-of-00002" in messages[1]
        assert "missing' does not exist" in messages[2]
    assert not os.path.exists(tmp_path / "a")


def _missing_directory_error(root: str) -> tuple[str, int]:
    import traceback

    from mesh3d import DistributedManager, Plan, parallelize

    DistributedManager.initialize(batch=-1)
    model = parallelize(nn.Linear(4, 4), Plan(batch="fsdp"))
    try:
        checkpoint.load(os.path.join(root, "no", "such", "ckpt"), model)
    except CheckpointError as err:
        shown = "".join(traceback.format_exception_only(err))   # what a traceback ends with: the message and notes
        return shown, len(err.rank_tracebacks)
    return "", 0


def test_a_missing_directory_says_so_in_a_few_lines_on_each_of_four_ranks(ranks, tmp_path):
    for shown, tracebacks in ranks.run(4, _missing_directory_error, str(tmp_path), timeout=60):
        lines = shown.strip().splitlines()
        assert len(lines) <= 5, shown            # not every rank's traceback on every rank (148 lines at 2 ranks before)
        assert "failed on 4 of 4 ranks" in lines[0]
        assert lines[1].strip() == (f"ranks 0-3: CheckpointFormatError: checkpoint directory "
                                    f"'{tmp_path / 'no' / 'such' / 'ckpt'}' does not exist (from {os.getcwd()}); "
                                    "pass the directory checkpoint.save wrote (it holds index.json)"), lines
        assert "Traceback" not in shown and tracebacks == 4   # each rank's traceback kept aside, not printed
