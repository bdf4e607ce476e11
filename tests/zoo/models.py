"""The model zoo: tiny configs of real architectures from third-party libraries, run unchanged on domain shards.

Each ``ZooModel`` names its library, a builder, how to call it, an input shape, the sharded dim and
the uneven 3-rank split it is tested on (aligned to the model's downsampling where it compares local
shapes). ``refusal`` is None for a model that must equal one process, else a piece of the error it
must raise (the op without an exact domain form); ``workaround`` says what a user can do then.
Dropout is 0 (a per-shard mask cannot match one process); everything runs in float64.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ZooModel:
    library: str
    build: Callable[[], torch.nn.Module]
    forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
    shape: tuple[int, ...]
    dim: int
    sizes3: tuple[int, int, int]  # the uneven 3-rank split (2 ranks: an even split aligned the same way)
    covers: str
    refusal: str | None = None
    workaround: str = ""


def _call(model, x):
    return model(x)


def _logits(model, x):
    return model(pixel_values=x).logits


def _sample(model, x):
    return model(x, 3).sample


# ----------------------------------------------------------------------------- MONAI
def _monai_unet():
    from monai.networks.nets import UNet

    return UNet(spatial_dims=2, in_channels=2, out_channels=3, channels=(4, 8, 8), strides=(2, 2), num_res_units=1,
                norm="batch")


def _monai_basic_unet():
    from monai.networks.nets import BasicUNet

    return BasicUNet(spatial_dims=3, in_channels=1, out_channels=2, features=(2, 2, 2, 2, 2, 2), dropout=0.0)


def _monai_segresnet():
    from monai.networks.nets import SegResNet

    return SegResNet(spatial_dims=3, init_filters=4, in_channels=1, out_channels=2, blocks_down=(1, 1),
                     blocks_up=(1,), norm=("group", {"num_groups": 2}))


def _monai_densenet():
    from monai.networks.nets import DenseNet

    return DenseNet(spatial_dims=2, in_channels=2, out_channels=3, init_features=4, growth_rate=4,
                    block_config=(1, 1), bn_size=2)


def _monai_attention_unet():
    from monai.networks.nets import AttentionUnet

    return AttentionUnet(spatial_dims=2, in_channels=1, out_channels=2, channels=(4, 8), strides=(2,))


def _monai_swin_unetr():
    from monai.networks.nets import SwinUNETR

    return SwinUNETR(in_channels=1, out_channels=2, feature_size=12, spatial_dims=2, depths=(1, 1, 1, 1),
                     num_heads=(1, 1, 1, 1), window_size=4, downsample="merging")


# ----------------------------------------------------------------------------- diffusers
def _diffusers_unet2d():
    from diffusers import UNet2DModel

    return UNet2DModel(sample_size=16, in_channels=2, out_channels=2, layers_per_block=1, block_out_channels=(8, 16),
                       down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                       up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=4, attention_head_dim=8)


def _diffusers_autoencoder():
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=2, out_channels=2, down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 8), layers_per_block=1,
                         latent_channels=2, norm_num_groups=4, sample_size=16)


def _autoencoder_forward(model, x):
    return model(x, sample_posterior=False).sample


# ----------------------------------------------------------------------------- transformers
def _hf_convnext():
    from transformers import ConvNextConfig, ConvNextForImageClassification

    cfg = ConvNextConfig(num_channels=2, num_stages=2, patch_size=2, hidden_sizes=(8, 16), depths=(1, 1), num_labels=3,
                         drop_path_rate=0.0)
    return ConvNextForImageClassification(cfg)


def _hf_resnet():
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(num_channels=2, embedding_size=8, hidden_sizes=(8, 16), depths=(1, 1), layer_type="basic",
                       num_labels=3)
    return ResNetForImageClassification(cfg)


def _hf_segformer():
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    cfg = SegformerConfig(num_channels=2, num_encoder_blocks=2, depths=(1, 1), sr_ratios=(2, 1),
                          hidden_sizes=(8, 16), patch_sizes=(3, 3), strides=(2, 2), num_attention_heads=(1, 2),
                          mlp_ratios=(2, 2), decoder_hidden_size=16, num_labels=3, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0, drop_path_rate=0.0,
                          attn_implementation="eager")
    return SegformerForSemanticSegmentation(cfg)


def _hf_vit():
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=16, patch_size=4, num_channels=2, hidden_size=16, num_hidden_layers=1,
                    num_attention_heads=2, intermediate_size=32, num_labels=3, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    return ViTForImageClassification(cfg)


def _hf_swin():
    from transformers import SwinConfig, SwinForImageClassification

    cfg = SwinConfig(image_size=16, patch_size=2, num_channels=2, embed_dim=8, depths=(1, 1), num_heads=(1, 2),
                     window_size=4, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     drop_path_rate=0.0)
    return SwinForImageClassification(cfg)


# ----------------------------------------------------------------------------- neuraloperator, x-transformers
def _neuralop_fno():
    from neuralop.models import FNO

    return FNO(n_modes=(4, 4), in_channels=2, out_channels=1, hidden_channels=8, n_layers=2, positional_embedding=None)


def _x_vit():
    from x_transformers import Encoder, ViTransformerWrapper

    return ViTransformerWrapper(image_size=16, patch_size=4, channels=2, num_classes=3,
                                attn_layers=Encoder(dim=16, depth=1, heads=2))


ZOO: dict[str, ZooModel] = {
    "monai.UNet": ZooModel("monai", _monai_unet, _call, (2, 2, 16, 12), 2, (8, 4, 4),
                           "2-D encoder-decoder, skips, strided residual convs, BatchNorm"),
    "monai.BasicUNet": ZooModel("monai", _monai_basic_unet, _call, (1, 1, 48, 16, 16), 2, (16, 16, 16),
                                "3-D encoder-decoder, max pooling, transposed convs, UpCat, InstanceNorm"),
    "monai.SegResNet": ZooModel("monai", _monai_segresnet, _call, (1, 1, 16, 8, 8), 2, (8, 4, 4),
                                "3-D residual encoder-decoder, GroupNorm, trilinear upsampling"),
    "monai.DenseNet": ZooModel("monai", _monai_densenet, _call, (2, 2, 32, 16), 2, (16, 8, 8),
                               "2-D dense blocks, BatchNorm, global pooling, classifier head"),
    "monai.AttentionUnet": ZooModel("monai", _monai_attention_unet, _call, (1, 1, 16, 8), 2, (8, 4, 4),
                                    "2-D U-Net with attention gates (sigmoid gating of skips)"),
    # Its own check wants every local size a multiple of 2**5 (it reads x.shape, the local shape): the split is
    # aligned to 32, so no rank fails outside mesh3d (tests/test_domain_divergence.py covers that). At 3 ranks rank 0
    # holds more windows and takes another path: ranks 1 and 2 refuse the op and tell it so.
    "monai.SwinUNETR": ZooModel("monai", _monai_swin_unetr, _call, (1, 1, 128, 64), 2, (64, 32, 32),
                                "2-D shifted-window transformer encoder, conv decoder",
                                refusal="domain tensors sharded along different dims | failed in a domain op and stopped",
                                workaround="shard along the batch dim, or gather before the window attention"),
    "diffusers.UNet2DModel": ZooModel("diffusers", _diffusers_unet2d, _sample, (1, 2, 16, 16), 2, (8, 4, 4),
                                      "2-D diffusion U-Net, timestep embedding, self-attention blocks, GroupNorm"),
    "diffusers.AutoencoderKL": ZooModel("diffusers", _diffusers_autoencoder, _autoencoder_forward, (1, 2, 16, 16), 2,
                                        (8, 4, 4), "2-D VAE encoder-decoder, mid-block attention, GroupNorm"),
    "transformers.ConvNext": ZooModel("transformers", _hf_convnext, _logits, (2, 2, 16, 16), 2, (8, 4, 4),
                                      "2-D ConvNeXt, channels-last LayerNorm, global pooling, classifier head"),
    "transformers.ResNet": ZooModel("transformers", _hf_resnet, _logits, (2, 2, 32, 16), 2, (16, 8, 8),
                                    "2-D ResNet, BatchNorm, max pooling, classifier head"),
    # Its decoder upsamples to F.interpolate(size=encoder_hidden_states[0].size()[2:]): a size read from a domain
    # tensor's shape, whose sharded entry carries its global length (LocalLength).
    "transformers.Segformer": ZooModel("transformers", _hf_segformer, _logits, (1, 2, 32, 16), 2, (16, 8, 8),
                                       "2-D hierarchical transformer, reduced K/V attention, MLP decoder"),
    "transformers.ViT": ZooModel("transformers", _hf_vit, _logits, (2, 2, 16, 16), 2, (8, 4, 4),
                                 "2-D vision transformer, class token, position embedding",
                                 refusal="doesn't match model",
                                 workaround="embed the patches, then run the encoder on the sharded tokens"),
    "transformers.Swin": ZooModel("transformers", _hf_swin, _logits, (1, 2, 16, 16), 2, (8, 4, 4),
                                  "2-D shifted-window transformer classifier",
                                  refusal="the query must be a domain tensor sharded along its sequence dim "
                                          "| failed in torch.scaled_dot_product_attention",
                                  workaround="shard along the batch dim, or gather before the window attention"),
    "neuraloperator.FNO": ZooModel("neuraloperator", _neuralop_fno, _call, (1, 2, 16, 12), 2, (7, 5, 4),
                                   "2-D Fourier neural operator (spectral convolutions)", refusal="numpy() | Size of label",
                                   workaround="write the spectral layer with torch.fft on the domain tensor"),
    "x-transformers.ViTransformerWrapper": ZooModel(
        "x-transformers", _x_vit, _call, (2, 2, 16, 16), 2, (8, 4, 4),
        "2-D vision transformer via einops patches, position embedding",
        refusal="varies along the sharded dim 1 | failed in torch.Tensor.add",
        workaround="add the full position embedding (pos_embedding[:, :num_patches]); mesh3d slices it"),
}


def to_fp64(model: torch.nn.Module) -> torch.nn.Module:
    """Real parameters and buffers to float64, complex ones to complex128 (``Module.double`` skips complex)."""
    model.double()
    for t in [*model.parameters(), *model.buffers()]:
        if t.is_complex():
            t.data = t.data.to(torch.complex128)
    return model
