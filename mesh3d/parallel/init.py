"""Mesh-independent initialization: the same seed gives bit-identical full weights on every mesh shape.

Each module that owns parameters is rebuilt at full size on the CPU (its own parameters only,
not its children), its ``reset_parameters()`` (or the user's ``init_fn``) runs under a
generator seeded by ``(seed, module FQN)``, and every rank copies its shard out of that full
tensor. Nothing depends on the mesh, the rank or the order modules are visited.
Memory: one module's own full parameters on the CPU at a time (e.g. the largest Linear).

Usage::

    with torch.device("meta"):                             # or mesh3d.meta_builds.built_on_meta(), which also
        model = Transformer(cfg)                          # forgets torch-harmonics' device-blind caches after
    model = parallelize(model, plan, seed=1234)            # module.reset_parameters() per module
    model = parallelize(model, plan, seed=1234, init_fn=lambda m: my_init(m))
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["InitSpec", "capture_init_specs", "fqn_seed", "materialize"]

InitFn = Callable[[nn.Module], None]


def fqn_seed(seed: int, fqn: str) -> int:
    """A 63-bit seed for the module at ``fqn``: independent of mesh, rank and visiting order."""
    digest = hashlib.sha256(f"{seed}:{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class InitSpec:
    """A bodiless full-size copy of one module (own parameters and buffers on meta, no children)."""

    def __init__(self, fqn: str, module: nn.Module) -> None:
        self.fqn = fqn
        clone = copy.copy(module)
        clone._parameters = {
            k: None if p is None else nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
            for k, p in module._parameters.items()
        }
        clone._buffers = {k: None if b is None else torch.empty_like(b, device="meta") for k, b in module._buffers.items()}
        clone._modules = {}
        self.clone = clone

    def full_tensors(self, seed: int, init_fn: InitFn | None) -> dict[str, torch.Tensor]:
        """Run the initializer on a CPU copy; return its parameters and buffers by local name."""
        clone = self.clone.to_empty(device="cpu", recurse=False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(fqn_seed(seed, self.fqn))
            if init_fn is not None:
                init_fn(clone)
            elif hasattr(clone, "reset_parameters"):
                clone.reset_parameters()
            elif clone._parameters:
                raise ValueError(
                    f"module {self.fqn!r} ({type(clone).__name__}) has parameters but no reset_parameters(); "
                    "pass parallelize(..., init_fn=fn) where fn(module) fills module's own parameters in place"
                )
        out = {k: v for k, v in clone._parameters.items() if v is not None}
        out.update({k: v for k, v in clone._buffers.items() if v is not None})
        return out


def capture_init_specs(model: nn.Module) -> list[InitSpec]:
    """Specs for every module that owns parameters or buffers; take them before parallelizing."""
    return [InitSpec(fqn, m) for fqn, m in model.named_modules() if m._parameters or m._buffers]


@torch.no_grad()
def materialize(model: nn.Module, specs: list[InitSpec], seed: int, init_fn: InitFn | None, device: torch.device) -> None:
    """Allocate a (parallelized) meta model on ``device`` and fill every shard from its full tensor."""
    model.to_empty(device=device)
    for spec in specs:
        module = model.get_submodule(spec.fqn)
        for name, full in spec.full_tensors(seed, init_fn).items():
            target = module._parameters.get(name)
            if target is None:
                target = module._buffers.get(name)
            if target is None:
                continue
            if tuple(full.shape) != tuple(target.shape):
                raise ValueError(
                    f"init of {spec.fqn}.{name} produced shape {tuple(full.shape)}, expected {tuple(target.shape)}"
                )
            full = full.to(device=device, dtype=target.dtype)
            if isinstance(target, DTensor):
                # src_data_rank=None: every rank cuts its own shard from its own full copy, no collective.
                shard = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
                target.to_local().copy_(shard.to_local())
            else:
                target.copy_(full)
