"""Lightning's trainer state (epoch, loops, callbacks, schedulers, hyperparameters) as JSON, and back.

A Lightning checkpoint dict holds, beside the weights and optimizer state, everything the
Trainer needs to resume: loop progress, callback states (``ModelCheckpoint``'s best scores are
scalar tensors), LR scheduler state, the precision plugin's state and the module's
hyperparameters. mesh3d stores all of it as JSON in the checkpoint's ``extra``: nothing is
pickled. Values JSON has no type for (tuples, scalar tensors, non-finite floats, dicts with
non-string keys) are tagged so they come back as they were.

Usage::

    doc = encode_trainer_state(checkpoint_without_tensors)   # JSON-ready
    checkpoint = decode_trainer_state(doc)
"""

from __future__ import annotations

import enum
import warnings
from typing import Any

import torch

from mesh3d.checkpoint.state import decode_value, encode_value

__all__ = ["encode_trainer_state", "decode_trainer_state", "INFORMATIONAL_KEYS"]

#: Keys whose values are kept for reference only (Lightning never restores them on resume): a value
#: JSON cannot hold is stored as its ``repr`` with a warning instead of failing the save.
INFORMATIONAL_KEYS = ("hyper_parameters", "datamodule_hyper_parameters")


def _encode(value: Any, where: str) -> Any:
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {"__dict__": {k: _encode(v, f"{where}.{k}") for k, v in value.items()}}
        # Non-string keys (ints in some schedulers' state): a list of pairs keeps their types.
        return {"__items__": [[_encode(k, where), _encode(v, f"{where}[{k!r}]")] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        items = [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return {"__tuple__": items} if isinstance(value, tuple) else items
    if isinstance(value, enum.Enum):
        return _encode(value.value, where)
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() <= 1024:
        # Small non-scalar tensors (e.g. a metric's running window) travel as nested lists.
        return {"__array__": _encode(value.tolist(), where), "dtype": str(value.dtype).removeprefix("torch.")}
    return encode_value(value, where)


def encode_trainer_state(state: dict[str, Any]) -> dict[str, Any]:
    """The JSON form of a Lightning checkpoint dict from which the tensors of model/optimizer were removed.

    Raises ``TypeError`` naming the key path of a value JSON cannot hold (outside the
    informational hyperparameter keys, where its ``repr`` is kept with a warning).
    """
    out: dict[str, Any] = {}
    for key, value in state.items():
        try:
            out[key] = _encode(value, key)
        except Exception as err:  # noqa: BLE001 - re-raised below with the fix, or downgraded
            if key not in INFORMATIONAL_KEYS:
                raise TypeError(
                    f"the Lightning checkpoint entry {err} (mesh3d checkpoints hold no pickles); return only "
                    "JSON-able values (dicts, lists, numbers, strings, scalar tensors) from state_dict()/"
                    "on_save_checkpoint, or keep that object out of the checkpoint"
                ) from None
            warnings.warn(f"mesh3d: checkpoint entry {key!r} is not JSON-serializable ({err}); its repr is "
                          "stored instead (Lightning does not restore it on resume)", stacklevel=3)
            out[key] = {"__repr__": repr(value)}
    return out


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if "__items__" in value:
            return {_decode(k): _decode(v) for k, v in value["__items__"]}
        if "__dict__" in value:
            return {k: _decode(v) for k, v in value["__dict__"].items()}
        if "__tuple__" in value:
            return tuple(_decode(v) for v in value["__tuple__"])
        if "__dtype__" in value:
            return getattr(torch, value["__dtype__"])
        if "__array__" in value:
            return torch.tensor(_decode(value["__array__"]), dtype=getattr(torch, value["dtype"]))
        if "__repr__" in value:
            return value["__repr__"]
        return decode_value(value)
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def decode_trainer_state(doc: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`encode_trainer_state`."""
    return {key: _decode(value) for key, value in doc.items()}
