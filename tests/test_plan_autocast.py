"""A model's ``torch.autocast`` regions, planned on meta tensors as the device runs them (mesh3d/planner/autocast.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mesh3d import Plan
from mesh3d.planner import InputSpec, JobMesh, plan_job
from mesh3d.planner.autocast import AutocastEmulation


class Mixed(nn.Module):
    """Convs, linears and a matmul in a bf16 region of ``device``, a float32 sub-region, a loss-like reduction."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.device = device
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        with torch.autocast(self.device, dtype=torch.bfloat16):
            y = F.relu(self.conv(x))
            z = self.lin(y.mean((2, 3)))
            z = self.lin(z) @ self.lin.weight  # the same weight three times: one cached cast
            with torch.autocast(self.device, enabled=False):
                w = torch.tanh(z.float() * 2)
            return F.softmax(z, -1), F.mse_loss(z, w), y


def _saved(run) -> list[tuple[tuple[int, ...], torch.dtype]]:
    saved: list[tuple[tuple[int, ...], torch.dtype]] = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs = run()
    return sorted(saved, key=str) + [(tuple(o.shape), o.dtype) for o in outs]


def test_cpu_regions_on_meta_save_what_cpu_autocast_saves():
    """The same model: real CPU autocast, and the emulation on meta tensors; every tensor saved for backward and every
    output with the same shape and dtype (CPU's op lists: linear/conv/matmul in bf16, mse_loss in fp32)."""
    torch.manual_seed(0)
    real = _saved(lambda: Mixed("cpu")(torch.randn(2, 3, 8, 8)))
    with torch.device("meta"):
        model = Mixed("cpu")
    emulation = AutocastEmulation("cpu")
    with emulation.patched(), emulation.casts():
        planned = _saved(lambda: model(torch.empty(2, 3, 8, 8, device="meta")))
    assert planned == real
    assert (tuple(), torch.float32) in real and (2, 8, 8, 8) in [s for s, d in real if d == torch.bfloat16]


def test_cuda_regions_follow_cuda_s_op_lists_on_a_machine_without_cuda():
    """Documented CUDA policy: lower precision for conv/linear/matmul, float32 for group_norm (cast) and for softmax
    and sum (computed in float32), float64 never cast; a parameter cast once per region; a disabled sub-region runs
    as written. Here torch.autocast('cuda') would disable itself (no CUDA), the plan keeps it."""
    with torch.device("meta"):
        conv, norm, lin = nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8), nn.Linear(8, 8)
    x = torch.empty(2, 3, 8, 8, device="meta")
    emulation = AutocastEmulation("cuda")
    with emulation.patched(), emulation.casts():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = conv(x)
            n = norm(y)
            z = lin(y.mean((2, 3)))
            first = emulation.to(lin.weight, torch.bfloat16, True)
            assert emulation.to(lin.weight, torch.bfloat16, True) is first
            soft, total = F.softmax(z, -1), z.sum()
            double = lin.double()(torch.empty(2, 8, dtype=torch.float64, device="meta"))
            with torch.autocast("cuda", enabled=False):
                plain = lin.float()(torch.empty(2, 8, device="meta"))
        outside = conv(x)
    assert (y.dtype, n.dtype, z.dtype, soft.dtype, total.dtype) == (torch.bfloat16, torch.float32, torch.bfloat16,
                                                                    torch.float32, torch.float32)
    assert double.dtype == torch.float64 and plain.dtype == torch.float32 and outside.dtype == torch.float32
    assert torch.amp.autocast_mode.autocast.__init__.__module__ == "torch.amp.autocast_mode"  # restored


def test_a_plan_of_a_model_with_an_autocast_region_computes_in_bf16_and_recomputes_so():
    """Planned for CUDA: the region's activations in bf16 (about half the fp32 plan); with the block checkpointed, the
    recomputation re-enters the forward's autocast state (below the fp32 checkpointed plan as well)."""
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1))

        def forward(self, x):
            return self.body(x)

    class Net(nn.Module):
        def __init__(self, cast: bool) -> None:
            super().__init__()
            self.cast = cast
            self.blocks = nn.ModuleList(Block() for _ in range(3))

        def forward(self, x):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.cast):
                for block in self.blocks:
                    x = block(x)
            return x.float()

    peak = lambda cast, checkpoint: plan_job(lambda: Net(cast), Plan(checkpoint=checkpoint),  # noqa: E731
                                             JobMesh.resolve(1, 1, 1, 1), InputSpec((2, 16, 64, 64))
                                             ).classes[0].memory["step_peak"]
    assert peak(True, []) < 0.65 * peak(False, [])
    assert peak(True, ["blocks.*"]) < 0.65 * peak(False, ["blocks.*"])
    assert peak(True, ["blocks.*"]) < peak(True, [])
