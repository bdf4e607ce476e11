"""Models and cases shared by the planner tests (imported on every rank and by the CLI tests by name).

Each case names a mesh, a plan, a model and one batch rank's input; ``tests/test_plan_reality.py`` runs it for
real on the rank pool and holds ``mesh3d plan``'s figures to what it measured.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from parallel_models import Transformer

from mesh3d.planner.spec import load_spec

#: examples/llama_decoder.py, by path (the examples are scripts, not a package)
_LLAMA = str(Path(__file__).resolve().parents[1] / "examples" / "llama_decoder.py")


class ConvStack(nn.Module):
    """A 2-D conv net: a stem, blocks of conv/GroupNorm/SiLU (FSDP units), a strided conv down and back up, a head."""

    def __init__(self, width: int = 16, depth: int = 3, channels: int = 2) -> None:
        super().__init__()
        self.stem = nn.Conv2d(channels, width, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.GroupNorm(4, width), nn.SiLU())
                                    for _ in range(depth))
        self.down = nn.Conv2d(width, width, 3, stride=2, padding=1)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.head = nn.Conv2d(width, channels, 3, padding=1)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.up(self.down(x)) + x)


class HaloConvs(nn.Sequential):
    """Stride-1 convs whose halos follow from their shapes alone: (in, out, kernel, padding, dilation) per layer, a
    kernel 5 (two rows each side), a dilated one (two each side) and an even kernel padded ``"same"`` (one row before,
    two after)."""

    LAYERS = ((2, 3, 3, 1, 1), (3, 3, 5, 2, 1), (3, 3, 3, 2, 2), (3, 2, 4, "same", 1))

    def __init__(self) -> None:
        super().__init__(*(nn.Conv2d(i, o, k, padding=p, dilation=d) for i, o, k, p, d in self.LAYERS))


class BatchNormNet(nn.Module):
    """Convs with BatchNorm (persistent buffers in the checkpoint) and a dilated circular conv."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Conv2d(2, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                    nn.Conv2d(8, 8, 3, padding=2, dilation=2, padding_mode="circular"), nn.Tanh(),
                                    nn.Conv2d(8, 3, 1))

    def forward(self, x):
        return self.layers(x)


class Flips(nn.Module):
    """Ops with no domain rule on slabs (renorm, msort): the planner and check name them."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        y = torch.renorm(self.conv(x), 2, 1, 1.0)
        return torch.msort(y) + F.relu(y)


class WideKernel(nn.Module):
    """A 7-wide kernel: on 2-row shards its halo comes from ranks two steps away."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 7, padding=3)

    def forward(self, x):
        return self.conv(x)


def conv_stack() -> nn.Module:
    return ConvStack()


def deep_conv_stack() -> nn.Module:
    """Deep enough that activations dwarf the step's other allocations (the RSS comparison)."""
    return ConvStack(width=16, depth=8)


def batchnorm_net() -> nn.Module:
    return BatchNormNet()


def transformer() -> nn.Module:
    return Transformer(vocab=32, dim=16, n_heads=4, hidden=48, layers=2)


def decoder() -> nn.Module:
    """examples/llama_decoder.py's tiny decoder (RMSNorm, causal SDPA, SwiGLU, a learned position table of 24)."""
    return load_spec(f"{_LLAMA}:tiny")()


def wide_decoder(tokens: int = 8192) -> nn.Module:
    """The same decoder, wider, for ``tokens`` tokens (its position table's length)."""
    return load_spec(f"{_LLAMA}:Decoder")(vocab=256, dim=128, n_heads=4, hidden=344, layers=2, max_seq=tokens)


def rss_decoder() -> nn.Module:
    """The wide decoder at 4096 tokens: activations of tens of MiB per rank at 2048 tokens each (the RSS comparison).

    NOTE: 4096, not 8192: a bf16 step at 8192 tokens took 17 s on one core of an AVX2 CPU (no bf16 matmul units;
    3.2 s in fp32), and the RSS case runs five steps on four ranks sharing two cores."""
    return wide_decoder(4096)


TP_STYLES = {"tok": "rowwise", "layers.*.attn.w[qkv]": "colwise", "layers.*.attn.wo": "rowwise",
             "layers.*.mlp.up": "colwise", "layers.*.mlp.down": "rowwise", "head": "colwise"}

FACTORIES = {"conv": conv_stack, "deep_conv": deep_conv_stack, "batchnorm": batchnorm_net, "transformer": transformer,
             "decoder": decoder, "rss_decoder": rss_decoder}

#: Nets whose input is token ids, and their vocabulary.
VOCAB = {"transformer": 32, "decoder": 32, "rss_decoder": 256}


