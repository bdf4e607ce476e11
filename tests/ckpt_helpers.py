"""Models, mesh configurations and full-state helpers shared by the checkpoint tests.

Lives next to the tests (importable by the pool ranks). Every configuration builds the
same ``Net`` with torch's public APIs on DistributedManager's meshes: TP first
(``parallelize_module`` on the model axis), then FSDP/HSDP bottom-up (``fully_shard``),
root last; "plain" models are DDP-like replicas.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
from torch import nn

from rankpool import forkserver_context

#: name -> (batch, domain, model) mesh shape and data-parallel kind ("plain", "fsdp", "hsdp").
CONFIGS: dict[str, tuple[tuple[int, int, int], str]] = {
    "plain1": ((1, 1, 1), "plain"),
    "fsdp_b2": ((2, 1, 1), "fsdp"),
    "fsdp_d2": ((1, 2, 1), "fsdp"),
    "tp2": ((1, 1, 2), "plain"),
    "ddp2": ((2, 1, 1), "plain"),
    "fsdp_tp4": ((2, 1, 2), "fsdp"),
    "tp4": ((1, 1, 4), "plain"),
    "hsdp4": ((2, 2, 1), "hsdp"),
    "ddp_tp4": ((2, 1, 2), "plain"),
    "fsdp_tp8": ((2, 2, 2), "fsdp"),
    "fsdp8": ((8, 1, 1), "fsdp"),
    "tp8": ((1, 1, 8), "plain"),
    "hsdp_tp8": ((2, 2, 2), "hsdp"),
}


def shutdown() -> None:
    """Shut the manager down (which also drops DTensor's caches of the old mesh)."""
    from mesh3d import DistributedManager

    DistributedManager.shutdown()


def configs_for(world: int) -> list[str]:
    return [n for n, (s, _) in CONFIGS.items() if s[0] * s[1] * s[2] == world]


class Net(nn.Module):
    """Sizes that never divide evenly: Embedding 13x6, Linear 6->10 (10x6), Linear 10->6; int and bool buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 6)
        self.up = nn.Linear(6, 10)
        self.down = nn.Linear(10, 6)
        self.register_buffer("counts", torch.arange(5, dtype=torch.int64))
        self.register_buffer("mask", torch.tensor([True, False, True]))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.emb(idx))))


def make_optimizer(model: nn.Module, kind: str, lr: float = 0.05) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=0.01)
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr, betas=(0.8, 0.95))
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def build(config: str, seed: int, lr: float = 0.05, optim: str = "adamw",
          dtype: torch.dtype = torch.float64) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Initialize the manager for ``config`` and build the parallel Net (fp64 by default) and its AdamW."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from mesh3d import DistributedManager

    shape, kind = CONFIGS[config]
    dm = DistributedManager.initialize(*shape)
    torch.manual_seed(seed)
    model = Net().to(dtype)
    with torch.no_grad():
        model.counts.add_(seed)
    if shape[2] > 1:
        parallelize_module(model, dm.axis_mesh("model"), {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if kind != "plain":
        mesh = dm.batch_domain_mesh if kind == "fsdp" else dm.mesh["batch", "domain"]
        for sub in (model.emb, model.up, model.down, model):
            fully_shard(sub, mesh=mesh)
    # fp64: AdamW divides by sqrt(v)+eps; fp32 summation-order noise near eps would hide real bugs.
    return model, make_optimizer(model, optim, lr)


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    """Every rank sees the same batch, so data parallelism averages identical gradients."""
    for step in steps:
        g = torch.Generator().manual_seed(1000 + step)
        idx = torch.randint(0, 13, (7,), generator=g)
        loss = model(idx).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def full_state(model: nn.Module, opt: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """Global model and optimizer state on every rank (DTensors gathered with full_tensor)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()

    out = {k: full(v) for k, v in get_model_state_dict(model).items()}
    if opt is not None:
        for fqn, state in get_optimizer_state_dict(model, opt)["state"].items():
            for key, value in state.items():
                out[f"optimizer.{fqn}.{key}"] = full(value)
    return out


def diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Names whose values are not bitwise equal (or that are missing on one side)."""
    bad = sorted(set(got) ^ set(want))
    for k in sorted(set(got) & set(want)):
        if got[k].dtype != want[k].dtype or got[k].shape != want[k].shape or not torch.equal(got[k], want[k]):
            bad.append(k)
    return bad


def synthetic_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    """Optimizer steps on seeded full-size gradients, each rank taking its own box of them.

    Needs no forward pass, so it works for layouts whose forward torch cannot run
    (uneven tensor parallelism: RowwiseParallel assumes even input shards).
    """
    from torch.distributed.tensor import DTensor

    from mesh3d.checkpoint.chunks import local_box

    for step in steps:
        for i, (name, p) in enumerate(model.named_parameters()):
            g = torch.Generator().manual_seed(step * 100 + i)
            full = torch.randn(p.shape, generator=g, dtype=p.dtype)
            if isinstance(p, DTensor):
                box = local_box(name, p)
                local = full[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.shape))].contiguous()
                p.grad = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                            stride=p.stride())
            else:
                p.grad = full
        opt.step()
        opt.zero_grad()


def exit_code_of_child(target: Callable[..., None], *args: Any, timeout: float = 120) -> int:
    """Run ``target(*args)`` in a new process that must end with ``os._exit`` (3 if it returns); its exit code.

    ``target`` is a module-level function (the child imports it by name) that builds what it needs itself.
    NOTE: never ``os.fork()`` the pytest process: another of its threads (torch's, a background save's
    writer) may hold a lock that the child would then wait on forever. The child comes from the rank pool's
    forkserver, a process of its own started by exec, single-threaded, with torch and mesh3d imported.
    """
    child = forkserver_context().Process(target=_run_then_exit, args=(target, args), daemon=True)
    child.start()
    child.join(timeout)  # bounds a hang only
    if child.exitcode is None:
        child.kill()
        child.join()
        raise AssertionError(f"the child process did not exit within {timeout} s")
    return child.exitcode


def _run_then_exit(target: Callable[..., None], args: tuple) -> None:
    try:
        target(*args)
    finally:
        os._exit(3)  # never return into multiprocessing's own exit path
