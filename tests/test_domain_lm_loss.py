"""A language model's loss line on a sequence sharded along T, as its authors write it:
``F.cross_entropy(logits.view(-1, V), targets.view(-1))`` (the logits' rows a strided layout, B samples' tokens merged),
against one process (fp64, 3 SGD steps: losses and parameters; embedding, causal attention, head). Targets sharded like
the sequence or plain; mean, sum and ``reduction='none'`` then ``.mean()``; ``ignore_index`` (one rank's tokens all
ignored), class weights, label smoothing, class probabilities, the legacy ``reduce=False``; 2 ranks and 3 uneven ranks
with an empty shard. Targets of another length are refused on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from domain_cases import trained_alike

B, T, C, V = 2, 9, 8, 11
D64 = torch.float64


class _LM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(V, C, dtype=D64), torch.nn.Linear(C, V, dtype=D64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        q = h.view(h.shape[0], h.shape[1], 2, C // 2).transpose(1, 2)
        h = h + F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(h.shape)
        return self.head(h)


def _losses(step: int) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    targets = torch.randint(0, V, (B, T), generator=g)
    ignored = targets.clone()
    ignored[:, :3] = -100  # NOTE: the first rank's 3 tokens of each sample, all ignored on 3 ranks
    probs = torch.rand(B * T, V, dtype=D64, generator=g).softmax(-1)
    weight = torch.rand(V, dtype=D64, generator=g) + 0.5
    flat = lambda t, shard: (shard(t) if t.ndim == 2 else t).reshape(-1)  # noqa: E731
    return {
        "mean": lambda lg, s: F.cross_entropy(lg, flat(targets, s)),
        "sum, plain targets": lambda lg, s: F.cross_entropy(lg, targets.view(-1), reduction="sum"),
        "none then mean": lambda lg, s: F.cross_entropy(lg, flat(targets, s), reduction="none").mean(),
        "ignore_index": lambda lg, s: F.cross_entropy(lg, flat(ignored, s)),
        "class weights, smoothing": lambda lg, s: F.cross_entropy(lg, flat(ignored, s), weight=weight,
                                                                  label_smoothing=0.1),
        "probabilities": lambda lg, s: F.cross_entropy(lg, probs),
        "legacy reduce=False": lambda lg, s: F.cross_entropy(lg, flat(targets, s), reduce=False).sum() / 7,
    }


def _body(sizes: tuple[int, ...]) -> dict:
    import warnings

    from mesh3d import DistributedManager, domain

    warnings.simplefilter("ignore", UserWarning)  # NOTE: torch warns that size_average and reduce are deprecated
    DistributedManager.initialize(batch=1, domain=len(sizes))
    torch.manual_seed(0)
    ref = _LM()
    shard = lambda t: domain.shard(t, dim=1, sizes=sizes)  # noqa: E731
    worst = {}
    for name in _losses(0):
        def loss(model, step, sharded, name=name):
            tokens = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(step))
            logits = model(shard(tokens) if sharded else tokens)
            return _losses(step)[name](logits.view(-1, V), shard if sharded else (lambda t: t))
        worst[name] = trained_alike(ref, loss, 3, 0.2)
    logits = _LM()(shard(torch.zeros(B, T, dtype=torch.long))).view(-1, V)
    try:
        F.cross_entropy(logits, torch.zeros(B * T - 1, dtype=torch.long))
        worst["refusal"] = "ran"
    except ValueError as err:
        worst["refusal"] = str(err)
    DistributedManager.shutdown()
    return worst


@pytest.mark.parametrize("sizes", [(5, 4), (3, 0, 6)], ids=["2 ranks", "3 ranks, an empty shard"])
def test_language_model_loss_on_a_sharded_sequence_trains_as_one_process(ranks, sizes):
    for worst in ranks.run(len(sizes), _body, sizes):
        assert worst.pop("refusal").startswith("F.cross_entropy: the target must be laid out like the logits' 18 rows")
        assert all(err < 1e-10 for err in worst.values()), worst
