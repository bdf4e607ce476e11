"""Randomness on every axis equals one process seeded alike (docs/parallelize.md, "Dropout"; docs/domain.md).

After ``dm.manual_seed(s)`` every rank of a batch rank's domain and model groups shares one stream; one process
seeded with the same ``s`` draws the reference. fp64, several SGD steps: losses, raw gradients and parameters.

* Model axis: dropout between a colwise and a rowwise module (each model rank draws the one-process mask's columns
  for its hidden units), a SwiGLU's element-wise product, dropout after the rowwise module (replicated), stochastic
  depth; on (1, 1, 2) with plain tokens and on (1, 2, 2) with tokens sharded over the domain, FSDP on batch x domain,
  the MLP under activation checkpointing (its recomputation draws the forward's mask again). Random ops on tensors a
  region computes other than element-wise (heads split by a view) refuse on every rank.
* Domain axis: dropout, dropout2d and stochastic depth on 2x2 blocks (an empty block too) and on the token grid they
  flatten into; the same model under torch.compile (slabs and blocks); and inside activation-checkpoint
  recomputation of a region with domain tensors.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from domain_cases import max_err, sum_grads_over_domain
from parallel_models import full

TOL = 1e-12
D64 = torch.float64
STEPS = 3
T, E = 8, 16                     # tokens (sharded over the domain on (1, 2, 2)) and channels


class TPNet(nn.Module):
    """A channel MLP with dropout inside the tensor-parallel region, a SwiGLU with dropout on the product, dropout
    after a rowwise module, and stochastic depth (a per-sample ``torch.rand``)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(E)
        self.mlp = nn.Sequential(nn.Linear(E, 64), nn.GELU(), nn.Dropout(0.5), nn.Linear(64, E))
        self.gate, self.up, self.down = nn.Linear(E, 32), nn.Linear(E, 32), nn.Linear(32, E)
        self.head = nn.Linear(E, 4)

    def forward(self, x):
        x = x + self.mlp(self.norm(x))
        h = F.dropout(F.silu(self.gate(x)) * self.up(x), 0.3, self.training)
        x = x + F.dropout(self.down(h), 0.2, self.training)
        keep = (torch.rand(x.shape[0], 1, 1, dtype=x.dtype) < 0.75).to(x.dtype) / 0.75
        return self.head(x * keep)


TP_STYLES = {"mlp.0": "colwise", "mlp.3": "rowwise", "gate": "colwise", "up": "colwise", "down": "rowwise"}


def _train_against_one_process(dm, ref: nn.Module, model: nn.Module, inputs, shard, run=None, run_ref=None) -> dict:
    """STEPS SGD steps of ``model`` (fed ``shard(x)``) and of ``ref`` (fed ``x``), each step seeded alike; ``run`` and
    ``run_ref`` call them (compiled, say). A model that ``parallelize`` did not wrap gets its gradients summed over
    the domain by hand."""
    from mesh3d import domain

    run, run_ref = model if run is None else run, ref if run_ref is None else run_ref
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step, (x, y) in enumerate(inputs):
        seed = dm.manual_seed(1000 + step)
        loss = F.mse_loss(run(shard(x)), shard(y))
        loss.backward()
        if not getattr(model, "_mesh3d_parallelized", False):
            sum_grads_over_domain(model.parameters())
        torch.manual_seed(seed)
        want = F.mse_loss(run_ref(x), y)
        want.backward()
        got = loss.to_local() if isinstance(loss, domain.DomainTensor) else loss
        worst["loss"] = max(worst["loss"], abs(float(got) - float(want)))
        worst["grad"] = max(worst["grad"], *(max_err(full(p.grad), q.grad) for p, q in zip(model.parameters(), ref.parameters())))
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad()
    worst["param"] = max(max_err(full(p), q) for p, q in zip(model.parameters(), ref.parameters()))
    return worst


def _tp_body(shape, sizes, checkpoint, compile_options=False):
    from mesh3d import DistributedManager, Plan, domain, parallelize

    dm = DistributedManager.initialize(*shape)
    torch.manual_seed(0)
    ref = TPNet().double()
    model = parallelize(copy.deepcopy(ref), Plan(batch="fsdp", model=TP_STYLES, checkpoint=checkpoint,
                                                 units=["mlp"] if compile_options else None, compile=compile_options))
    g = torch.Generator().manual_seed(1)
    length = sum(sizes) if sizes else T
    inputs = [(torch.randn(2, length, E, dtype=D64, generator=g), torch.randn(2, length, 4, dtype=D64, generator=g))
              for _ in range(STEPS)]
    shard = (lambda t: domain.shard(t, dim=1, sizes=sizes)) if sizes else (lambda t: t)
    return _train_against_one_process(dm, ref, model, inputs, shard)


