"""Zoo builders of issue 45: models mesh3d had not run, chosen for the idioms they use (cross-attention with a plain
conditioning tensor, codebook distances on strided rows, patch unfolds across ranks, token mixing across the sharded
dim, depthwise convolutions along a sequence, windows of a sequence looked around across ranks). Tiny configurations,
unchanged code.

Each returns a module; ``tests/zoo/models.py`` lists them in ``ZOO`` with their inputs and splits.
"""

from __future__ import annotations

import torch

COND = 5  # conditioning tokens of the cross-attention models
#: The tiny Swin configuration (V1 in ``models.py``, V2 here): 16x16 images, 2x2 patches, 4x4 windows, no dropout.
TINY_SWIN = dict(image_size=16, patch_size=2, num_channels=2, embed_dim=8, depths=(1, 1), num_heads=(1, 2), window_size=4,
                 num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0)


def conditioning(batch: int, dim: int) -> torch.Tensor:
    """A plain (B, COND, dim) conditioning tensor, the same on every rank (text encoder states)."""
    g = torch.Generator().manual_seed(7)
    return torch.randn(batch, COND, dim, dtype=torch.float64, generator=g)


# ----------------------------------------------------------------------------- diffusers
def unet2d_condition():
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(sample_size=16, in_channels=2, out_channels=2, layers_per_block=1,
                                block_out_channels=(8, 16), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=8,
                                norm_num_groups=4, attention_head_dim=4)


def unet2d_condition_forward(model, x):
    return model(x, 3, encoder_hidden_states=conditioning(x.shape[0], 8)).sample


def vq_model():
    from diffusers import VQModel

    return VQModel(in_channels=2, out_channels=2, down_block_types=("DownEncoderBlock2D",) * 2,
                   up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 8), layers_per_block=1,
                   latent_channels=4, num_vq_embeddings=16, vq_embed_dim=4, norm_num_groups=4, sample_size=16)


def vq_model_forward(model, x):
    return model(x).sample


# ----------------------------------------------------------------------------- transformers
def mobilevit():
    from transformers import MobileViTConfig, MobileViTForImageClassification

    cfg = MobileViTConfig(num_channels=2, image_size=32, patch_size=2, hidden_sizes=(16, 16, 16),
                          neck_hidden_sizes=(4, 8, 8, 8, 8, 16, 32), num_attention_heads=2, mlp_ratio=2.0,
                          expand_ratio=2.0, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                          classifier_dropout_prob=0.0)
    return MobileViTForImageClassification(cfg)


# ----------------------------------------------------------------------------- neuraloperator
def neuralop_uno():
    from neuralop.models import UNO

    return UNO(in_channels=2, out_channels=1, hidden_channels=8, lifting_channels=8, projection_channels=8, n_layers=3,
               uno_out_channels=[8, 8, 8],
               uno_n_modes=[[4, 4], [3, 3], [4, 4]], uno_scalings=[[1.0, 1.0], [0.5, 0.5], [2.0, 2.0]],
               positional_embedding=None, channel_mlp_skip="linear")


# ----------------------------------------------------------------------------- lucidrains' libraries
def vector_quantize():
    from vector_quantize_pytorch import VectorQuantize

    return VectorQuantize(dim=8, codebook_size=16, decay=0.8, commitment_weight=1.0)


def vq_forward(model, x):
    quantized, _, loss = model(x)
    return quantized + loss


def x_unet():
    from x_unet import XUnet

    return XUnet(dim=8, channels=2, out_dim=2, dim_mults=(1, 2), nested_unet_depths=(0, 0),
                 consolidate_upsample_fmaps=True, num_blocks_per_stage=(1, 1), num_self_attn_per_stage=(1, 1),
                 attn_heads=2, attn_dim_head=4)


def mlp_mixer():
    from mlp_mixer_pytorch import MLPMixer

    return MLPMixer(image_size=16, channels=2, patch_size=4, dim=16, depth=1, num_classes=3)


def conformer_block():
    from conformer import ConformerBlock

    return ConformerBlock(dim=16, dim_head=8, heads=2, ff_mult=2, conv_expansion_factor=2, conv_kernel_size=7,
                          attn_dropout=0.0, ff_dropout=0.0, conv_dropout=0.0)


def local_transformer():
    from local_attention import LocalTransformer

    return LocalTransformer(num_tokens=32, max_seq_len=16, dim=16, depth=1, causal=True, local_attn_window_size=4)


# ----------------------------------------------------------------------------- more of the libraries already in
def monai_dynunet():
    from monai.networks.nets import DynUNet

    return DynUNet(spatial_dims=2, in_channels=2, out_channels=2, kernel_size=(3, 3, 3), strides=(1, 2, 2),
                   upsample_kernel_size=(2, 2), filters=(4, 8, 8), norm_name="instance", res_block=True)


def hf_convnextv2():
    from transformers import ConvNextV2Config, ConvNextV2ForImageClassification

    cfg = ConvNextV2Config(num_channels=2, num_stages=2, patch_size=2, hidden_sizes=(8, 16), depths=(1, 1),
                           num_labels=3, drop_path_rate=0.0)
    return ConvNextV2ForImageClassification(cfg)


def hf_swinv2():
    from transformers import Swinv2Config, Swinv2ForImageClassification

    return Swinv2ForImageClassification(Swinv2Config(**TINY_SWIN))
