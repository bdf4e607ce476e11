"""Unchanged Hugging Face decoders on all three axes: GPT-2 and Llama (rotary embeddings, grouped K/V heads) with
their sequence sharded over the domain (attention as a ring), FSDP over the batch axis and the model axis splitting
Llama's heads and MLP (colwise/rowwise; GPT-2's Conv1D layers are not nn.Linear, so they are replicated there).
On (batch 2, domain 2, model 2), losses, raw gradients and parameters after 3 SGD steps equal one process (fp64).

Dropout is off here: each batch rank draws its samples' masks from its own stream (``manual_seed``), which one
process running the global batch at once cannot reproduce; dropout itself is tested where one stream is shared
(tests/test_domain_global_sizes.py, the zoo).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

TOL = 1e-10
LLAMA_TP = {"model.embed_tokens": "replicate", "lm_head": "replicate", "model.norm": "replicate",
            "model.layers.*.*_layernorm": "replicate", "model.layers.*.self_attn.[qkv]_proj": "colwise",
            "model.layers.*.self_attn.o_proj": "rowwise", "model.layers.*.mlp.gate_proj": "colwise",
            "model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise"}
GPT2_REPLICATED = {"transformer.h.*.ln_[12]": "replicate", "transformer.h.*.attn.c_[a-z]*": "replicate",
                   "transformer.h.*.mlp.c_[a-z]*": "replicate"}  # the blocks: the embeddings take plain position ids


def _decoder(name: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if name == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=64, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                                          embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa")), GPT2_REPLICATED
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        attn_implementation="sdpa")), LLAMA_TP


def _body(name: str, sizes: tuple[int, ...], mode: str, steps: int = 3):
    import torch.distributed as dist

    from mesh3d import DistributedManager, Plan, domain, parallelize
    from parallel_models import full

    dm = DistributedManager.initialize(batch=2, domain=2, model=2)
    torch.manual_seed(0)
    ref, styles = _decoder(name)
    ref = ref.double()
    model = parallelize(copy.deepcopy(ref), Plan(batch="fsdp", model=styles))
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ids = torch.randint(0, 32, (2, sum(sizes) + 1), generator=torch.Generator().manual_seed(5))
    x, y = ids[:, :-1], ids[:, 1:]
    b = dm.axis_rank("batch")
    xs, ys = domain.shard(x[b:b + 1], dim=1, sizes=sizes), domain.shard(y[b:b + 1], dim=1, sizes=sizes)
    errs = []
    for _ in range(steps):
        opt_ref.zero_grad()
        loss_ref = F.cross_entropy(ref(input_ids=x).logits.transpose(1, 2), y)
        loss_ref.backward()
        opt_ref.step()
        opt.zero_grad()
        with domain.attention_mode(mode):
            loss = F.cross_entropy(model(input_ids=xs).logits.transpose(1, 2), ys)
        loss.backward()
        both = loss.detach().to_local().clone()
        dist.all_reduce(both, group=dm.group("batch"))
        errs.append(abs(float(both) / 2 - float(loss_ref)) / abs(float(loss_ref)))
        errs.append(max(float((full(p.grad) - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30))
                        for p, q in zip(model.parameters(), ref.parameters())))
        opt.step()
    errs.append(max(float((full(p) - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters())))
    return max(errs)


@pytest.mark.parametrize("name, sizes, mode", [("gpt2", (9, 7), "ring"), ("llama", (5, 11), "ring"),
                                               ("llama", (12, 4), "gather")])
def test_hugging_face_decoders_on_all_three_axes_train_like_one_process(ranks, name, sizes, mode):
    for err in ranks.run(8, _body, name, sizes, mode, timeout=300):
        assert err < TOL, (name, sizes, mode, err)
