"""Autoregressive rollout: the model's output fed back as its next input, for training and for forecasts.

Training unrolls ``steps`` applications under activation checkpointing (one step's activations alive at a
time, each recomputed in backward on the domain axis as its forward ran) and averages a loss over the steps.
Inference runs under ``no_grad`` and hands each step to a :class:`ForecastWriter` (each rank writes its block).

Usage::

    loss = rollout_loss(model, batch["x"], batch["y"], lambda p, t: weighted_mse(p, t, grid.weights))
    forecast(model, x0, steps=8, writer=writer, sample_ids=ids)       # or outputs = forecast(model, x0, 8)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as activation_checkpoint

__all__ = ["forecast", "rollout", "rollout_loss"]


def rollout(model: nn.Module | Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, steps: int, *,
            checkpoint: bool = True) -> list[torch.Tensor]:
    """``steps`` states, each the model applied to the previous one (starting from ``x``).

    Usage: ``preds = rollout(model, x, 4)  # [model(x), model(model(x)), ...]``

    With ``checkpoint`` (and grad enabled) each step is one activation-checkpoint region: backward recomputes
    it from its saved input, so memory holds one step's activations instead of ``steps``.
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"rollout: steps={steps!r} must be an int >= 1")
    out = []
    for _ in range(steps):
        if checkpoint and torch.is_grad_enabled():
            x = activation_checkpoint(model, x, use_reentrant=False)
        else:
            x = model(x)
        out.append(x)
    return out


def rollout_loss(model: nn.Module | Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                 targets: Sequence[torch.Tensor], loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                 checkpoint: bool = True) -> torch.Tensor:
    """The mean over ``len(targets)`` rollout steps of ``loss_fn(prediction_k, targets[k])``.

    Usage: ``loss = rollout_loss(model, batch["x"], batch["y"], loss_fn); loss.backward()``
    """
    if len(targets) < 1:
        raise ValueError("rollout_loss: give at least one target (WeatherDataset(steps=k) gives k)")
    preds = rollout(model, x, len(targets), checkpoint=checkpoint)
    total = loss_fn(preds[0], targets[0])
    for pred, target in zip(preds[1:], targets[1:]):
        total = total + loss_fn(pred, target)
    return total / len(targets)


@torch.no_grad()
def forecast(model: nn.Module | Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, steps: int,
             writer: Any = None, sample_ids: Sequence[int] | torch.Tensor | None = None) -> list[torch.Tensor]:
    """Forecast ``steps`` states from ``x`` without gradients; with ``writer``, each step is written as it comes.

    Usage: ``forecast(model, x0, 8, ForecastWriter("fc.zarr", n, 8, like=x0), sample_ids=batch["index"])``

    Returns the states when no writer is given (else an empty list: nothing is kept).
    """
    if writer is not None and sample_ids is None:
        raise ValueError("forecast: with a writer, pass sample_ids (the global index of each sample of x)")
    kept = []
    for step in range(steps):
        x = model(x)
        if writer is not None:
            writer.write(sample_ids, step, x)
        else:
            kept.append(x)
    return kept
