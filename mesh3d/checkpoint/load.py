"""``load``: restore model and optimizer state onto any mesh shape, reading only what is needed.

Every rank validates the index and matches it against its own state (names, dtypes,
global shapes) with no communication; one bounded all-gather then agrees on failure so a
bad checkpoint raises the same error on every rank instead of hanging. Each rank reads
exactly the boxes its DTensors (or plain tensors) hold, verifying checksums, then hands
the state to torch's public ``set_model_state_dict`` / ``set_optimizer_state_dict``.

Usage::

    info = checkpoint.load("ckpt/step-100", model, optimizer)
    info.step, info.extra, info.bytes_read / info.bytes_needed
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mesh3d.checkpoint.chunks import local_box
from mesh3d.checkpoint.comm import collective_step
from mesh3d.checkpoint.errors import CheckpointError
from mesh3d.checkpoint.index import read_index
from mesh3d.checkpoint.reader import ShardReader
from mesh3d.checkpoint.staging import HostStaging
from mesh3d.checkpoint.st_format import TORCH_TO_ST
from mesh3d.checkpoint.state import apply_state, decode_value, optimizer_name, optimizer_template
from torch.distributed.checkpoint.state_dict import get_model_state_dict

__all__ = ["load", "LoadInfo"]


@dataclass
class LoadInfo:
    """What :func:`load` restored: the saved ``step`` and ``extra``, and this rank's I/O.

    Usage: ``info = checkpoint.load(path, model, opt); info.step, info.extra, info.bytes_read``
    """

    path: str
    step: int | None
    extra: Any
    bytes_read: int = 0
    bytes_needed: int = 0
    mesh: dict[str, Any] | None = None
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    data: dict[str, Any] | None = None


def _check_match(name: str, saved: dict[str, Any], target: torch.Tensor) -> None:
    dtype = TORCH_TO_ST.get(target.dtype)
    if saved["dtype"] != dtype:
        raise CheckpointError(f"tensor {name!r}: checkpoint has dtype {saved['dtype']}, the model has {dtype} "
                              "(cast the model, or coalesce with a dtype cast)")
    if list(target.shape) != saved["shape"]:
        raise CheckpointError(f"tensor {name!r}: checkpoint has shape {saved['shape']}, the model has {list(target.shape)} "
                              "(build the model with the configuration it was saved with; `mesh3d ckpt inspect PATH` "
                              "lists every saved tensor's shape)")


def _plan(index: dict[str, Any], model_sd: dict[str, torch.Tensor], osd: dict[str, Any] | None,
          strict: bool) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """Target tensor (template) for every checkpoint tensor to load; missing and unexpected names."""
    saved = index["tensors"]
    targets: dict[str, torch.Tensor] = {}
    wanted = dict(model_sd)
    if osd is not None:
        if index.get("optimizer") is None:
            raise CheckpointError("an optimizer was given but the checkpoint has no optimizer state")
        for fqn, state in osd["state"].items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and (isinstance(value, DTensor) or value.dim() > 0):
                    wanted[optimizer_name(fqn, key)] = value
        for name, entry in saved.items():  # state the template lacks takes its parameter's layout
            if entry["role"] == "optimizer" and name not in wanted and entry["param"] in model_sd:
                param = model_sd[entry["param"]]
                if list(param.shape) == entry["shape"]:
                    # NOTE: a fresh tensor laid out like the parameter, never the parameter itself: loads read
                    # into their targets in place, and the parameter would be overwritten with optimizer state.
                    wanted[name] = torch.empty_like(param)
    roles = {"model"} | ({"optimizer"} if osd is not None else set())
    missing = sorted(n for n in wanted if n not in saved)
    unexpected = sorted(n for n, e in saved.items() if e["role"] in roles and n not in wanted)
    if strict and (missing or unexpected):
        raise CheckpointError(f"keys do not match (strict=True): missing from the checkpoint {missing[:10]}"
                              f"{' ...' if len(missing) > 10 else ''}, unexpected in the checkpoint {unexpected[:10]}"
                              f"{' ...' if len(unexpected) > 10 else ''}; pass strict=False to load the intersection")
    for name, target in wanted.items():
        if name in saved:
            _check_match(name, saved[name], target)
            targets[name] = target
    return targets, missing, unexpected


def _materialize(name: str, target: torch.Tensor, reader: ShardReader, in_place: bool,
                 staging: HostStaging) -> torch.Tensor:
    box = local_box(name, target)
    local = target.to_local() if isinstance(target, DTensor) else target
    if in_place and local.is_contiguous():
        # The state-dict tensor shares storage with the parameter/buffer/moment: read straight
        # into it (no fresh allocation, no page faults), as DCP does; an accelerator tensor is
        # read into the reused pinned buffer and copied over at bus speed.
        if box.numel:
            if local.device.type == "cpu":
                reader.read_into(name, box, local.detach())
            else:
                host = staging.buffer_like(local)
                reader.read_into(name, box, host)
                local.detach().copy_(host)
        return target
    buf = torch.empty(box.shape, dtype=target.dtype)
    if box.numel:
        reader.read_into(name, box, buf)
    if isinstance(target, DTensor):
        local = buf.to(target.to_local().device)
        return DTensor.from_local(local, target.device_mesh, target.placements, run_check=False,
                                  shape=target.shape, stride=target.stride())
    return buf.to(target.device)


def _optimizer_state(index: dict[str, Any], osd: dict[str, Any], loaded: dict[str, torch.Tensor],
                     model_sd: dict[str, torch.Tensor]) -> dict[str, Any]:
    meta = index["optimizer"]
    state: dict[str, dict[str, Any]] = {}
    for name, tensor in loaded.items():
        entry = index["tensors"][name]
        if entry["role"] == "optimizer":
            state.setdefault(entry["param"], {})[entry["state_key"]] = tensor
    for fqn, values in meta["scalars"].items():
        if fqn in model_sd:
            device = model_sd[fqn].device
            for key, value in values.items():
                state.setdefault(fqn, {})[key] = decode_value(value, device)
    saved_groups = meta["param_groups"]
    target_groups = osd["param_groups"]
    if len(saved_groups) != len(target_groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved_groups)} param groups, the target has "
                              f"{len(target_groups)}")
    groups = []
    for i, (saved, target) in enumerate(zip(saved_groups, target_groups)):
        if sorted(saved["params"]) != sorted(target["params"]):
            raise CheckpointError(f"optimizer param group {i}: the checkpoint's parameters differ from the target's "
                                  f"(e.g. {sorted(set(saved['params']) ^ set(target['params']))[:5]})")
        group = {k: decode_value(v) for k, v in saved.items() if k != "params"}
        group["params"] = list(target["params"])
        groups.append(group)
    return {"state": state, "param_groups": groups}


def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         strict: bool = True, in_place: bool = True, data: Any = None) -> LoadInfo:
    """Load a checkpoint saved on any mesh into ``model`` (and ``optimizer``); all ranks call it.

    Usage: ``info = checkpoint.load("ckpt/step-100", model, optimizer); start = info.step``

    Works in a plain process without torch.distributed for an unparallelized module.
    Everything that can be checked without reading tensor data (index, names, shapes, dtypes,
    file sizes) is checked on every rank before anything is read. By default
    (``in_place=True``, like DCP) bytes are then read straight into the model's and optimizer's
    own storage and verified as they arrive: a checksum failure raises on every rank, but the
    state may be partly overwritten. ``in_place=False`` is all or nothing: tensors are read
    into fresh buffers and applied only after every read and checksum succeeded on every rank
    (about twice the time and the memory of the state being loaded).

    ``data`` (what was passed to ``save(..., data=)``, e.g. a ``MeshDataLoader`` on any mesh) gets the
    saved data state through ``load_state_dict``; it is checked (``check_state_dict`` when it has one)
    before anything is read, on every rank. ``info.data`` holds the saved data state either way.
    """
    path = os.path.abspath(os.fspath(path))
    what = f"loading {path}"
    checked, _ = collective_step(what, lambda: _check(path, model, optimizer, strict, data))
    with ShardReader(path, checked.index) as reader:
        # Every file this rank needs: present, the size the index says, its header agreeing.
        boxes = {name: local_box(name, target) for name, target in checked.targets.items()}
        collective_step(what, lambda: reader.open_needed(boxes), note="Nothing was modified")
        partly = ("in_place=True: the model/optimizer state may be partly overwritten; load an intact checkpoint "
                  "(in_place=False loads all or nothing)")
        (loaded, optim_sd), _ = collective_step(what, lambda: _read(checked, reader, in_place),
                                                note=partly if in_place else "Nothing was modified")
    info = checked.info
    info.bytes_read, info.bytes_needed = reader.stats["bytes_read"], reader.stats["bytes_needed"]
    model_part = {n: t for n, t in loaded.items() if checked.index["tensors"][n]["role"] == "model"}
    apply_state(model, model_part, optimizer, optim_sd, strict)
    if data is not None:
        data.load_state_dict(info.data)
    return info


@dataclass
class _Checked:
    """What ``load`` checked on this rank before reading: the index, the targets and what to report."""

    index: dict[str, Any]
    model_sd: dict[str, torch.Tensor]
    osd: dict[str, Any] | None
    targets: dict[str, torch.Tensor]
    info: LoadInfo


def _check(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None, strict: bool, data: Any) -> _Checked:
    """Phase 1 (no communication): the index, and the checkpoint matched against this rank's state."""
    index = read_index(path)
    model_sd = get_model_state_dict(model)
    osd = optimizer_template(model, optimizer) if optimizer is not None else None
    targets, missing, unexpected = _plan(index, model_sd, osd, strict)
    info = LoadInfo(path, index["step"], index.get("extra"), mesh=index.get("mesh"), missing=missing,
                    unexpected=unexpected, data=index.get("data"))
    _check_data(data, info.data)
    return _Checked(index, model_sd, osd, targets, info)


def _read(checked: _Checked, reader: ShardReader, in_place: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """Phase 3: read (and verify) every box this rank needs; the optimizer state dict rebuilt from it."""
    staging = HostStaging()
    loaded = {name: _materialize(name, target, reader, in_place, staging) for name, target in checked.targets.items()}
    optim_sd = None
    if checked.osd is not None:
        optim_sd = _optimizer_state(checked.index, checked.osd, loaded, checked.model_sd)
    return loaded, optim_sd


def _check_data(data: Any, state: dict[str, Any] | None) -> None:
    if data is None:
        return
    if not callable(getattr(data, "load_state_dict", None)):
        raise CheckpointError(f"data= takes an object with load_state_dict() (e.g. mesh3d.data.MeshDataLoader), got "
                              f"{type(data).__name__}")
    if state is None:
        raise CheckpointError("the checkpoint holds no data state (it was saved without data=); load without data= "
                              "and position the data yourself")
    check = getattr(data, "check_state_dict", None)
    if callable(check):
        check(state)
