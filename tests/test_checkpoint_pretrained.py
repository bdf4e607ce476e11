"""``checkpoint.load_pretrained``: plain safetensors (one file, an HF index + shards folder) into every layout.

Each parallel load is compared bitwise with the one-process reference: the same ``Net`` filled by
``safetensors.torch.load_file`` + ``load_state_dict`` (whose ``copy_`` also does the dtype casts).
Every rank must read exactly the bytes of the boxes it owns (no whole-tensor reads), and bad
requests must fail with the same message on every rank, before anything is read.
"""

from __future__ import annotations

import json
import os

import pytest
import safetensors.torch
import torch
from torch import nn

from ckpt_helpers import Net, build, configs_for, diff, full_state, shutdown
from mesh3d import checkpoint
from mesh3d.checkpoint import CheckpointError

#: (file name, dtype the file holds, dtype the model has); casts go both ways.
SOURCES = [("single.safetensors", torch.float64, torch.float64),
           ("sharded", torch.float64, torch.float64),
           ("f32.safetensors", torch.float32, torch.float64),
           ("single.safetensors", torch.float64, torch.bfloat16)]


def _weights(seed: int = 5) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    sd = Net().double().state_dict()
    sd["counts"] = sd["counts"] + 7
    return {k: v.contiguous() for k, v in sd.items()}


def _write_sources(root: str) -> None:
    sd = _weights()
    safetensors.torch.save_file(sd, os.path.join(root, "single.safetensors"))
    safetensors.torch.save_file({k: v.float() if v.is_floating_point() else v for k, v in sd.items()},
                                os.path.join(root, "f32.safetensors"))
    folder = os.path.join(root, "sharded")  # the layout save_pretrained writes for a sharded model
    os.makedirs(folder)
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[:3], "model-00002-of-00002.safetensors": names[3:]}
    for file, keys in shards.items():
        safetensors.torch.save_file({k: sd[k] for k in keys}, os.path.join(folder, file), metadata={"format": "pt"})
    index = {"metadata": {"total_size": 0}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)


