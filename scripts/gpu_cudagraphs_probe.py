"""Probe: where the D=1 domain step breaks under Inductor's CUDA graphs (``triton.cudagraphs``), one line per variant.

Usage (on a GPU; on a CPU it runs the same variants without CUDA graphs, as a smoke run)::

    python scripts/gpu_cudagraphs_probe.py

Each variant compiles the small conv stack's loss on a domain tensor and runs 4 steps, calling
``torch.compiler.cudagraph_mark_step_begin()`` before each; the variants differ only in how the loss comes back and
how backward starts. On the H100 (torch 2.11, at 16420e9) all six failed alike on the first backward ("accessing
tensor output of CUDAGraphs that has been overwritten by a subsequent run"), a plain loss cloned before backward
included: the fault is in how the compiled graphs of a subclass input meet CUDA graphs, not in
``DomainTensor.backward``. docs/limitations.md has the state.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import conv_stack  # noqa: E402

from mesh3d import DistributedManager, domain  # noqa: E402
from mesh3d._torch_private import run_backward_from, run_compiled_graphs_without_subclass_dispatch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def variant(name: str, x: torch.Tensor, start_backward, plain_loss: bool = False) -> None:
    """Four compiled steps; prints OK, or FAIL with the first line of the error."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = conv_stack(16, 4).to(DEVICE)

    def loss(t):
        out = (model(t) ** 2).mean()
        return out.to_local() if plain_loss else out

    compiled = torch.compile(loss, dynamic=False, options={"guard_filter_fn": domain.guard_filter,
                                                           "triton.cudagraphs": DEVICE == "cuda"})
    try:
        for _ in range(4):
            torch.compiler.cudagraph_mark_step_begin()
            start_backward(compiled(domain.shard(x, dim=2)))
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        print(f"{name:<44} OK", flush=True)
    except Exception as e:  # noqa: BLE001 - every variant is reported, the next one still runs
        print(f"{name:<44} FAIL {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)


def main() -> None:
    run_compiled_graphs_without_subclass_dispatch()  # NOTE: a no-op on torch >= 2.13
    DistributedManager.initialize(backend="nccl" if DEVICE == "cuda" else "gloo")
    x = torch.randn(2, 1, 48, 48, device=DEVICE)
    variant("A DomainTensor.backward()", x, lambda loss: loss.backward())
    variant("B loss.to_local().backward()", x, lambda loss: loss.to_local().backward())
    variant("C torch.autograd.backward(loss)", x, torch.autograd.backward)
    variant("D graph returns to_local(); .backward()", x, lambda loss: loss.backward(), plain_loss=True)
    variant("E run_backward_from, plain ones", x,
            lambda loss: run_backward_from((loss,), (torch.ones((), device=DEVICE),), False, False, ()))
    variant("F loss.clone().backward()", x, lambda loss: loss.clone().backward())
    DistributedManager.shutdown()


if __name__ == "__main__":
    main()
