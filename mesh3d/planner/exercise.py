"""What a ``mesh3d check`` exercises: a check whose reference output ignores the input, or whose parameters get
exactly zero gradient, compares zeros with zeros and would pass whatever the parallel code did.

The one-process reference of every mesh is examined (``exercise_of``): the parameters whose whole gradient is
exactly zero, whether the output changes when the input does, whether the output is the input itself. A model
zero-initialised to start as the identity (a residual head ``x + head(h)`` with ``head`` at zero: the weather
example's) gives all three. ``perturb_zero_parameters`` gives every parameter that is zero throughout at
initialisation small random values, the same on every rank, so the check runs every parameter's gradient path.

Usage::

    perturbed = perturb_zero_parameters(model, seed=0)        # ["head.weight", "head.bias"]
    found = exercise_of(model, x, y, lambda x: model(x))      # after the reference's backward
    found.degenerate, found.reasons()
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["Exercise", "exercise_of", "perturb_zero_parameters", "zero_at_init"]

#: A check is degenerate when more than this share of the parameters gets an exactly zero gradient.
MOST = 0.5


def zero_at_init(model: nn.Module) -> list[str]:
    """The trainable floating-point parameters that are zero throughout.

    Usage: ``zero_at_init(model)  # ["head.weight", "head.bias"]``
    """
    return [name for name, p in model.named_parameters()
            if p.requires_grad and (p.is_floating_point() or p.is_complex()) and p.numel() and not p.detach().any()]


def perturb_zero_parameters(model: nn.Module, seed: int = 0) -> list[str]:
    """Give each parameter that is zero throughout values drawn from N(0, 1/fan_in) (N(0, 0.01) for 0-D and 1-D
    ones), from a generator seeded by ``seed``: the same values on every rank. Returns the names it changed.

    Usage: ``perturb_zero_parameters(model)  # before the reference is copied``
    """
    names = zero_at_init(model)
    params = dict(model.named_parameters())
    g = torch.Generator().manual_seed(seed)
    for name in names:
        p = params[name]
        fan_in = p.numel() // p.shape[0] if p.dim() >= 2 else 0
        std = 1 / math.sqrt(fan_in) if fan_in else 0.1
        real = torch.view_as_real(p.detach()) if p.is_complex() else p.detach()
        noise = torch.randn(real.shape, generator=g, dtype=torch.float64) * std
        with torch.no_grad():
            real.copy_(noise.to(real.dtype))
    return names


@dataclass
class Exercise:
    """What one reference run exercised: its trainable parameters, those with an exactly zero gradient, whether the
    output ignored the input or was the input, and the parameters zero at initialisation (or perturbed)."""

    parameters: int = 0
    zero_grads: list[str] = field(default_factory=list)
    ignores_input: bool = False
    is_input: bool = False
    zero_at_init: list[str] = field(default_factory=list)
    perturbed: list[str] = field(default_factory=list)

    @property
    def degenerate(self) -> bool:
        """The check could pass whatever the parallel code did: the output ignores the input or is the input, or most
        parameters get exactly zero gradient."""
        return self.ignores_input or self.is_input or len(self.zero_grads) > MOST * max(self.parameters, 1)

    def reasons(self) -> list[str]:
        """One line per finding (empty when everything was exercised)."""
        out = []
        if self.ignores_input:
            out.append("the output does not depend on the input (another input gives the same output, bit for bit)")
        if self.is_input:
            out.append("the output is the input itself (the model starts as the identity)")
        if self.zero_grads:
            shown = ", ".join(self.zero_grads[:6]) + (f" and {len(self.zero_grads) - 6} more"
                                                     if len(self.zero_grads) > 6 else "")
            out.append(f"{len(self.zero_grads)} of {self.parameters} parameters get exactly zero gradient in the "
                       f"one-process reference ({shown}): a wrong parallel gradient for them could not show")
        return out

    def merge(self, other: Exercise) -> Exercise:
        """Both runs' findings (a check runs one reference per mesh)."""
        def union(a: list[str], b: list[str]) -> list[str]:
            return list(dict.fromkeys(a + b))  # the model's order

        return Exercise(max(self.parameters, other.parameters), union(self.zero_grads, other.zero_grads),
                        self.ignores_input or other.ignores_input, self.is_input or other.is_input,
                        union(self.zero_at_init, other.zero_at_init), union(self.perturbed, other.perturbed))

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "degenerate": self.degenerate}


def exercise_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor, run: Callable[[torch.Tensor], torch.Tensor],
                other_input: torch.Tensor, zero: list[str], perturbed: list[str]) -> Exercise:
    """Examine a reference after its backward: ``y`` is ``run(x)``; ``run(other_input)`` tells whether the output
    depends on the input; ``zero``/``perturbed``: the parameters zero at initialisation, and those given values.

    Usage: ``exercise_of(ref, xs[0], outs[0], lambda x: first_float(ref(x)), other, zero, perturbed)``
    """
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    zero_grads = [n for n, p in trainable if p.grad is None or not p.grad.any()]
    with torch.no_grad():
        y_other = run(other_input)
    ignores = y_other.shape == y.shape and torch.equal(y_other, y.detach())
    is_input = x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y.detach())
    return Exercise(len(trainable), zero_grads, ignores, is_input, list(zero), list(perturbed))
