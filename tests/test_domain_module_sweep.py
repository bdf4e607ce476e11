"""The sweep over the op rules' module-level users: every ``torch.nn`` module below runs on hypothesis-drawn
uneven layouts (empty shards included) at 2 and 3 ranks and equals one process (output, input and parameter
gradients, buffers; fp64). Every registered rule for a ``torch.nn.functional`` op must be reached by one of
them (or be listed in ``NOT_SWEPT`` with the test that covers it), so a new rule cannot land untested."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn

from domain_cases import compare_to_one_process, edge_examples, on_each_layout, shard_sizes
from profiles import examples

TOL = 1e-10
D64 = torch.float64


class _Apply(nn.Module):
    """A function of one input as a module (losses against a target derived from the input, attention)."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _sdpa(x):  # (B, heads, tokens, d): global attention over the sharded tokens
    return F.scaled_dot_product_attention(x, x * 0.5, x.tanh())


# name -> (module factory, input shape for global length L, sharded dim, floating input)
MODULES = {
    "Conv1d": (lambda: nn.Conv1d(3, 4, 3, padding=2, dilation=2), lambda n: (2, 3, n), 2),
    "Conv2d strided": (lambda: nn.Conv2d(3, 4, (2, 3), stride=2, dilation=(1, 2)), lambda n: (2, 3, n, 5), 2),
    "Conv2d same": (lambda: nn.Conv2d(3, 4, 3, padding="same"), lambda n: (2, 3, n, 5), 2),
    "Conv3d": (lambda: nn.Conv3d(2, 2, 3, padding=1), lambda n: (2, 2, n, 4, 3), 2),
    "ConvTranspose1d": (lambda: nn.ConvTranspose1d(3, 2, 3, stride=2, padding=1, output_padding=1), lambda n: (2, 3, n), 2),
    "ConvTranspose2d": (lambda: nn.ConvTranspose2d(3, 2, 2, stride=2), lambda n: (2, 3, n, 5), 2),
    "ConvTranspose3d": (lambda: nn.ConvTranspose3d(2, 2, 3, stride=2, padding=1), lambda n: (2, 2, n, 4, 3), 2),
    "MaxPool1d": (lambda: nn.MaxPool1d(2), lambda n: (2, 3, n), 2),
    "MaxPool2d": (lambda: nn.MaxPool2d(3, stride=2, padding=1), lambda n: (2, 3, n, 5), 2),
    "MaxPool3d": (lambda: nn.MaxPool3d(2), lambda n: (2, 2, n, 4, 3), 2),
    "AvgPool1d": (lambda: nn.AvgPool1d(3, stride=2, padding=1), lambda n: (2, 3, n), 2),
    "AvgPool2d": (lambda: nn.AvgPool2d(2), lambda n: (2, 3, n, 5), 2),
    "AvgPool3d": (lambda: nn.AvgPool3d(2), lambda n: (2, 2, n, 4, 3), 2),
    "AdaptiveAvgPool1d": (lambda: nn.AdaptiveAvgPool1d(3), lambda n: (2, 3, n), 2),
    "AdaptiveMaxPool1d": (lambda: nn.AdaptiveMaxPool1d(2), lambda n: (2, 3, n), 2),
    "AdaptiveAvgPool2d": (lambda: nn.AdaptiveAvgPool2d((3, 2)), lambda n: (2, 3, n, 5), 2),
    "AdaptiveMaxPool2d head": (lambda: nn.Sequential(nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(3, 2)),
                               lambda n: (2, 3, n, 5), 2),
    "AdaptiveAvgPool3d": (lambda: nn.AdaptiveAvgPool3d((2, 2, 1)), lambda n: (2, 2, n, 4, 3), 2),
    "AdaptiveMaxPool3d": (lambda: nn.AdaptiveMaxPool3d(1), lambda n: (2, 2, n, 4, 3), 2),
    "BatchNorm1d": (lambda: nn.BatchNorm1d(3), lambda n: (2, 3, n), 2),
    "BatchNorm2d": (lambda: nn.BatchNorm2d(3), lambda n: (2, 3, n, 5), 2),
    "BatchNorm3d": (lambda: nn.BatchNorm3d(2), lambda n: (2, 2, n, 4, 3), 2),
    "InstanceNorm1d": (lambda: nn.InstanceNorm1d(3, affine=True), lambda n: (2, 3, n), 2),
    "InstanceNorm2d": (lambda: nn.InstanceNorm2d(3, affine=True, track_running_stats=True), lambda n: (2, 3, n, 5), 2),
    "GroupNorm": (lambda: nn.GroupNorm(3, 3), lambda n: (2, 3, n, 5), 2),
    "LayerNorm over tokens": (lambda: nn.LayerNorm(4), lambda n: (2, n, 4), 1),
    "Linear over tokens": (lambda: nn.Linear(4, 3), lambda n: (2, n, 4), 1),
    "Upsample nearest": (lambda: nn.Upsample(scale_factor=2, mode="nearest"), lambda n: (2, 3, n, 5), 2),
    "Upsample bilinear": (lambda: nn.Upsample(scale_factor=1.5, mode="bilinear", align_corners=True),
                          lambda n: (2, 3, n, 5), 2),
    "Upsample linear": (lambda: nn.Upsample(size=7, mode="linear"), lambda n: (2, 3, n), 2),
    "Upsample trilinear": (lambda: nn.Upsample(scale_factor=2, mode="trilinear"), lambda n: (2, 2, n, 4, 3), 2),
    "ZeroPad2d": (lambda: nn.ZeroPad2d((1, 0, 2, 1)), lambda n: (2, 3, n, 5), 2),
    "ReflectionPad2d": (lambda: nn.ReflectionPad2d(1), lambda n: (2, 3, n, 5), 2),
    "ReplicationPad3d": (lambda: nn.ReplicationPad3d(1), lambda n: (2, 2, n, 4, 3), 2),
    "CircularPad1d": (lambda: nn.CircularPad1d(2), lambda n: (2, 3, n), 2),
    "Dropout p=0": (lambda: nn.Sequential(nn.Dropout(0.0), nn.Dropout2d(0.0), nn.AlphaDropout(0.0),
                                          nn.FeatureAlphaDropout(0.0)),
                    lambda n: (2, 3, n, 5), 2),
    "Dropout1d p=0": (lambda: nn.Dropout1d(0.0), lambda n: (2, 3, n), 2),
    "Dropout3d p=0": (lambda: nn.Dropout3d(0.0), lambda n: (2, 2, n, 4, 3), 2),
    "Softmax over channels": (lambda: nn.Sequential(nn.Softmax(dim=1), nn.LogSoftmax(dim=1)), lambda n: (2, 3, n, 5), 2),
    "Embedding": (lambda: nn.Embedding(10, 3), lambda n: (2, n), 1),
    "attention": (lambda: _Apply(_sdpa), lambda n: (2, 2, n, 4), 2),
    "normalize": (lambda: _Apply(lambda x: F.normalize(x, dim=2) * F.normalize(x, p=1, dim=1)), lambda n: (2, 3, n, 5), 2),
    "MSELoss": (lambda: _Apply(lambda x: F.mse_loss(x.tanh(), 0.5 * x)), lambda n: (2, 3, n, 5), 2),
    "L1Loss": (lambda: _Apply(lambda x: F.l1_loss(x.sin(), 0.3 * x, reduction="sum")), lambda n: (2, 3, n, 5), 2),
    "CrossEntropyLoss": (lambda: _Apply(lambda x: F.cross_entropy(x, (2 * x).softmax(1))), lambda n: (2, 3, n, 5), 2),
    # the composite rules (mesh3d/domain/ops/composite.py), as their modules call them
    "CosineSimilarity": (lambda: _Apply(lambda x: nn.CosineSimilarity(dim=1)(x, x.tanh() + 0.1)), lambda n: (2, 3, n, 5), 2),
    "BCEWithLogitsLoss": (lambda: _Apply(lambda x: F.binary_cross_entropy_with_logits(x, torch.sigmoid(0.5 * x))),
                          lambda n: (2, 3, n, 5), 2),
    "BCELoss": (lambda: _Apply(lambda x: F.binary_cross_entropy(torch.sigmoid(x), torch.sigmoid(0.3 * x))),
                lambda n: (2, 3, n, 5), 2),
    "GaussianNLLLoss": (lambda: _Apply(lambda x: F.gaussian_nll_loss(x, 0.5 * x, x.exp())), lambda n: (2, 3, n, 5), 2),
    "HuberLoss": (lambda: _Apply(lambda x: F.huber_loss(x, 0.2 * x, delta=0.5)), lambda n: (2, 3, n, 5), 2),
    "SmoothL1Loss": (lambda: _Apply(lambda x: F.smooth_l1_loss(x, 0.2 * x, beta=0.5)), lambda n: (2, 3, n, 5), 2),
    "KLDivLoss": (lambda: _Apply(lambda x: F.kl_div(F.log_softmax(x, 1), F.softmax(0.5 * x, 1), reduction="batchmean")),
                  lambda n: (2, 3, n, 5), 2),
    "NLLLoss": (lambda: _Apply(lambda x: F.nll_loss(F.log_softmax(x, 1), x.detach().argmax(1))), lambda n: (2, 3, n, 5),
                2),
    "PixelShuffle": (lambda: nn.Sequential(nn.PixelShuffle(2), nn.PixelUnshuffle(2)), lambda n: (2, 4, n, 5), 2),
    "Unfold": (lambda: nn.Sequential(nn.Unfold(3, padding=1, stride=(1, 2)), _Apply(lambda c: c * 2)), lambda n: (2, 3, n, 5),
               2),
    "grid_sample": (lambda: _Apply(lambda x: F.grid_sample(x, torch.tanh(x[:, :2]).permute(0, 2, 3, 1) * 1.2,
                                                            padding_mode="border")), lambda n: (2, 3, n, 5), 2),
    "Fold of Unfold": (lambda: _Apply(lambda x: F.fold(F.unfold(x, (2, 3), padding=(1, 1)).tanh(), x.shape[-2:], (2, 3),
                                                       padding=(1, 1))), lambda n: (2, 3, n, 5), 2),
    "TransformerEncoderLayer": (lambda: nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True),
                                lambda n: (2, n, 4), 1),
    "one_hot": (lambda: _Apply(lambda x: x * F.one_hot(x.detach().argmax(1), 3).movedim(-1, 1).to(x.dtype)),
                lambda n: (2, 3, n, 5), 2),
}
ACTIVATIONS = [nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.ELU, nn.SELU, nn.CELU, nn.Softplus,
               nn.Mish, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Softsign, nn.Tanhshrink, nn.LogSigmoid,
               nn.PReLU, lambda: nn.LeakyReLU(0.1), lambda: nn.Threshold(0.1, -1.0)]