def _reference(root: str, file: str, model_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    model = Net().to(model_dtype)
    path = os.path.join(root, file)
    if os.path.isdir(path):
        sd = {}
        for name in os.listdir(path):
            if name.endswith(".safetensors"):
                sd.update(safetensors.torch.load_file(os.path.join(path, name)))
    else:
        sd = safetensors.torch.load_file(path)
    model.load_state_dict(sd)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _owned_bytes(model: nn.Module, itemsizes: dict[str, int]) -> tuple[int, int]:
    """Bytes of the boxes this rank holds (file dtype), and the largest one."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from mesh3d.checkpoint.chunks import local_box

    sizes = [local_box(n, t).numel * itemsizes[n] for n, t in get_model_state_dict(model).items()]
    return sum(sizes), max(sizes)


def _plan_models(config: str, dtype: torch.dtype) -> nn.Module:
    """Net parallelized by mesh3d's own Plan: DDP + TP (with a replicated embedding), or FSDP over 4 ranks
    (``down``'s 6 rows shard 2/2/2/0: rank 3 holds empty shards)."""
    from mesh3d import DistributedManager, Plan, parallelize

    styles = {"up": "colwise", "down": "rowwise"}
    if config == "plan_ddp_tp":
        DistributedManager.initialize(2, 1, 2)
        plan = Plan(batch="ddp", model={**styles, "emb": "replicate"})
    else:
        DistributedManager.initialize(4, 1, 1)
        plan = Plan(batch="fsdp")
    torch.manual_seed(999)
    return parallelize(Net().to(dtype), plan)


def _load_every_layout(root: str) -> dict[str, list[str]]:
    failures: dict[str, list[str]] = {}
    for config in [*configs_for(4), "plan_ddp_tp", "plan_fsdp"]:
        for file, file_dtype, model_dtype in SOURCES:
            if config.startswith("plan_"):
                model = _plan_models(config, model_dtype)
            else:
                model = build(config, seed=999, dtype=model_dtype)[0]
            cast = model_dtype if file_dtype != model_dtype else None
            info = checkpoint.load_pretrained(os.path.join(root, file), model, dtype=cast)
            bad = diff(full_state(model, None), _reference(root, file, model_dtype))
            itemsizes = {n: (file_dtype.itemsize if t.is_floating_point() else t.element_size())
                         for n, t in _weights().items()}
            owned, largest = _owned_bytes(model, itemsizes)
            if info.bytes_read != owned:  # exactly the owned boxes: no tensor read whole by a rank not owning it
                bad.append(f"read {info.bytes_read} bytes, owns {owned}")
            if info.read_buffer_bytes > largest or (cast is None and info.read_buffer_bytes):
                bad.append(f"read buffer {info.read_buffer_bytes} bytes, largest owned slice {largest}")
            if info.missing or info.unexpected or len(info.loaded) != 7 or bool(info.cast) != bool(cast):
                bad.append(f"info {info}")
            if bad:
                failures[f"{file}:{model_dtype}->{config}"] = bad
            shutdown()
    return failures


def test_every_layout_loads_bitwise_like_load_state_dict(ranks, tmp_path):
    root = str(tmp_path)
    _write_sources(root)
    results = ranks.run(4, _load_every_layout, root, timeout=240)
    assert results == [{}] * 4, results
    # A plain process: no process group, a plain module, every source.
    assert not torch.distributed.is_initialized()
    for file, file_dtype, model_dtype in SOURCES:
        model = Net().to(model_dtype)
        info = checkpoint.load_pretrained(tmp_path / file, model, dtype=model_dtype if file_dtype != model_dtype else None)
        assert diff({k: v.clone() for k, v in model.state_dict().items()}, _reference(root, file, model_dtype)) == []
        assert info.bytes_read == sum(t.numel() * (file_dtype.itemsize if t.is_floating_point() else t.element_size())
                                      for t in _weights().values())


def _bad_requests(root: str) -> list[str]:
    """Each bad request on a FSDP x TP model: the message, and whether the model stayed untouched."""
    model = build("fsdp_tp4", seed=999)[0]
    before = full_state(model, None)
    messages = []
    for file, kwargs in [("missing.safetensors", {}), ("unexpected.safetensors", {}), ("shape.safetensors", {}),
                         ("f32.safetensors", {}), ("single.safetensors", {"key_map": {"up.bias": "down.bias"}}),
                         ("badindex", {}), ("nowhere", {}), ("ckpt", {})]:
        try:
            checkpoint.load_pretrained(os.path.join(root, file), model, **kwargs)
            messages.append("loaded")
        except CheckpointError as err:
            messages.append(str(err))
        if diff(full_state(model, None), before):
            messages.append("modified")
    info = checkpoint.load_pretrained(os.path.join(root, "missing.safetensors"), model, strict=False)
    got = full_state(model, None)
    want = _reference(root, "single.safetensors", torch.float64)
    changed = sorted(n for n in got if not torch.equal(got[n], want[n]))
    messages.append(json.dumps({"missing": info.missing, "unexpected": info.unexpected, "not_loaded": changed}))
    shutdown()
    return messages


def test_bad_requests_fail_on_every_rank_before_reading(ranks, tmp_path):
    root = str(tmp_path)
    _write_sources(root)
    sd = _weights()
    safetensors.torch.save_file({k: v for k, v in sd.items() if k not in ("up.bias", "mask")},
                                os.path.join(root, "missing.safetensors"))
    safetensors.torch.save_file({**sd, "extra.weight": torch.zeros(2)}, os.path.join(root, "unexpected.safetensors"))
    safetensors.torch.save_file({**sd, "emb.weight": torch.zeros(14, 6, dtype=torch.float64)},
                                os.path.join(root, "shape.safetensors"))
    os.makedirs(os.path.join(root, "badindex"))
    safetensors.torch.save_file(sd, os.path.join(root, "badindex", "model-00001-of-00001.safetensors"))
    with open(os.path.join(root, "badindex", "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"up.weight": "model-00001-of-00001.safetensors"}}, f)
    model = Net().double()
    checkpoint.save(os.path.join(root, "ckpt"), model)
    results = ranks.run(4, _bad_requests, root, timeout=120)
    for messages in results:
        assert len(messages) == 9, messages  # one message per request, and the model never modified
        for message in messages[:8]:   # every rank's cause, the same: one line naming the four
            assert "failed on 4 of 4 ranks" in message and "\n  ranks 0-3: Checkpoint" in message, message
            assert "Nothing was read or modified" in message
        assert "the model's ['mask', 'up.bias'] are not in the files (rename with key_map" in messages[0]
        assert "the files' ['extra.weight'] are not in the model" in messages[1]
        assert "emb.weight: file [14, 6], model [13, 6]" in messages[2]
        assert "up.weight: file F32, model F64 (pass dtype=torch.float64 to cast)" in messages[3]
        assert "key_map maps both 'down.bias' and 'up.bias' to 'down.bias'" in messages[4]
        assert "does not match its shards' headers" in messages[5] and "'down.bias'" in messages[5]
        assert "nowhere does not exist" in messages[6]
        assert "is a mesh3d checkpoint" in messages[7] and "checkpoint.load" in messages[7]
        assert json.loads(messages[8]) == {"missing": ["mask", "up.bias"], "unexpected": [],
                                           "not_loaded": ["up.bias"]}  # mask: same values either way
    assert results[0] == results[3]


class TiedNet(nn.Module):
    """An embedding and an output head sharing one weight (``tie_word_embeddings``), and a rotary-style
    non-persistent buffer that files written by older code may still hold."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 11, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("inv_freq", torch.arange(2.0), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.emb(idx)))


def _tied_sources(root: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    sd = {k: v.clone() for k, v in TiedNet().double().state_dict().items()}
    files = {"emb_only": {k: v for k, v in sd.items() if k != "head.weight"},
             "head_only": {k: v for k, v in sd.items() if k != "emb.weight"},
             "both": {**sd, "inv_freq": torch.ones(2, dtype=torch.float64)},
             "differ": {**sd, "head.weight": sd["head.weight"] + 1}}
    for name, tensors in files.items():
        safetensors.torch.save_file(tensors, os.path.join(root, f"{name}.safetensors"))
    return sd


def _load_tied(root: str) -> list[str]:
    from torch.distributed.fsdp import fully_shard

    from mesh3d import DistributedManager

    dm = DistributedManager.initialize(4, 1, 1)
    torch.manual_seed(999)
    model = TiedNet().double()
    fully_shard(model.mid, mesh=dm.batch_domain_mesh)
    fully_shard(model, mesh=dm.batch_domain_mesh)
    out = []
    for name in ("emb_only", "head_only", "both"):
        info = checkpoint.load_pretrained(os.path.join(root, f"{name}.safetensors"), model)
        want = safetensors.torch.load_file(os.path.join(root, "both.safetensors"))
        del want["inv_freq"]  # a non-persistent buffer: not part of the state
        out.append(json.dumps({"tied": info.tied, "ignored": info.ignored, "loaded": info.loaded,
                               "bad": diff(full_state(model, None), want)}))
    try:
        checkpoint.load_pretrained(os.path.join(root, "differ.safetensors"), model)
        out.append("loaded")
    except CheckpointError as err:
        out.append(str(err))
    shutdown()
    return out


def test_tied_weights_either_name_and_non_persistent_buffers(ranks, tmp_path):
    root = str(tmp_path)
    sd = _tied_sources(root)
    results = ranks.run(4, _load_tied, root, timeout=120)
    for out in results:
        emb_only, head_only, both = (json.loads(x) for x in out[:3])
        assert emb_only["tied"] == {"head.weight": "emb.weight"} and head_only["tied"] == {"emb.weight": "head.weight"}
        assert both["tied"] == {} and both["ignored"] == ["inv_freq"]
        for got in (emb_only, head_only, both):
            assert got["bad"] == [], got
        assert "ranks 0-3: CheckpointError: the files hold different values for 'head.weight'" in out[3], out[3]
    # The one-process reference: load_state_dict with the head missing fills it through the tie.
    for name in ("emb_only", "head_only"):
        ref, mine = TiedNet().double(), TiedNet().double()
        ref.load_state_dict(safetensors.torch.load_file(tmp_path / f"{name}.safetensors"), strict=False)
        checkpoint.load_pretrained(tmp_path / f"{name}.safetensors", mine)
        assert diff(dict(mine.state_dict()), dict(ref.state_dict())) == []
        assert torch.equal(mine.head.weight, sd["emb.weight"]) and mine.head.weight is mine.emb.weight
        assert torch.equal(mine.inv_freq, torch.arange(2.0))  # non-persistent buffers are the model's own


def test_key_map_dict_function_and_prefix(tmp_path):
    sd = _weights()
    safetensors.torch.save_file({f"model.{k}": v for k, v in sd.items()} | {"model.rotary.cache": torch.zeros(1)},
                                tmp_path / "prefixed.safetensors")
    drop_rotary = checkpoint.key_prefix(strip="model.")
    cases = [
        checkpoint.key_prefix(strip="model."),
        {f"model.{k}": k for k in sd} | {"model.rotary.cache": "rotary.cache"},
        lambda key: None if "rotary" in key else drop_rotary(key),
    ]
    for key_map in cases:
        model = Net().double()
        info = checkpoint.load_pretrained(tmp_path / "prefixed.safetensors", model, key_map=key_map, strict=False)
        assert diff({k: v.clone() for k, v in model.state_dict().items()}, sd) == []
        assert (info.ignored, info.unexpected) in ((["model.rotary.cache"], []), ([], ["rotary.cache"]))
    model = Net().double()
    with pytest.raises(CheckpointError, match=r"the files' \['rotary.cache'\] are not in the model"):
        checkpoint.load_pretrained(tmp_path / "prefixed.safetensors", model, key_map=checkpoint.key_prefix(strip="model."))
    with pytest.raises(CheckpointError, match="model.up.weight"):
        checkpoint.load_pretrained(tmp_path / "prefixed.safetensors", model)
    with pytest.raises(CheckpointError, match="dtype='bf16' must be a floating-point torch.dtype"):
        checkpoint.load_pretrained(tmp_path / "prefixed.safetensors", model, key_map=drop_rotary, dtype="bf16")
    add = checkpoint.key_prefix(strip="model.", add="net.")
    assert add("model.up.weight") == "net.up.weight" and add("lm_head.weight") == "net.lm_head.weight"
