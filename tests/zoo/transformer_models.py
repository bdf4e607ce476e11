"""Zoo builders for transformers and neural operators (issue 27): decoders on a sharded sequence, vision
transformers on a sharded image, shifted windows, spectral layers. Tiny configurations, unchanged library code.

Each returns a module; ``tests/zoo/models.py`` lists them in ``ZOO`` with their inputs and splits.
"""

from __future__ import annotations

import torch

VOCAB = 32


def token_ids(shape: tuple[int, ...]) -> torch.Tensor:
    """Token ids for the language models (the ``inputs="ids"`` entries)."""
    return torch.randint(0, VOCAB, shape)


def lm_logits(model, ids):
    return model(input_ids=ids).logits


def hidden(model, x):
    return model(pixel_values=x).last_hidden_state


def first(model, x):
    out = model(x)
    return out[0] if isinstance(out, (tuple, list)) else out


# ----------------------------------------------------------------------------- transformers
def hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=16, n_layer=2, n_head=2, attn_pdrop=0.0,
                     attn_implementation="sdpa")  # resid/embd dropout at their defaults (0.1)
    return GPT2LMHeadModel(cfg)


def hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def hf_bert():
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                     max_position_embeddings=64, attention_probs_dropout_prob=0.0,
                     attn_implementation="sdpa")  # hidden dropout at its default (0.1); attention dropout: see docs
    return BertModel(cfg, add_pooling_layer=False)


def hf_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64, attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg)


def hf_hidden_ids(model, ids):
    return model(input_ids=ids).last_hidden_state


def hf_dinov2():
    from transformers import Dinov2Config, Dinov2Model

    # image_size 8 (a 2x2 patch grid) but run on 16x16 inputs: the position embedding is interpolated to the grid
    cfg = Dinov2Config(image_size=8, patch_size=4, num_channels=2, hidden_size=16, num_hidden_layers=1,
                       num_attention_heads=2, mlp_ratio=2, attn_implementation="sdpa")
    return Dinov2Model(cfg)


# ----------------------------------------------------------------------------- MONAI
def monai_vit():
    from monai.networks.nets import ViT

    return ViT(in_channels=2, img_size=(16, 16), patch_size=(4, 4), hidden_size=16, mlp_dim=32, num_layers=1,
               num_heads=2, spatial_dims=2, classification=False, proj_type="conv")


def monai_unetr():
    from monai.networks.nets import UNETR

    return UNETR(in_channels=1, out_channels=2, img_size=(16, 16), feature_size=4, hidden_size=16, mlp_dim=32,
                 num_heads=2, spatial_dims=2, proj_type="conv", norm_name="instance")


# ----------------------------------------------------------------------------- neuraloperator, x-transformers, perceiver
def neuralop_tfno():
    from neuralop.models import TFNO

    return TFNO(n_modes=(4, 4), in_channels=2, out_channels=1, hidden_channels=8, n_layers=2, factorization="tucker",
                rank=0.5, positional_embedding=None)


def x_decoder():
    from x_transformers import Decoder, TransformerWrapper

    return TransformerWrapper(num_tokens=VOCAB, max_seq_len=64,
                              attn_layers=Decoder(dim=16, depth=1, heads=2, rotary_pos_emb=True))


def perceiver():
    from perceiver_pytorch import Perceiver

    return Perceiver(input_channels=2, input_axis=2, num_freq_bands=4, max_freq=8.0, depth=1, num_latents=8,
                     latent_dim=16, cross_heads=1, latent_heads=2, cross_dim_head=8, latent_dim_head=8, num_classes=3,
                     attn_dropout=0.0, ff_dropout=0.0, self_per_cross_attn=1)
