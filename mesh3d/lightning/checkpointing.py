"""Lightning checkpoints through mesh3d's checkpointer: sharded safetensors, JSON trainer state, any mesh.

``trainer.save_checkpoint(path)`` writes a mesh3d checkpoint *directory* at ``path`` (the model's and
optimizer's tensors as per-rank safetensors shards; Lightning's own state, as JSON, in the index's
``extra``), and ``Trainer.fit(..., ckpt_path=path)`` restores it onto whatever mesh the new run
has. Lightning overwrites ``last.ckpt`` and prunes old top-k files; mesh3d checkpoints are never
written in place, so an existing one is replaced only after its successor is complete.

Usage (the strategy calls these; users call ``trainer.save_checkpoint`` / ``ckpt_path=``)::

    save_lightning_checkpoint(path, module, optimizer, checkpoint_dict)
    checkpoint_dict = load_lightning_checkpoint(path, module, optimizer, strict=True)
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import Any

import torch
from torch import nn

from mesh3d.checkpoint import CheckpointError, load, read_index, save
from mesh3d.checkpoint.comm import allgather_json, raise_if_any_failed, world
from mesh3d.checkpoint.index import INDEX_NAME
from mesh3d.lightning.trainer_state import decode_trainer_state, encode_trainer_state

__all__ = ["save_lightning_checkpoint", "load_lightning_checkpoint", "remove_checkpoint", "TENSOR_KEYS"]

#: Entries of Lightning's checkpoint dict that mesh3d stores as sharded tensors, not JSON.
TENSOR_KEYS = ("state_dict", "optimizer_states")
_EXTRA_KEY = "lightning"


def _is_mesh3d_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, INDEX_NAME))


def _decide_target(path: str) -> dict[str, Any]:
    """Rank 0's decision: write at ``path``, or beside it when an older checkpoint is there, or refuse."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)  # as Lightning's own CheckpointIO does
    except OSError as err:
        return {"error": f"cannot create the checkpoint's parent directory: {err}"}
    if os.path.isdir(path) and not _is_mesh3d_checkpoint(path):
        return {"error": f"{path} exists and is a directory that is not a mesh3d checkpoint (no {INDEX_NAME}); "
                         "choose another path or remove it"}
    if os.path.lexists(path):
        return {"error": None, "target": f"{path}.replacing-{uuid.uuid4().hex[:8]}", "replace": True}
    return {"error": None, "target": path, "replace": False}


def _replacement_target(path: str) -> tuple[str, bool]:
    """Where every rank writes: decided on rank 0 (which sees the shared file system), shared with all."""
    decision = allgather_json(_decide_target(path) if world()[0] == 0 else None)[0]
    if decision["error"]:
        raise CheckpointError(f"saving {path} failed: {decision['error']}")
    return decision["target"], decision["replace"]


def save_lightning_checkpoint(path: str, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                              checkpoint: dict[str, Any]) -> None:
    """Write ``checkpoint`` (Lightning's dict) to the directory ``path``; every rank calls it."""
    path = os.path.abspath(path)
    trainer_state = {k: v for k, v in checkpoint.items() if k not in TENSOR_KEYS}
    trainer_state["mesh3d_saved_optimizer"] = optimizer is not None
    extra = {_EXTRA_KEY: encode_trainer_state(trainer_state)}
    target, replace = _replacement_target(path)
    step = checkpoint.get("global_step")
    save(target, module, optimizer, step=step if isinstance(step, int) else None, extra=extra)
    if replace:
        error = None
        if world()[0] == 0:
            try:  # the old checkpoint moves aside only once the new one is complete, then goes
                retired = f"{path}.retired-{uuid.uuid4().hex[:8]}"
                os.rename(path, retired)
                os.rename(target, path)
                _remove(retired)
            except OSError as err:
                error = f"replacing {path} with the complete checkpoint at {target} failed: {err}"
        raise_if_any_failed(error, f"saving {path}")


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def remove_checkpoint(path: str) -> None:
    """Delete a checkpoint Lightning no longer wants (``save_top_k`` pruning); rank 0 deletes, all wait."""
    error = None
    if world()[0] == 0:
        try:
            _remove(os.path.abspath(path))
        except OSError as err:
            error = f"could not delete {path}: {err}"
    raise_if_any_failed(error, f"removing {path}")  # every rank raises with rank 0, none waits forever


def load_lightning_checkpoint(path: str, module: nn.Module, optimizer: torch.optim.Optimizer | None, *,
                              strict: bool = True) -> dict[str, Any]:
    """Restore ``module`` (and ``optimizer``, when given and saved) from ``path``; return Lightning's dict.

    The returned dict carries the trainer state; its ``state_dict`` is empty and its
    ``optimizer_states`` holds placeholders, because the tensors are already in place.
    """
    index = read_index(os.path.abspath(path))
    extra = index.get("extra")
    if not isinstance(extra, dict) or _EXTRA_KEY not in extra:
        raise ValueError(
            f"{path} is a mesh3d checkpoint without Lightning trainer state (saved by mesh3d.checkpoint.save, "
            "not by Trainer.save_checkpoint); load its weights with mesh3d.checkpoint.load(path, module) instead "
            "of ckpt_path="
        )
    state = decode_trainer_state(extra[_EXTRA_KEY])
    saved_optimizer = bool(state.pop("mesh3d_saved_optimizer", False))
    load(path, module, optimizer if saved_optimizer else None, strict=strict)
    state["state_dict"] = {}
    if saved_optimizer:
        state["optimizer_states"] = [{}]
    return state
