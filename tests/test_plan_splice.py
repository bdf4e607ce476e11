"""Deep block stacks planned from 4 of their blocks (``mesh3d.planner.repeat``) give the figures of simulating them all.

Each case plans the same job twice, spliced and with every block simulated (``splice_blocks=False``), and the two
reports must agree in every figure: per-class memory and its breakdown, collectives, domain traffic, checkpoint
files, the verdict. A stack that is not periodic falls back to the whole model (and agrees too).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parallel_models import Transformer
from plan_models import TP_STYLES, ConvStack, _LLAMA

from mesh3d import Plan
from mesh3d.domain import attention_mode
from mesh3d.domain.attention import workspace
from mesh3d.planner import InputSpec, JobMesh, plan_job
from mesh3d.planner.layout import ModelLayout
from mesh3d.planner.repeat import find_repeat
from mesh3d.planner.simulate import Simulator
from mesh3d.planner.spec import load_spec


def _decoder(layers: int = 9) -> nn.Module:
    return load_spec(f"{_LLAMA}:Decoder")(vocab=96, dim=32, n_heads=4, hidden=48, layers=layers, max_seq=40)


_LLAMA_STYLES = {"layers.*.attn.w[qkv]": "colwise", "layers.*.attn.wo": "rowwise", "layers.*.mlp.w[13]": "colwise",
                 "layers.*.mlp.w2": "rowwise"}


class _Alternating(nn.Module):
    """Eight identical blocks, every other one followed by an op of its own: period two, not one."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(12, 12) for _ in range(8))
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i % 2:
                x = torch.cat([x, x], -1)[..., :12] * 2
        return self.head(x)


CASES = {
    "decoder: fsdp x ring attention over 4 uneven domain ranks x tp2, cuda": dict(
        model=_decoder, plan=Plan(model=_LLAMA_STYLES, batch="fsdp"), mesh=JobMesh.resolve(16, 2, 4, 2),
        inputs=InputSpec((1, 40), torch.int64, (1,), ((12, 10, 10, 8),)), device="cuda", to=JobMesh.parse("4,2,2"),
        attention="ring"),
    "decoder: bf16 mixed precision, checkpointed blocks, cpu": dict(
        model=_decoder, plan=Plan(model=_LLAMA_STYLES, batch="fsdp", param_dtype=torch.bfloat16,
                                  reduce_dtype=torch.float32, checkpoint=["layers.*"]),
        mesh=JobMesh.resolve(8, 2, 2, 2), inputs=InputSpec((1, 40), torch.int64, (1,)), device="cpu", to=None),
    "transformer: hsdp x tp2, no domain": dict(
        model=lambda: Transformer(vocab=32, dim=16, n_heads=4, hidden=48, layers=10),
        plan=Plan(model=TP_STYLES, batch="hsdp", hsdp_shard_size=2), mesh=JobMesh.resolve(8, 4, 1, 2),
        inputs=InputSpec((2, 11), torch.int64), device="cuda", to=None),
    "conv stack: fsdp over 3 slabs with an empty one": dict(
        model=lambda: ConvStack(width=8, depth=9, channels=2), plan=Plan(batch="fsdp"), mesh=JobMesh.resolve(3, 1, 3, 1),
        inputs=InputSpec((1, 2, 16, 10), dims=(2,), sizes=((10, 6, 0),)), device="cpu", to=None),
    "conv stack: no batch parallelism, 2x2 blocks": dict(
        model=lambda: ConvStack(width=8, depth=8, channels=2), plan=Plan(batch=None), mesh=JobMesh.resolve(4, 1, (2, 2), 1),
        inputs=InputSpec((1, 2, 16, 12), dims=(2, 3)), device="cuda", to=None),
}


def _report(case: dict, splice_blocks: bool) -> tuple[dict, str]:
    with attention_mode(case.get("attention", "auto")):
        job = plan_job(case["model"], case["plan"], case["mesh"], case["inputs"], device=case["device"], to=case["to"],
                       device_memory=2**30, splice_blocks=splice_blocks)
    report = job.to_json()
    report.pop("seconds")
    return report, report.pop("spliced")


@pytest.mark.parametrize("name", CASES)
def test_a_spliced_plan_equals_every_block_simulated(name):
    case = CASES[name]
    spliced, how = _report(case, True)
    whole, none = _report(case, False)
    assert how.startswith("4 of the ") and none == "", (how, none)
    assert spliced == whole


def test_a_stack_that_is_not_periodic_is_simulated_whole():
    """Blocks alike in their parameters whose step differs every other block: no splice, and the whole model's figures
    (a splice of the 4-block step would miss the odd blocks' extra tensors)."""
    case = dict(model=_Alternating, plan=Plan(batch="fsdp"), mesh=JobMesh.resolve(2, 2, 1, 1),
                inputs=InputSpec((4, 12)), device="cpu", to=None)
    assert find_repeat(_Alternating()) == ("blocks", 8)
    spliced, how = _report(case, True)
    whole, _ = _report(case, False)
    assert how == "" and spliced == whole


def test_stacks_that_are_shallow_tied_or_shared_are_not_spliced():
    assert find_repeat(_decoder(9)) == ("layers", 9)
    assert find_repeat(_decoder(7)) is None  # too few blocks to gain from a splice
    shared = _decoder(9)
    shared.layers[5] = shared.layers[2]  # the same block twice
    assert find_repeat(shared) is None
    tied = _decoder(9)
    tied.layers[3].attn.wq.weight = tied.layers[4].attn.wq.weight
    assert find_repeat(tied) is None
    assert find_repeat(nn.Sequential(*(nn.Linear(4, 4) for _ in range(9)))) is None  # the model itself: not cut
    subclass = _decoder(9)
    subclass.layers = type("Layers", (nn.ModuleList,), {})(list(subclass.layers))
    assert find_repeat(subclass) is None  # its own code could do more than run the blocks
    unlike = _decoder(9)
    unlike.layers[8].mlp.w2 = nn.Linear(48, 32, bias=True)
    assert find_repeat(unlike) is None


def _rank_one(first: list[int]) -> list[tuple]:
    """Domain rank 1 of a decoder with ring attention on a fresh simulator, after simulating ``first``: its figures and
    its record of memory events."""
    with torch.device("meta"):
        model = _decoder(2)
    plan, mesh = Plan(batch="fsdp"), JobMesh.resolve(4, 1, 4, 1)
    layout = ModelLayout.build(model, plan, mesh)
    sim = Simulator(model, plan, layout, InputSpec((1, 40), torch.int64, (1,)), device="cuda", blocks=("layers", 2))
    try:
        with attention_mode("ring"):
            for d in first:
                sim.run(d)
            rank = sim.run(1)
        assert sim.last_trace is not None
        return [rank, sim.last_trace.events]
    finally:
        sim.close()


def test_a_rank_s_figures_do_not_depend_on_what_was_simulated_before():
    """What a simulation caches (op outputs, the ring's kernel workspace measured once per shape, a plan's index of
    rows) must not change what it counts. Before, each broke it: ``linear``'s ``_unsafe_view`` (the matmul's storage,
    no bytes) came from the cache as a fresh tensor on later calls (the logits counted twice on every rank but the
    first); the kernels were measured inside the memory tracker on first sight of a shape; the host-side index a
    ring plan builds on first use was counted in the step that built it."""
    workspace._block_workspace.cache_clear()
    cold = _rank_one([])
    assert cold == _rank_one([1]) == _rank_one([0]) == _rank_one([2, 3, 0])
    assert cold[0].peak > 0 and cold[0].domain_bytes["forward"] > 0