MODULES["activations"] = (lambda: nn.Sequential(*[a() for a in ACTIVATIONS]), lambda n: (2, 3, n, 5), 2)
# in place (after an op that made a fresh tensor) and the functional forms models call directly
INPLACE = [lambda: nn.ReLU(inplace=True), lambda: nn.ELU(inplace=True), lambda: nn.Hardtanh(inplace=True),
           lambda: nn.LeakyReLU(0.1, inplace=True)]
MODULES["activations in place"] = (lambda: nn.Sequential(*[m for a in INPLACE for m in (_Apply(lambda x: x * 1.5), a())]),
                                   lambda n: (2, 3, n, 5), 2)


def _functional_activations(x):  # in-place forms, each on a fresh tensor (the next op's input is not saved)
    x = F.hardtanh_(F.elu_(F.relu_(x * 1.5) - 0.5) * 1.1) * 2
    return F.relu6(F.sigmoid(F.tanh(F.leaky_relu_(x) + 0.1)) * 8)


MODULES["functional activations"] = (lambda: _Apply(_functional_activations), lambda n: (2, 3, n, 5), 2)

#: Registered functional rules no module above reaches, and where they are tested instead.
NOT_SWEPT = {
    "torch.nn.functional.split": "a tensor method more than a module; tests/test_domain_idioms.py",
    # F.tanh / F.sigmoid call input.tanh() / input.sigmoid() without a torch-function check: the Tensor
    # method's rule is what runs (reached above through "functional activations").
    "torch.nn.functional.tanh": "reaches torch.Tensor.tanh's rule",
    "torch.nn.functional.sigmoid": "reaches torch.Tensor.sigmoid's rule",
}


