"""Round trip through Hugging Face transformers: ``save_pretrained`` -> ``load_pretrained`` into an
FSDP x TP Llama on 4 ranks -> AdamW steps -> ``checkpoint.save`` -> ``coalesce`` -> ``from_pretrained``.

The exported model's logits must equal those of the same steps taken in one process on the
whole batch. Everything runs in float64 and the loss is our own fp64 cross-entropy on the logits:
transformers' built-in loss upcasts logits with ``.float()``, which in an fp64 model would round
them to fp32 and make a tight comparison meaningless. With fp64, parallel and one-process runs
differ only by summation order: measured 2e-16 on logits of magnitude ~0.6; the bound is 1e-12.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from ckpt_helpers import shutdown
from mesh3d import checkpoint

transformers = pytest.importorskip("transformers")  # installed by scripts/test.sh (the [hf] extra)

VOCAB, SEQ, PER_RANK, BATCH_RANKS, STEPS = 48, 8, 2, 2, 3
LLAMA_TP = {
    "model.embed_tokens": "rowwise",
    "model.layers.*.self_attn.[qkv]_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}


def _config():
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    tie_word_embeddings=False)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, VOCAB, (BATCH_RANKS * PER_RANK, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss_sum(model, x, y):
    logits = model(input_ids=x).logits  # fp64: no fp32 upcast, unlike transformers' own loss
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")


def _train_fsdp_tp(root: str) -> dict:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel

    import mesh3d
    from mesh3d import DistributedManager, Plan, parallelize

    dm = DistributedManager.initialize(BATCH_RANKS, 1, 2)
    torch.manual_seed(1234)  # other weights than the saved ones: the load must replace every one
    model = transformers.LlamaForCausalLM(_config()).double()
    plan = Plan(model={**LLAMA_TP, "lm_head": ColwiseParallel(output_layouts=Replicate())}, batch="fsdp")
    model = parallelize(model, plan)
    info = checkpoint.load_pretrained(os.path.join(root, "hf"), model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    b = dm.axis_rank("batch")
    for step in range(STEPS):
        x, y = _batch(step)
        xs, ys = x[b * PER_RANK:(b + 1) * PER_RANK], y[b * PER_RANK:(b + 1) * PER_RANK]
        mesh3d.global_mean_loss(_loss_sum(model, xs, ys), ys.numel()).backward()
        opt.step()
        opt.zero_grad()
    checkpoint.save(os.path.join(root, "trained"), model, opt, step=STEPS)
    shutdown()
    return {"loaded": len(info.loaded), "missing": info.missing, "unexpected": info.unexpected}


def test_save_pretrained_load_train_save_coalesce_from_pretrained(ranks, tmp_path):
    torch.manual_seed(0)
    original = transformers.LlamaForCausalLM(_config()).double()
    original.save_pretrained(tmp_path / "hf")  # model.safetensors + config.json
    assert os.path.isfile(tmp_path / "hf" / "model.safetensors")

    results = ranks.run(4, _train_fsdp_tp, str(tmp_path), timeout=240)
    n_tensors = len(original.state_dict())
    assert results == [{"loaded": n_tensors, "missing": [], "unexpected": []}] * 4

    checkpoint.coalesce(tmp_path / "trained", tmp_path / "export")
    shutil.copy(tmp_path / "hf" / "config.json", tmp_path / "export" / "config.json")
    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float64)

    # The same steps in one process, on the whole batch, from the same pretrained weights.
    reference = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        x, y = _batch(step)
        (_loss_sum(reference, x, y) / y.numel()).backward()
        opt.step()
        opt.zero_grad()
    probe = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        got, want = exported(input_ids=probe).logits, reference(input_ids=probe).logits
        untrained = original(input_ids=probe).logits
    assert got.dtype == torch.float64
    assert (want - untrained).abs().max() > 1e-3  # the steps moved the logits: equality below means something
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