def plan_of(case: dict):
    """The case's ``mesh3d.Plan``."""
    from mesh3d import Plan

    return Plan(batch=case.get("batch_mode", "fsdp"), model=TP_STYLES if case["model"] > 1 else {},
                hsdp_shard_size=case.get("hsdp"), checkpoint=case.get("checkpoint", []),
                param_dtype=case.get("param_dtype"), reduce_dtype=case.get("reduce_dtype"))


def attention_of(case: dict):
    """The attention mode the case runs in (``mesh3d.domain.attention_mode``): its ``attention`` key, else auto."""
    from mesh3d.domain import attention_mode

    return attention_mode(case.get("attention", "auto"))


def input_of(case: dict, batch_index: int) -> torch.Tensor:
    """One batch rank's input (whole over the domain), the same on every domain and model rank."""
    g = torch.Generator().manual_seed(100 + batch_index)
    if case["net"] in VOCAB:
        return torch.randint(0, VOCAB[case["net"]], case["input"], generator=g)
    return torch.randn(case["input"], generator=g)


#: Small cases for the exact figures (bytes of parameters, gradients, optimizer state, collectives, halos, files).
EXACT_CASES: dict[str, dict] = {
    "fsdp b2 x d2 slabs, uneven": dict(world=4, batch=2, domain=2, model=1, net="conv", input=(2, 2, 20, 12),
                                       sizes=((12, 8),), dims=(2,)),
    "hsdp b2 x d2, batchnorm": dict(world=4, batch=2, domain=2, model=1, net="batchnorm", input=(2, 2, 14, 10),
                                    sizes=((9, 5),), dims=(2,), batch_mode="hsdp"),
    "fsdp on a 2x2 grid of blocks": dict(world=4, batch=1, domain=(2, 2), model=1, net="conv", input=(1, 2, 18, 14),
                                         sizes=((10, 8), (6, 8)), dims=(2, 3)),
    "ddp d2 x tp2 transformer": dict(world=4, batch=1, domain=2, model=2, net="transformer", input=(2, 13),
                                     sizes=((7, 6),), dims=(1,), batch_mode="ddp"),
    "fsdp b2 x d2 x tp2 transformer": dict(world=8, batch=2, domain=2, model=2, net="transformer", input=(2, 11),
                                           sizes=((6, 5),), dims=(1,)),
    "fsdp d3 transformer, ring attention, uneven": dict(world=3, batch=1, domain=3, model=1, net="transformer",
                                                        input=(2, 14), sizes=((6, 5, 3),), dims=(1,), attention="ring"),
    "fsdp d3 transformer, ring, nested activation checkpointing": dict(
        world=3, batch=1, domain=3, model=1, net="transformer", input=(2, 13), sizes=((5, 0, 8),), dims=(1,),
        attention="ring", checkpoint=["layers.*"]),
    "fsdp d3, empty shard": dict(world=3, batch=1, domain=3, model=1, net="conv", input=(1, 2, 18, 10),
                                 sizes=((10, 8, 0),), dims=(2,)),
    # FSDP's mixed precision: bf16 compute from an fp32 input (cast by FSDP2), fp32 reduction and optimizer state.
    "fsdp b2 x d2 conv, bf16 params, fp32 input": dict(world=4, batch=2, domain=2, model=1, net="conv",
                                                      input=(2, 2, 20, 12), sizes=((12, 8),), dims=(2,),
                                                      param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "fsdp b2 x d2 decoder, bf16 params, bf16 reduction, int tokens": dict(
        world=4, batch=2, domain=2, model=1, net="decoder", input=(2, 24), sizes=((13, 11),), dims=(1,),
        param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
}

#: Where the checkpoint of an exact case is loaded, on another mesh: (case, target mesh "batch,domain,model").
RESHARD_CASES: dict[str, tuple[str, str]] = {
    "fsdp b2 x d2 slabs, uneven": ("fsdp b2 x d2 slabs, uneven", "1,3,1"),
    "fsdp b2 x d2 x tp2 transformer": ("fsdp b2 x d2 x tp2 transformer", "1,1,2"),
}

#: Activations large enough to measure with peak RSS (a few tens of MB per rank) on the CPU, all on 4 ranks.
RSS_CASE = dict(world=4, batch=2, domain=2, model=1, net="deep_conv", input=(2, 2, 160, 128), sizes=((88, 72),), dims=(2,))
RSS_CASES: dict[str, dict] = {
    "fp32 conv": RSS_CASE,
    "bf16 conv from an fp32 input": dict(RSS_CASE, param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "bf16 decoder, int tokens": dict(world=4, batch=2, domain=2, model=1, net="rss_decoder", input=(1, 4096),
                                     sizes=((2048, 2048),), dims=(1,), param_dtype=torch.bfloat16,
                                     reduce_dtype=torch.float32, attention="gather"),
}
