"""The model zoo: tiny configs of real architectures from third-party libraries, run unchanged on domain shards.

Each ``ZooModel`` names its library, a builder, how to call it, an input shape, the sharded dim and
the uneven 3-rank split it is tested on (aligned to the model's downsampling where it compares local
shapes). ``refusal`` is None for a model that must equal one process, else a piece of the error it
must raise (the op without an exact domain form) on the layouts in ``refused_on`` ("2" and "3" ranks
of slabs, "blocks" for a 2x2 grid); it equals one process on the others. ``workaround`` says what a
user can do. Dropout is 0 here; everything runs in float64.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from zoo import hand_models as hm
from zoo import more_models as mm
from zoo import sphere_models as sm
from zoo import transformer_models as tm
from zoo.transformer_models import token_ids


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
    refused_on: frozenset[str] = frozenset({"2", "3", "blocks"})
    #: "field": a float input; "ids": token ids (language models)
    inputs: str = "field"
    #: relative tolerance; looser only where the library itself computes in float32 (said at the entry)
    rtol: float = 1e-9
    #: complex weights stay as built (``Module.double``): for a library that casts its input to complex64 itself
    keep_complex: bool = False
    #: float32 input and parameters, in one process and on the domain alike: for a library that computes in float32
    #: whatever it is given (torch-harmonics' attention kernels, its DISCO quadrature buffers)
    fp32: bool = False

    def make_input(self) -> torch.Tensor:
        dtype = torch.float32 if self.fp32 else torch.float64
        return token_ids(self.shape) if self.inputs == "ids" else torch.randn(self.shape, dtype=dtype)

    def build_fp64(self) -> torch.nn.Module:
        """The model in float64 (``to_fp64``; real parameters only where ``keep_complex``; as built where ``fp32``)."""
        model = self.build()
        if self.fp32:
            return model
        return model.double() if self.keep_complex else to_fp64(model)

    def refused(self, layout: str) -> bool:
        """Whether this model must raise ``refusal`` on ``layout`` ("2", "3" or "blocks")."""
        return self.refusal is not None and layout in self.refused_on

    def runs_on(self, layout: str) -> bool:
        """Blocks (a 2x2 grid over the sharded dim and the next) are for fields (images, volumes), not sequences."""
        return layout != "blocks" or (self.inputs == "field" and len(self.shape) >= 4)


#: torch-harmonics' models on the sphere: float32 (they compute in it), on slabs and on lat x lon blocks
_SPHERE = dict(fp32=True, rtol=1e-5)


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

    return SwinForImageClassification(SwinConfig(**mm.TINY_SWIN))


# ----------------------------------------------------------------------------- neuraloperator, x-transformers
def _neuralop_fno():
    from neuralop.models import FNO

    return FNO(n_modes=(4, 4), in_channels=2, out_channels=1, hidden_channels=8, n_layers=2, positional_embedding=None)


def _x_vit():
    from x_transformers import Encoder, ViTransformerWrapper

    return ViTransformerWrapper(image_size=16, patch_size=4, channels=2, num_classes=3,
                                attn_layers=Encoder(dim=16, depth=1, heads=2))


def _th_sfno():
    import warnings

    from torch_harmonics.examples.models.sfno import SphericalFourierNeuralOperator

    with warnings.catch_warnings():  # its default truncation changed in 0.9.0: said at every SHT it builds
        warnings.filterwarnings("ignore", message="Default SHT truncation")
        return SphericalFourierNeuralOperator(img_size=(16, 32), in_chans=3, out_chans=3, embed_dim=8, num_layers=2,
                                              scale_factor=2, normalization_layer="instance_norm")


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
    "monai.SwinUNETR": ZooModel("monai", _monai_swin_unetr, _call, (1, 1, 64, 64), 2, (32, 16, 16),
                                "2-D shifted-window transformer encoder, conv decoder"),
    "diffusers.UNet2DModel": ZooModel("diffusers", _diffusers_unet2d, _sample, (1, 2, 16, 16), 2, (8, 4, 4),
                                      "2-D diffusion U-Net, timestep embedding, self-attention blocks, GroupNorm"),
    "diffusers.AutoencoderKL": ZooModel("diffusers", _diffusers_autoencoder, _autoencoder_forward, (1, 2, 16, 16), 2,
                                        (8, 4, 4), "2-D VAE encoder-decoder, mid-block attention, GroupNorm"),
    "transformers.ConvNext": ZooModel("transformers", _hf_convnext, _logits, (2, 2, 16, 16), 2, (8, 4, 4),
                                      "2-D ConvNeXt, channels-last LayerNorm, global pooling, classifier head"),
    "transformers.ResNet": ZooModel("transformers", _hf_resnet, _logits, (2, 2, 32, 16), 2, (16, 8, 8),
                                    "2-D ResNet, BatchNorm, max pooling, classifier head"),
    # Its decoder upsamples to F.interpolate(size=encoder_hidden_states[0].size()[2:]): a size read from a domain
    # tensor's shape, which is global, as in one process.
    "transformers.Segformer": ZooModel("transformers", _hf_segformer, _logits, (1, 2, 32, 16), 2, (16, 8, 8),
                                       "2-D hierarchical transformer, reduced K/V attention, MLP decoder"),
    # Its embeddings check the input's size against the configured image size: global, so it passes.
    "transformers.ViT": ZooModel("transformers", _hf_vit, _logits, (2, 2, 16, 16), 2, (8, 4, 4),
                                 "2-D vision transformer, class token, position embedding"),
    "transformers.Swin": ZooModel("transformers", _hf_swin, _logits, (1, 2, 16, 16), 2, (8, 4, 4),
                                  "2-D shifted-window transformer classifier"),
    "neuraloperator.FNO": ZooModel("neuraloperator", _neuralop_fno, _call, (1, 2, 16, 12), 2, (7, 5, 4),
                                   "2-D Fourier neural operator (spectral convolutions into a plain spectrum buffer)"),
    "x-transformers.ViTransformerWrapper": ZooModel(
        "x-transformers", _x_vit, _call, (2, 2, 16, 16), 2, (8, 4, 4),
        "2-D vision transformer via einops patches, position embedding"),
    # ----- issue 27: transformers and neural operators
    "transformers.GPT2": ZooModel("transformers", tm.hf_gpt2, tm.lm_logits, (2, 16), 1, (8, 5, 3),
                                  "decoder on a sharded sequence: causal attention, learned positions", inputs="ids"),
    "transformers.Llama": ZooModel("transformers", tm.hf_llama, tm.lm_logits, (2, 16), 1, (7, 0, 9),
                                   "decoder: rotary embeddings, grouped K/V, RMSNorm", inputs="ids"),
    # rtol 1e-6: Dinov2 interpolates its position embedding in float32 whatever the model's dtype (in one process
    # too), so the float64 run carries float32 rounding there
    "transformers.Bert": ZooModel("transformers", tm.hf_bert, tm.hf_hidden_ids, (2, 16), 1, (0, 9, 7),
                                  "encoder on a sharded sequence: absolute positions, token types, dropout",
                                  inputs="ids"),
    "transformers.Qwen2": ZooModel("transformers", tm.hf_qwen2, tm.lm_logits, (2, 16), 1, (5, 5, 6),
                                   "decoder: rotary embeddings, grouped K/V, biased projections", inputs="ids"),
    "transformers.Dinov2": ZooModel("transformers", tm.hf_dinov2, tm.hidden, (2, 2, 16, 16), 2, (8, 4, 4),
                                    "ViT that interpolates its position embedding to the input size", rtol=1e-6),
    "monai.ViT": ZooModel("monai", tm.monai_vit, tm.first, (2, 2, 16, 16), 2, (8, 4, 4),
                          "ViT, einsum attention (SABlock)"),
    "monai.UNETR": ZooModel("monai", tm.monai_unetr, tm.first, (1, 1, 16, 16), 2, (8, 4, 4),
                            "ViT encoder, tokens back to grids, conv decoder",
                            # blocks: its attention's einsum meets the keys in another layout than the queries
                            refusal="laid out differently over the domain grid", refused_on=frozenset({"blocks"}),
                            workaround="shard as slabs"),
    # rtol 1e-6 and complex weights kept: its spectral convolutions cast their input to float32 (complex64 in the
    # spectrum) whatever the model's dtype, in one process too
    "torch_harmonics.SFNO": ZooModel("torch_harmonics", _th_sfno, _call, (1, 3, 16, 32), 2, (6, 0, 10),
                                     "spherical Fourier neural operator: SHT over latitude slabs (on blocks: the "
                                     "coefficients on pencils), spectral blocks", rtol=1e-6, keep_complex=True),
    "torch_harmonics.LSNO": ZooModel("torch_harmonics", sm.lsno, _call, (1, 3, 16, 32), 2, (6, 0, 10),
                                     "local spherical neural operator: DISCO encoder, DISCO and SHT blocks, "
                                     "bilinear resampling with its poles written in place",
                                     **_SPHERE),
    "torch_harmonics.S2UNet": ZooModel("torch_harmonics", sm.s2unet, _call, (1, 3, 16, 32), 2, (6, 0, 10),
                                       "spherical U-Net: strided DISCO convolutions down, resampling up", **_SPHERE),
    "torch_harmonics.S2Transformer": ZooModel("torch_harmonics", lambda: sm.s2transformer("neighborhood"), _call,
                                              (1, 3, 16, 32), 2, (6, 0, 10),
                                              "spherical transformer: neighbourhood attention on the sphere",
                                              **_SPHERE),
    "torch_harmonics.S2TransformerGlobal": ZooModel("torch_harmonics", lambda: sm.s2transformer("global"), _call,
                                                    (1, 3, 16, 32), 2, (6, 0, 10),
                                                    "spherical transformer: global attention with quadrature weights",
                                                    **_SPHERE),
    "torch_harmonics.S2Segformer": ZooModel("torch_harmonics", sm.s2segformer, _call, (1, 3, 16, 32), 2, (6, 0, 10),
                                            "spherical Segformer: DISCO patch merging, neighbourhood attention, "
                                            "upsampling decoder", **_SPHERE),
    "neuraloperator.TFNO": ZooModel("neuraloperator", tm.neuralop_tfno, _call, (1, 2, 16, 12), 2, (7, 5, 4),
                                    "Tucker-factorized Fourier neural operator"),
    "x-transformers.Decoder": ZooModel("x-transformers", tm.x_decoder, _call, (2, 16), 1, (3, 8, 5),
                                       "decoder with rotary embeddings", inputs="ids"),
    "perceiver-pytorch.Perceiver": ZooModel("perceiver-pytorch", tm.perceiver, _call, (2, 16, 12, 2), 1, (8, 4, 4),
                                            "latents cross-attending to a sharded image, Fourier position features"),
    # ----- issue 45: idioms of models mesh3d had not run
    "diffusers.UNet2DConditionModel": ZooModel(
        "diffusers", mm.unet2d_condition, mm.unet2d_condition_forward, (1, 2, 16, 16), 2, (8, 4, 4),
        "2-D conditional U-Net: cross-attention of the sharded pixels to a plain text conditioning"),
    "transformers.MobileViT": ZooModel("transformers", mm.mobilevit, _logits, (2, 2, 32, 32), 2, (16, 8, 8),
                                       "patches unfolded across ranks (whole patches merged into the batch), attention "
                                       "over them, folded back"),
    "neuraloperator.UNO": ZooModel("neuraloperator", mm.neuralop_uno, _call, (1, 2, 16, 12), 2, (8, 4, 4),
                                   "U-shaped neural operator: spectral layers that resample, horizontal skips"),
    "x-unet.XUnet": ZooModel("x-unet", mm.x_unet, _call, (1, 2, 16, 16), 2, (8, 4, 4),
                             "2-D U-Net with attention, l2-normalized queries and keys (F.normalize)"),
    "mlp-mixer-pytorch.MLPMixer": ZooModel(
        "mlp-mixer-pytorch", mm.mlp_mixer, _call, (2, 2, 16, 16), 2, (8, 4, 4),
        "token mixing: a 1x1 conv over the sharded patches as channels (a contraction: one all-reduce)"),
    "conformer.ConformerBlock": ZooModel("conformer", mm.conformer_block, _call, (2, 12, 16), 1, (5, 3, 4),
                                         "sequence: depthwise conv along it, BatchNorm1d, attention with Shaw's "
                                         "relative positions (a plain table converted by .to(q))"),
    "local-attention.LocalTransformer": ZooModel(
        "local-attention", mm.local_transformer, _call, (2, 16), 1, (7, 0, 9),
        "windowed causal attention: Tensor.unfold's look-around across ranks, hyper-connection residual streams",
        inputs="ids"),
    "monai.DynUNet": ZooModel("monai", mm.monai_dynunet, _call, (1, 2, 16, 16), 2, (8, 4, 4),
                              "2-D dynamic U-Net: residual blocks, InstanceNorm, transposed convs"),
    "diffusers.VQModel": ZooModel("diffusers", mm.vq_model, mm.vq_model_forward, (1, 2, 16, 16), 2, (8, 4, 4),
                                  "VQ autoencoder: torch.cdist of strided rows (blocks: a token grid) to the "
                                  "codebook, argmin, embedding"),
    "transformers.Swinv2": ZooModel("transformers", mm.hf_swinv2, _logits, (1, 2, 16, 16), 2, (8, 4, 4),
                                    "Swin V2: cosine attention, log-spaced continuous position bias (plain tables)"),
    "vector-quantize-pytorch.VectorQuantize": ZooModel(
        "vector-quantize-pytorch", mm.vector_quantize, mm.vq_forward, (2, 12, 8), 1, (5, 0, 7),
        "codebook lookup of sharded tokens with an EMA codebook: einops pack, its own cdist by einsum",
        refusal="torch.functional.einsum has no rule for a strided layout", refused_on=frozenset({"2", "3"}),
        workaround="its einsum over the packed rows (b (n)) d: reshape to (b, n, d) before the distance, or "
                   "call .full_tensor()"),
    "transformers.ConvNextV2": ZooModel("transformers", mm.hf_convnextv2, _logits, (2, 2, 16, 16), 2, (8, 4, 4),
                                        "ConvNeXt V2: global response normalization (a norm over the spatial dims)"),
    "hand-written.SwinWindows": ZooModel("hand-written", hm.swin_windows, _call, (1, 8, 8, 4), 1, (1, 0, 7),
                                         "Swin's shifted windows by view/permute/roll, cut across shards, a mask per window"),
    "hand-written.EarthWindows": ZooModel("hand-written", hm.earth_windows, _call, (1, 4, 8, 8, 4), 2, (2, 5, 1),
                                          "Pangu-style 3-D (2, 4, 4) windows on a volume, shifted by half"),
    "hand-written.DiffusionLoss": ZooModel("hand-written", hm.diffusion_loss, _call, (2, 2, 12, 8), 2, (5, 0, 7),
                                           "a DDPM loss: timesteps and noise drawn per call, the noisy field, a time "
                                           "embedding per channel, the squared error per point"),
    "hand-written.CubeSphere": ZooModel("hand-written", hm.cube_sphere, _call, (1, 6, 2, 8, 8), 3, (3, 0, 5),
                                        "cube-sphere convolutions: each face padded with its neighbours' edges turned "
                                        "by torch.rot90 (rows beside columns), one conv over the faces"),
}


def to_fp64(model: torch.nn.Module) -> torch.nn.Module:
    """Real parameters and buffers to float64, complex ones to complex128 (``Module.double`` skips complex)."""
    model.double()
    for t in [*model.parameters(), *model.buffers()]:
        if t.is_complex():
            t.data = t.data.to(torch.complex128)
    return model
