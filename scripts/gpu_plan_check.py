#!/usr/bin/env python
"""``mesh3d plan`` against a real step on a device: planned and measured step peak per case (issue 49).

The cases: the U-Net of ``examples/volume_unet3d.py`` (width 32; 1x1x128^3 with HSDP, 2x1x96^3 with FSDP), the
decoder of ``examples/llama_decoder.py`` (dim 2048, 4 layers, 16 heads, 1x8192 tokens) with ``PLAN`` and
``PLAN_BF16``, and a 2-D conv/GroupNorm/strided/transposed stack of 64 channels on 4x3x1024x512 in fp32 and with
FSDP's bf16 mixed precision from its fp32 input. Each runs in a world of one: the plan of the step
(``plan_job(..., device="cuda")``) against ``torch.cuda.max_memory_allocated()`` above the resting state over one
forward and backward (after a first step and an optimizer step: optimizer state present, gradients kept
allocated and zeroed). Goal: planned / measured within 0.9-1.1, never more than 10 % under.

On the CPU (``device="cpu"``, ``scale="cpu"``: the same models, smaller) the same code plans with CPU kernels and
measures peak RSS growth (``mesh3d.planner.measure.PeakRss``): how the test suite checks this script's logic.

Usage::

    python scripts/gpu_plan_check.py [--out DIR]        # on a GPU; also run by scripts/gpu_check.py
    rows = run_cases(torch.device("cuda"))              # [{"case", "planned", "measured", "ratio", ...}]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mesh3d import DistributedManager, Plan, parallelize  # noqa: E402
from mesh3d.planner import InputSpec, JobMesh, default_loss, plan_job  # noqa: E402
from mesh3d.planner.measure import PeakRss, local_tensors, storage_bytes  # noqa: E402
from mesh3d.planner.spec import load_spec  # noqa: E402

__all__ = ["ISSUE_49_MIB", "PlanCase", "cases", "measure_case", "plan_case", "run_cases"]

_EXAMPLES = ROOT / "examples"

#: Issue 49's measurements (one H200, torch 2.11), MiB above the resting state, for the cases of the same name.
ISSUE_49_MIB = {"U-Net 1x1x128^3 HSDP": 3941, "U-Net 2x1x96^3 FSDP": 3328, "decoder 1x8192 PLAN": 7448,
                "decoder 1x8192 PLAN_BF16": 3725}


class ConvStack2d(nn.Module):
    """A 2-D conv/GroupNorm/SiLU stem, a strided conv down, a transposed conv back up, a head."""

    def __init__(self, width: int = 64, channels: int = 3) -> None:
        super().__init__()
        act = lambda: (nn.GroupNorm(8, width), nn.SiLU())  # noqa: E731
        self.stem = nn.Sequential(nn.Conv2d(channels, width, 3, padding=1), *act())
        self.down = nn.Sequential(nn.Conv2d(width, width, 3, stride=2, padding=1), *act())
        self.up = nn.Sequential(nn.ConvTranspose2d(width, width, 2, stride=2), *act())
        self.head = nn.Conv2d(width, channels, 3, padding=1)

    def forward(self, x):
        return self.head(self.up(self.down(self.stem(x))))


@dataclass(frozen=True)
class PlanCase:
    """One model, plan and batch-rank input; ``vocab``: token ids in [0, vocab) when the input is int64."""

    name: str
    factory: Callable[[], nn.Module]
    plan: Plan
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    vocab: int = 0

    def inputs(self) -> InputSpec:
        return InputSpec(self.shape, self.dtype, (1,) if self.vocab else None)


def _example(spec: str, **kwargs: Any) -> Callable[[], nn.Module]:
    return lambda: load_spec(f"{_EXAMPLES}/{spec}")(**kwargs)


def cases(scale: str = "gpu") -> list[PlanCase]:
    """The cases at ``scale`` "gpu" (issue 49's sizes) or "cpu" (the same models, tens of MiB a step).

    Usage: ``[c.name for c in cases()]``
    """
    big = scale == "gpu"
    llama = f"{_EXAMPLES}/llama_decoder.py"
    plan, plan_bf16 = load_spec(f"{llama}:PLAN"), load_spec(f"{llama}:PLAN_BF16")
    unet = _example("volume_unet3d.py:UNet3d", width=32 if big else 8)
    tokens = 8192 if big else 2048
    decoder = _example("llama_decoder.py:Decoder", **(dict(vocab=32000, dim=2048, n_heads=16, hidden=5632, layers=4)
                                                      if big else dict(vocab=256, dim=128, n_heads=4, hidden=344,
                                                                       layers=2)), max_seq=tokens)
    stack = (lambda: ConvStack2d(64)) if big else (lambda: ConvStack2d(16))
    image = (4, 3, 1024, 512) if big else (2, 3, 192, 128)
    bf16 = Plan(batch="fsdp", param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return [
        PlanCase("U-Net 1x1x128^3 HSDP" if big else "U-Net 1x1x48^3 HSDP", unet, Plan(batch="hsdp"),
                 (1, 1, 128, 128, 128) if big else (1, 1, 48, 48, 48)),
        PlanCase("U-Net 2x1x96^3 FSDP" if big else "U-Net 2x1x40^3 FSDP", unet, Plan(batch="fsdp"),
                 (2, 1, 96, 96, 96) if big else (2, 1, 40, 40, 40)),
        PlanCase(f"decoder 1x{tokens} PLAN", decoder, plan, (1, tokens), torch.int64, 32000 if big else 256),
        PlanCase(f"decoder 1x{tokens} PLAN_BF16", decoder, plan_bf16, (1, tokens), torch.int64, 32000 if big else 256),
        PlanCase(f"conv stack {'x'.join(map(str, image))} fp32", stack, Plan(batch="fsdp"), image),
        PlanCase(f"conv stack {'x'.join(map(str, image))} FSDP bf16", stack, bf16, image),
    ]


def plan_case(case: PlanCase, device: str) -> dict[str, int]:
    """The planned memory of one rank in a world of one (``device``: whose kernels: "cuda" or "cpu").

    Usage: ``plan_case(cases()[0], "cuda")["step_peak"]``
    """
    job = plan_job(case.factory, case.plan, JobMesh.resolve(1, 1, 1, 1), case.inputs(), device=device, name=case.name)
    return dict(job.classes[0].memory)


def _input(case: PlanCase, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(0)
    if case.vocab:
        return torch.randint(0, case.vocab, case.shape, generator=g).to(device)
    return torch.randn(case.shape, generator=g).to(device)


def measure_case(case: PlanCase, device: torch.device) -> dict[str, int]:
    """One step measured on ``device`` in the manager's world of one: bytes held and the step's peak above rest.

    Usage: ``DistributedManager.initialize(); measure_case(cases()[0], torch.device("cuda"))["step_peak"]``
    """
    cuda = device.type == "cuda"
    if not cuda:
        PeakRss.follow_tensor_lifetimes()  # before the first step: see PeakRss
    with torch.device("meta"):
        model = case.factory()
    model = parallelize(model, case.plan, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = _input(case, device)
    default_loss(model(x)).backward()  # a first step: lazy initialization, then optimizer state
    opt.step()
    opt.zero_grad(set_to_none=False)  # gradients kept allocated and zeroed
    if cuda:
        torch.cuda.synchronize()
        rest = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        default_loss(model(x)).backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - rest
    else:
        peak, _ = PeakRss.of_steps(lambda m=model, i=x: default_loss(m(i)).backward(),
                                   before=lambda o=opt: o.zero_grad(set_to_none=False))
    out = {"step_peak": peak, "params": storage_bytes(local_tensors(model.parameters())),
           "optimizer": storage_bytes(local_tensors(v for s in opt.state.values() for v in s.values()))}
    del model, opt, x
    if cuda:
        torch.cuda.empty_cache()
    return out


def run_cases(device: torch.device, scale: str | None = None, names: list[str] | None = None) -> list[dict[str, Any]]:
    """Plan and measure every case (or those ``names``) on ``device``; print one line each; the rows.

    Usage: ``run_cases(torch.device("cuda"))``
    """
    scale = scale or ("gpu" if device.type == "cuda" else "cpu")
    rows = []
    for case in cases(scale):
        if names is not None and case.name not in names:
            continue
        row: dict[str, Any] = {"case": case.name, "device": str(device)}
        try:
            planned = plan_case(case, "cuda" if device.type == "cuda" else "cpu")
            measured = measure_case(case, device)
            row.update(planned=planned["step_peak"], measured=measured["step_peak"],
                       ratio=planned["step_peak"] / max(measured["step_peak"], 1),
                       params_equal=planned["params"] == measured["params"],
                       optimizer_equal=planned["optimizer"] == measured["optimizer"],
                       issue_49_mib=ISSUE_49_MIB.get(case.name))
            print(f"  {case.name:<36} planned {row['planned'] / 2**20:9.1f} MiB  measured "
                  f"{row['measured'] / 2**20:9.1f} MiB  planned/measured {row['ratio']:.3f}", flush=True)
        except Exception as err:  # noqa: BLE001 - one case failing (an OOM) still lets the others run
            row["error"] = f"{type(err).__name__}: {err}"
            print(f"  {case.name:<36} FAILED {row['error']}", flush=True)
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="folder for gpu_plan_check.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this check is for a GPU machine (tests/test_gpu_plan_check.py runs its CPU form)")
        return 1
    dm = DistributedManager.initialize()
    rows = run_cases(dm.device)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_plan_check.json").write_text(json.dumps(rows, indent=1))
    DistributedManager.shutdown()
    return 0 if all("ratio" in r and 0.9 <= r["ratio"] <= 1.1 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