@pytest.mark.parametrize(("shape", "sizes", "checkpoint", "compile_options"),
                         [((1, 1, 2), None, [], False), ((1, 2, 2), (7, 3), ["mlp"], False),
                          ((1, 1, 2), None, [], {"backend": "aot_eager"})],
                         ids=["1x1x2", "1x2x2-slabs-checkpointed", "1x1x2-compiled"])
def test_dropout_inside_a_tensor_parallel_region_equals_one_process(ranks, shape, sizes, checkpoint, compile_options):
    for worst in ranks.run(shape[0] * shape[1] * shape[2], _tp_body, shape, sizes, checkpoint, compile_options,
                           timeout=180):
        assert max(worst.values()) < TOL, worst


class HeadsDropout(nn.Module):
    """Attention whose probabilities get dropout (heads split by a view inside the region), or SDPA's dropout_p."""

    def __init__(self, sdpa: bool, p: float = 0.1) -> None:
        super().__init__()
        self.sdpa, self.p = sdpa, p
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, -1, 2).permute(2, 0, 3, 1, 4).unbind(0)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p)
        else:
            y = F.dropout((q @ k.transpose(-1, -2)).softmax(-1), self.p, True) @ v
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


def _refusal_body():
    from mesh3d import DistributedManager, Plan, parallelize

    DistributedManager.initialize(1, 1, 2)
    messages = []
    for sdpa in (False, True):
        net = parallelize(HeadsDropout(sdpa), Plan(batch=None, model={"qkv": "colwise", "out": "rowwise"}))
        try:
            net(torch.randn(2, 5, 8))
            messages.append(None)
        except NotImplementedError as e:
            messages.append(str(e))
        net.eval()  # no dropout in evaluation: nothing to refuse
        net(torch.randn(2, 5, 8))
        # p=0 in training draws nothing (Hugging Face's eager attention calls dropout so): nothing to refuse
        parallelize(HeadsDropout(sdpa, p=0.0), Plan(batch=None, model={"qkv": "colwise", "out": "rowwise"}))(torch.randn(2, 5, 8))
    return messages


def test_random_ops_on_heads_split_inside_a_region_refuse_on_every_rank(ranks):
    for dropout, sdpa in ranks.run(2, _refusal_body, timeout=60):
        assert dropout is not None and "torch.nn.functional.dropout inside a tensor-parallel region" in dropout, dropout
        assert "after the rowwise module" in dropout
        assert sdpa is not None and "scaled_dot_product_attention" in sdpa and "tensor-parallel region" in sdpa, sdpa


# ----------------------------------------------------------------------------- the domain axis: blocks, tokens
C, H, W = 3, 12, 10


class DropNet(nn.Module):
    """Dropout on the field, dropout2d, stochastic depth; ``tokens``: dropout on the token grid the field flattens
    into as well; ``checkpointed``: the middle block under torch.utils.checkpoint (recomputed in backward)."""

    def __init__(self, tokens: bool = False, checkpointed: bool = False) -> None:
        super().__init__()
        self.a = nn.Conv2d(C, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1)
        self.lin = nn.Linear(4, 4) if tokens else None
        self.head = nn.Conv2d(4, 1, 1)
        self.tokens, self.checkpointed = tokens, checkpointed

    def middle(self, h):
        keep = (torch.rand(h.shape[0], 1, 1, 1, dtype=h.dtype) < 0.7).to(h.dtype) / 0.7   # timm's drop_path
        return h + self.b(F.dropout2d(h, 0.2, self.training)) * keep

    def forward(self, x):
        h = F.dropout(torch.relu(self.a(x)), 0.3, self.training)
        if self.checkpointed:
            h = torch.utils.checkpoint.checkpoint(self.middle, h, use_reentrant=False)
        else:
            h = self.middle(h)
        if self.tokens:
            b, c, gh, gw = h.shape
            t = h.flatten(2).transpose(1, 2)
            t = t + F.dropout(self.lin(t), 0.25, self.training)
            h = t.transpose(1, 2).reshape(b, c, gh, gw)
        return self.head(h)


