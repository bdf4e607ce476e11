"""torch.nn's Transformer layers and nn.MultiheadAttention on tokens sharded along the sequence (issue 67), against
one process in fp64 on 2 and 3 uneven ranks (an empty shard): output, input gradient and every parameter gradient,
masks included (a padding mask sharded like the tokens too); the attention weights (need_weights=True) and
add_zero_attn refused by name on every rank."""

from __future__ import annotations

import pytest
import torch

from domain_cases import compare_to_one_process

D64 = torch.float64
TOL = 1e-10


def _layer(**kwargs) -> torch.nn.TransformerEncoderLayer:
    return torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, dtype=D64, **kwargs)


def _called(make, **kwargs):
    """A module from ``make`` called with ``kwargs`` (compare_to_one_process copies modules, not functions)."""
    class Called(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = make()

        def forward(self, x):
            return self.inner(x, **kwargs)

    return Called


class SelfAttention(torch.nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.mha = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=D64, **kwargs)

    def forward(self, x):
        return self.mha(x, x * 2, x, need_weights=False)[0]


class DecoderOnMemory(torch.nn.Module):
    """A decoder layer: causal self-attention on the sharded tokens, cross-attention to a plain memory."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True, dtype=D64)
        self.register_buffer("memory", torch.randn(2, 5, 8, dtype=D64))

    def forward(self, x):
        return self.layer(x, self.memory, tgt_is_causal=False)


class PaddedLikeItsTokens(torch.nn.Module):
    """An encoder layer whose key padding mask is laid out like its tokens: sharded with them on the mesh."""

    def __init__(self, padding: torch.Tensor):
        super().__init__()
        self.inner = _layer()
        self.register_buffer("padding", padding)

    def forward(self, x):
        from mesh3d import domain

        mask = self.padding
        if isinstance(x, domain.DomainTensor):
            mask = domain.shard(mask, dim=1, sizes=x.spec.sizes)
        return self.inner(x, src_key_padding_mask=mask)


def _layers_body(sizes):
    from mesh3d import DistributedManager, domain

    DistributedManager.initialize(batch=1, domain=-1)
    torch.manual_seed(0)
    length = sum(sizes)
    x = torch.randn(2, length, 8, dtype=D64)
    padding = torch.zeros(2, length, dtype=torch.bool)
    padding[0, -2:], padding[1, 1] = True, True
    causal = torch.nn.Transformer.generate_square_subsequent_mask(length, dtype=D64)
    cases = {
        "encoder layer": _layer,
        "norm first, gelu": lambda: _layer(norm_first=True, activation="gelu"),
        "key padding mask": _called(_layer, src_key_padding_mask=padding),
        "key padding mask sharded like the tokens": lambda: PaddedLikeItsTokens(padding),
        "causal mask": _called(_layer, src_mask=causal, is_causal=True),
        "two layers": lambda: torch.nn.TransformerEncoder(_layer(), 2, enable_nested_tensor=False),
        "self-attention, key differs": SelfAttention,
        "self-attention, no bias": lambda: SelfAttention(bias=False),
        "decoder layer, plain memory": DecoderOnMemory,
    }
    errors = {}
    for i, (name, make) in enumerate(cases.items()):
        try:
            errors[name] = compare_to_one_process(make, x, 1, sizes, seed=i)
        except NotImplementedError as e:
            errors[name] = f"refused: {str(e)[:200]}"
    seq_first = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, dtype=D64)
    errors["sequence first"] = compare_to_one_process(lambda: seq_first, x.transpose(0, 1).contiguous(), 0, sizes, 9)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=D64)
    xs = domain.shard(x, dim=1, sizes=sizes)
    try:
        mha(xs, xs, xs)
        errors["weights"] = "ran"
    except NotImplementedError as e:
        errors["weights"] = str(e)
    zero_attn = torch.nn.MultiheadAttention(8, 2, add_zero_attn=True, batch_first=True, dtype=D64)
    try:
        zero_attn(xs, xs, xs, need_weights=False)
        errors["add_zero_attn"] = "ran"
    except NotImplementedError as e:
        errors["add_zero_attn"] = str(e)
    return errors


@pytest.mark.parametrize("sizes", [(5, 4), (4, 0, 3)], ids=["2-uneven", "3-empty-shard"])
def test_transformer_layers_on_sharded_tokens_equal_one_process(ranks, sizes):
    for errors in ranks.run(len(sizes), _layers_body, sizes, timeout=180):
        refused = errors.pop("weights")
        assert "need_weights=True" in refused and "need_weights=False" in refused, refused
        refused = errors.pop("add_zero_attn")
        assert "add_zero_attn" in refused and "without them" in refused, refused
        bad = {k: v for k, v in errors.items() if not (isinstance(v, float) and v < TOL)}
        assert not bad, bad