def _sweep_body(sizes: tuple[int, ...]):
    """Every module on the layout ``sizes`` vs one process; returns the worst error per module and the rules hit."""
    from mesh3d import DistributedManager
    from mesh3d.domain.dispatch.registry import RULES, op_name

    DistributedManager.initialize(batch=1, domain=-1)
    hit: set[str] = set()
    lookup = RULES.get

    def recording_get(func):
        rule = lookup(func)
        if rule is not None:
            hit.add(op_name(func))
        return rule

    RULES.get = recording_get  # type: ignore[method-assign]
    errors = {}
    try:
        for i, (name, (make, shape, dim)) in enumerate(MODULES.items()):
            torch.manual_seed(i)
            dims = shape(sum(sizes))
            x = torch.randint(0, 10, dims) if name == "Embedding" else torch.randn(dims, dtype=D64)
            try:
                errors[name] = compare_to_one_process(lambda make=make: make().double(), x, dim, sizes)
            except Exception as err:  # noqa: BLE001 - the test names the module
                errors[name] = f"{type(err).__name__}: {err}"
    finally:
        RULES.get = lookup  # type: ignore[method-assign]
    return errors, sorted(hit)


@st.composite
def _sweep_case(draw):
    """(world, (sizes,)) on a drawn length (the torch.chunk rule written out where the draw says None)."""
    world, length = draw(st.sampled_from((2, 3))), draw(st.integers(8, 13))
    sizes = draw(shard_sizes(length, world)) or tuple(len(c) for c in torch.arange(length).chunk(world))
    return world, (sizes,)


@settings(max_examples=examples(4), deadline=None, suppress_health_check=list(HealthCheck),
          phases=(Phase.explicit, Phase.reuse, Phase.generate))  # a rank-pool failure is not shrunk (slow)
@given(case=_sweep_case())
@edge_examples(9, (2, 3))
def test_every_rules_module_users_equal_one_process(ranks, case):
    from mesh3d.domain.dispatch.registry import RULES, op_name

    world, layouts = case
    results = ranks.run(world, on_each_layout, _sweep_body, layouts, timeout=300 * len(layouts))
    for per_layout in results:
        for sizes, (errors, _) in zip(layouts, per_layout):
            bad = {k: v for k, v in errors.items() if not (isinstance(v, float) and v < TOL)}
            assert not bad, (sizes, bad)
    functional = {op_name(f) for f in RULES if any(f is v for v in vars(F).values())}
    missing = functional - {op for _, hit in results[0] for op in hit} - set(NOT_SWEPT)
    assert not missing, f"registered functional rules that no swept module reaches: {sorted(missing)}"