def _domain_body(layout, cases):
    """Each case: one model on one layout (slabs over H, or 2x2 blocks over H and W), eager or compiled, against one
    process (compiled alike)."""
    from mesh3d import DistributedManager, domain

    dm = DistributedManager.initialize(batch=1, domain=(2, 2) if layout == "blocks" else 2)
    out = []
    for case in cases:
        torch.manual_seed(0)
        ref = DropNet(case.get("tokens", False)).double()
        model = copy.deepcopy(ref)
        model.checkpointed = case.get("checkpointed", False)  # the reference is not: recomputing changes nothing
        run = run_ref = None
        if case.get("compile"):
            torch._dynamo.reset()
            run = torch.compile(model, backend=case["compile"], dynamic=False, options={"guard_filter_fn": domain.guard_filter})
            run_ref = torch.compile(ref, backend=case["compile"], dynamic=False)
        g = torch.Generator().manual_seed(2)
        inputs = [(torch.randn(1, C, H, W, dtype=D64, generator=g), torch.randn(1, 1, H, W, dtype=D64, generator=g))
                  for _ in range(STEPS)]
        where = {"dims": (2, 3)} if layout == "blocks" else {"dim": 2}
        shard = lambda t: domain.shard(t, sizes=case["sizes"], **where)  # noqa: E731
        # NOTE: Inductor draws its own random numbers (Philox, per graph), not eager's; fallback_random=True is
        # torch's switch for eager's stream, which one process draws too.
        with torch._inductor.config.patch(fallback_random=True):
            out.append(_train_against_one_process(dm, ref, model, inputs, shard, run, run_ref))
    return out


BLOCK_CASES = [{"sizes": ((5, 7), (10, 0))}, {"sizes": ((6, 6), (3, 7)), "tokens": True},
               {"sizes": ((8, 4), (4, 6)), "checkpointed": True, "tokens": True}]


def test_dropout_and_stochastic_depth_on_blocks_and_token_grids_equal_one_process(ranks):
    for per_rank in ranks.run(4, _domain_body, "blocks", BLOCK_CASES, timeout=180):
        for case, worst in zip(BLOCK_CASES, per_rank):
            assert max(worst.values()) < TOL, (case, worst)


def test_dropout_under_torch_compile_equals_one_process(ranks):
    """Slabs with Inductor, blocks and their token grid with aot_eager, an empty block too."""
    slabs = [{"sizes": (4, 8), "compile": "inductor", "checkpointed": True}]
    for per_rank in ranks.run(2, _domain_body, "slabs", slabs, timeout=300):
        assert max(per_rank[0].values()) < TOL, per_rank
    blocks = [{"sizes": ((5, 7), (10, 0)), "compile": "aot_eager", "tokens": True}]
    for per_rank in ranks.run(4, _domain_body, "blocks", blocks, timeout=300):
        assert max(per_rank[0].values()) < TOL, per_rank


def _saved_mask_body(layout):
    """The largest storage a saved tensor keeps alive through a dropout's forward, against the whole field's and this
    rank's part's bytes."""
    from mesh3d import DistributedManager, domain

    dm = DistributedManager.initialize(batch=1, domain=2)
    dm.manual_seed(0)
    x = torch.randn(2, 3, 10, 8, dtype=D64)
    xs = domain.shard(x, dim=2, sizes=(6, 4))
    part = xs.to_local().numel() * 8
    if layout == "strided":
        xs = xs.view(-1, 8)  # the sharded dim merged under the dims before it
    xs.requires_grad_()
    kept = []

    def pack(t):
        local = t.to_local() if isinstance(t, domain.DomainTensor) else t
        kept.append(local.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = F.dropout(xs * 2.0, 0.3, True) + F.dropout2d(xs.view_as(xs) * 1.0, 0.2, True) if layout == "slab" else \
            F.dropout(xs * 2.0, 0.3, True)
    (y.view(2, 3, 10, 8) if layout == "strided" else y).sum().backward()
    return max(kept), part, x.numel() * 8


@pytest.mark.parametrize("layout", ["slab", "strided"])
def test_a_dropout_keeps_only_this_ranks_part_of_the_whole_mask_for_backward(ranks, layout):
    """Every rank draws the whole tensor's mask (the one-process draw); what backward keeps is its own part: a narrowed
    view of the mask, saved by the product, held the whole field's bytes on every rank until backward."""
    for most, part, whole in ranks.run(2, _saved_mask_body, layout, timeout=120):
        assert most <= part < whole, (most, part, whole)
