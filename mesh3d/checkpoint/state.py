"""FQN-keyed model and optimizer state as flat tensors plus JSON, and back.

Uses torch's public ``torch.distributed.checkpoint.state_dict`` helpers, which strip
FSDP/compile/DDP prefixes and key optimizer state by parameter FQN. Optimizer tensors are
named ``optimizer.<fqn>.<state key>``; 0-dim plain tensors (per-parameter ``step``) and
hyperparameters go to JSON with their dtype so they come back exactly.

Usage::

    tensors, meta = flat_state(model, optimizer)     # {name: (role, tensor, param, key)}, JSON
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from mesh3d.checkpoint.errors import CheckpointError
from mesh3d.checkpoint.st_format import TORCH_TO_ST
from mesh3d.checkpoint.st_format import DTYPES

__all__ = ["Entry", "flat_state", "encode_value", "decode_value", "apply_state", "optimizer_name"]


@dataclass
class Entry:
    """One tensor of the flat state: its role and, for optimizer state, which param/key."""

    role: str
    tensor: torch.Tensor
    param: str | None = None
    state_key: str | None = None


def optimizer_name(fqn: str, key: str) -> str:
    return f"optimizer.{fqn}.{key}"


def encode_value(value: Any, where: str) -> Any:
    """JSON form of a non-tensor optimizer value (tuples and scalar tensors are tagged)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        # JSON has no inf/nan; repr round-trips every finite float exactly.
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, (list, tuple)):
        items = [encode_value(v, where) for v in value]
        return {"__tuple__": items} if isinstance(value, tuple) else items
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() == 0:
        return {"__tensor__": encode_value(value.item(), where), "dtype": TORCH_TO_ST[value.dtype]}
    if isinstance(value, dict):
        return {"__dict__": {str(k): encode_value(v, where) for k, v in value.items()}}
    raise CheckpointError(f"{where}: value of type {type(value).__name__} cannot be stored as JSON")


def decode_value(value: Any, device: torch.device | None = None) -> Any:
    if isinstance(value, list):
        return [decode_value(v, device) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(decode_value(v, device) for v in value["__tuple__"])
        if "__float__" in value:
            return float(value["__float__"])
        if "__tensor__" in value:
            return torch.tensor(decode_value(value["__tensor__"]), dtype=DTYPES[value["dtype"]], device=device)
        if "__dict__" in value:
            return {k: decode_value(v, device) for k, v in value["__dict__"].items()}
    return value


def _is_json_scalar(value: Any) -> bool:
    return not isinstance(value, torch.Tensor) or (not isinstance(value, DTensor) and value.dim() == 0)


def flat_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict[str, Entry], dict[str, Any] | None]:
    """Model and optimizer state as ``{name: Entry}`` plus the optimizer's JSON part (or None)."""
    entries = {fqn: Entry("model", t) for fqn, t in get_model_state_dict(model).items()}
    if optimizer is None:
        return entries, None
    osd = get_optimizer_state_dict(model, optimizer)
    scalars: dict[str, dict[str, Any]] = {}
    for fqn, state in osd["state"].items():
        for key, value in state.items():
            if _is_json_scalar(value):
                scalars.setdefault(fqn, {})[key] = encode_value(value, f"optimizer state {fqn}.{key}")
            else:
                entries[optimizer_name(fqn, key)] = Entry("optimizer", value, fqn, key)
    groups = [
        {k: (list(v) if k == "params" else encode_value(v, f"optimizer param_group {i} {k!r}")) for k, v in dict(g).items()}
        for i, g in enumerate(osd["param_groups"])
    ]
    meta = {"type": type(optimizer).__name__, "param_groups": groups, "scalars": scalars}
    return entries, meta


def optimizer_template(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The target optimizer's FQN-keyed state dict (state initialized if empty, as torch does).

    NOTE: torch initializes an empty optimizer state (a step with zero gradients and lr 0) only when no parameter
    has a gradient; with gradients left from a backward it returns an empty template, and the loaded state then
    landed in the wrong tensors (parameters overwritten, silently). The gradients are set aside for the
    initialization and put back.
    """
    if optimizer.state:
        return get_optimizer_state_dict(model, optimizer)
    grads = [(p, p.grad) for group in optimizer.param_groups for p in group["params"]]
    for p, _ in grads:
        p.grad = None
    try:
        return get_optimizer_state_dict(model, optimizer)
    finally:
        for p, g in grads:
            p.grad = g


def apply_state(
    model: nn.Module,
    model_sd: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
    optim_sd: dict[str, Any] | None,
    strict: bool,
) -> None:
    """Copy loaded state into the model (and optimizer) through torch's public setters."""
    set_model_state_dict(model, model_sd, options=StateDictOptions(strict=strict))
    if optimizer is not None and optim_sd is not None:
        set_optimizer_state_dict(model, optimizer, optim_sd, options=StateDictOptions(strict=strict))
