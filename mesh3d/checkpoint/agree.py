"""Step 1 of a save: check the request on every rank and agree on the plan before any shard is written.

The first save (and any save after the state's structure changed) runs the full agreement: one JSON
all-gather of every rank's boxes, signature, data cursor and rank 0's staging directory name. The
boxes follow from the state's structure alone (names, dtypes, global shapes, shardings), so the
agreed boxes are kept (``AgreedPlans``) and a repeat save of an unchanged structure needs one
all-gather of five int64 per rank instead: each rank says whether its request is well formed and
unchanged, and hashes of its data cursor, its path and its plan generation. If anything differs
or any rank failed, every rank runs the full agreement, which raises the same error everywhere as
before. The staging directory's name is derived from a token rank 0 drew at the last full
agreement and a counter every rank advances alike, so no rank has to be told it.

Usage::

    plan, entries = agree(path, model, optimizer, step, extra, block, data, plans=IN_FLIGHT.plans)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from mesh3d.checkpoint.chunks import local_box
from mesh3d.checkpoint.comm import collective_step, start_allgather_int64, world
from mesh3d.checkpoint.errors import CheckpointError
from mesh3d.checkpoint.st_format import TORCH_TO_ST
from mesh3d.checkpoint.state import Entry, flat_state
from mesh3d.manager import DistributedManager

__all__ = ["agree", "agree_and_stage", "AgreedPlans", "Meanwhile", "Plan"]


@dataclass
class Plan:
    """What every rank agreed on before any shard is written (no reference to live tensors).

    Usage: ``plan, entries = agree(path, model, opt, step, extra, block); plan.staging``
    """

    path: str
    staging: str
    tensors: dict[str, dict[str, Any]]  # the index's tensor entries, without chunks yet
    optim_meta: dict[str, Any] | None
    mesh: dict[str, Any] | None
    boxes: list[dict[str, list]]
    rank: int
    size: int
    step: int | None
    extra: Any
    block: int
    data_state: dict[str, Any] | None = None  # a data loader's JSON cursor (``save(..., data=)``)


@dataclass
class _Agreed:
    """The last full agreement, as every rank holds it alike."""

    world: object  # the default group it was made on
    structure: str  # this rank's (signature, boxes) at the time
    boxes: list[dict[str, list]]  # every rank's boxes
    token: str  # drawn by rank 0
    count: int  # saves agreed since (advanced alike on every rank)


class AgreedPlans:
    """The boxes every rank agreed on at the last full agreement, reused while the structure is unchanged.

    Usage: ``plans = AgreedPlans(); agree(..., plans=plans)`` (the process keeps one: ``IN_FLIGHT.plans``)
    """

    def __init__(self) -> None:
        self._last: _Agreed | None = None

    def current(self) -> _Agreed | None:
        last = self._last
        return last if last is not None and dist.is_initialized() and last.world is dist.group.WORLD else None

    def next_token(self) -> tuple[str, int]:
        """(token, count) naming the next staging directory: the kept token, else a fresh one."""
        last = self.current()
        return (last.token, last.count + 1) if last is not None else (uuid.uuid4().hex[:8], 0)

    def remember(self, structure: str, boxes: list[dict[str, list]], token: str, count: int) -> None:
        self._last = _Agreed(dist.group.WORLD if dist.is_initialized() else None, structure, boxes, token, count)

    def advance(self) -> None:
        if self._last is not None:
            self._last.count += 1


def _index_tensors(entries: dict[str, Entry]) -> dict[str, dict[str, Any]]:
    """Each tensor's index entry (role, dtype, global shape, layout), chunks still to be filled in."""
    tensors: dict[str, dict[str, Any]] = {}
    for name, entry in entries.items():
        t = entry.tensor
        tensors[name] = {"role": entry.role, "dtype": TORCH_TO_ST[t.dtype], "shape": list(t.shape),
                         "layout": str(tuple(t.placements)) if hasattr(t, "placements") else "plain"}
        if entry.role == "optimizer":
            tensors[name].update(param=entry.param, state_key=entry.state_key)
    return tensors


def _signature(entries: dict[str, Entry]) -> int:
    """A checksum of (name, role, dtype, global shape): all ranks must agree on it."""
    text = json.dumps(sorted((n, e.role, str(e.tensor.dtype), list(e.tensor.shape)) for n, e in entries.items()))
    return zlib.crc32(text.encode())


def _hash64(obj: Any) -> int:
    """A signed 64-bit hash of a JSON value (equal values, equal hashes, on every rank)."""
    digest = hashlib.blake2b(json.dumps(obj, sort_keys=True).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _data_state(data: Any) -> dict[str, Any] | None:
    """``data.state_dict()``, checked to be a JSON object (nothing is ever pickled)."""
    if data is None:
        return None
    if not callable(getattr(data, "state_dict", None)):
        raise CheckpointError(f"data= takes an object with state_dict() (e.g. mesh3d.data.MeshDataLoader), got "
                              f"{type(data).__name__}")
    state = data.state_dict()
    try:
        if not isinstance(state, dict):
            raise TypeError(f"it is a {type(state).__name__}, not a dict")
        json.dumps(state, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"data.state_dict() must return a JSON object (dicts, lists, str, finite numbers): {err}") from None
    return state


def _mesh_info() -> dict[str, Any] | None:
    if not DistributedManager.is_initialized():
        return None
    dm = DistributedManager()
    return {"axes": list(dm.mesh.mesh_dim_names), "shape": list(dm.mesh.shape)}


@dataclass
class _Request:
    """One rank's checked request: its state, its boxes and (rank 0) the staging directory it made."""

    entries: dict[str, Entry]
    optim_meta: dict[str, Any] | None
    boxes: dict[str, list]
    signature: int
    data_state: dict[str, Any] | None
    staging: str | None

    def structure(self) -> str:
        return json.dumps([self.signature, self.boxes], sort_keys=True)


def _staging_name(path: str, token: str, count: int) -> str:
    parent, base = os.path.split(path)
    return os.path.join(parent, f".{base}.tmp-{token}{count:04x}")


def _check_request(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None, step: int | None,
                   extra: Any, data: Any, rank: int, staging: str) -> _Request:
    """The local half of ``agree``: check the arguments, flatten the state, and on rank 0 make the staging dir."""
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise CheckpointError(f"step={step!r} must be an int or None")
    try:
        json.dumps(extra, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"extra must be JSON-serializable (dicts, lists, str, finite numbers): {err}") from None
    data_state = _data_state(data)
    entries, optim_meta = flat_state(model, optimizer)
    boxes = {}
    for name, entry in entries.items():
        if entry.tensor.dtype not in TORCH_TO_ST:
            raise CheckpointError(f"tensor {name!r} has dtype {entry.tensor.dtype}, which safetensors cannot store")
        box = local_box(name, entry.tensor)
        boxes[name] = [list(box.offsets), list(box.shape)]
    made = None
    if rank == 0:
        parent = os.path.dirname(path)
        if os.path.lexists(path):
            raise CheckpointError(f"{path} already exists; checkpoints are never overwritten (pick a new path)")
        try:  # missing parents are created (like ``mkdir -p``); the checkpoint itself still appears atomically
            os.makedirs(parent, exist_ok=True)
        except OSError as err:
            raise CheckpointError(f"cannot create the parent directory {parent} of the checkpoint: {err} "
                                  "(choose a path under a writable directory)") from None
        os.makedirs(os.path.join(staging, "model"))
        os.makedirs(os.path.join(staging, "optimizer"))
        made = staging
    return _Request(entries, optim_meta, boxes, _signature(entries), data_state, made)


def _disagreement(shared: list[dict[str, Any]]) -> str | None:
    """What the ranks' requests disagree on (the same text on every rank), or None."""
    if len({d["signature"] for d in shared}) > 1:
        return ("rank 0: ranks disagree on the state's tensor names, dtypes or global shapes "
                f"(signatures {[d['signature'] for d in shared]}); every rank must save the same model")
    for r, d in enumerate(shared):
        if d["data"] != shared[0]["data"]:
            return (f"rank {r}: its data state {d['data']} differs from rank 0's {shared[0]['data']}; data= must hold "
                    "a global cursor, the same on every rank (MeshSampler's is)")
    return None


def _start_unchanged_check(request: _Request | None, plans: AgreedPlans, path: str, token: str,
                           count: int) -> Callable[[], bool]:
    """The one small collective of a repeat save, started: its result is True on every rank iff every rank's request
    is well formed and its structure, data cursor, path and plan generation match the kept agreement's."""
    last = plans.current()
    unchanged = request is not None and last is not None and request.structure() == last.structure
    data_hash = _hash64(request.data_state) if request is not None else 0
    mine = [int(request is not None), int(unchanged), data_hash, _hash64(path), _hash64([token, count])]
    finish = start_allgather_int64(mine)

    def everywhere() -> bool:
        rows = finish()
        return all(row[0] == 1 and row[1] == 1 and row[2:] == rows[0][2:] for row in rows)

    return everywhere


#: Work to do with the boxes as soon as they are known: ``meanwhile(entries, boxes, rank)`` (``agree_and_stage``).
Meanwhile = Callable[[dict[str, Entry], list[dict[str, list]], int], Any]


def agree(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None, step: int | None,
          extra: Any, checksum_block_bytes: int, data: Any = None,
          plans: AgreedPlans | None = None) -> tuple[Plan, dict[str, Entry]]:
    """Check the request and agree on every rank's boxes and rank 0's staging directory (collectives on
    the default group); raise the same CheckpointError on every rank if any rank found a problem.

    With ``plans`` (the boxes agreed last), a repeat save of an unchanged structure needs one
    all-gather of five int64 per rank; otherwise one JSON all-gather. The plan holds no reference to
    the live tensors (only the returned entries do), so a background writer can use it while
    training goes on."""
    plan, entries, _ = agree_and_stage(path, model, optimizer, step, extra, checksum_block_bytes, data, plans)
    return plan, entries


def agree_and_stage(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    step: int | None, extra: Any, checksum_block_bytes: int, data: Any = None,
                    plans: AgreedPlans | None = None, meanwhile: Meanwhile | None = None
                    ) -> tuple[Plan, dict[str, Entry], Any]:
    """``agree``, then ``meanwhile(entries, boxes, rank)`` (e.g. ``async_save``'s host copy); returns its result too.

    NOTE: on a repeat save whose structure is unchanged here, ``meanwhile`` runs with the kept boxes while the small
    all-gather is in flight, so the copy hides the collective's latency; should any rank's request have changed, it
    runs again with the boxes the full agreement then settles. ``meanwhile`` must not raise."""
    rank, size = world()
    path = os.path.abspath(os.fspath(path))
    plans = plans if plans is not None else AgreedPlans()
    token, count = plans.next_token()
    staging = _staging_name(path, token, count)
    request: _Request | None = None
    failure: Exception | None = None
    try:
        with torch.no_grad():  # DTensor.to_local skips its autograd function (it is on the blocking path)
            request = _check_request(path, model, optimizer, step, extra, data, rank, staging)
    except Exception as err:  # shared with every rank by the full agreement below
        failure = err
    last = plans.current()
    # Every rank takes part whatever its own request holds, so all take the same branch below. NOTE: whether a plan
    # is kept is the same on every rank (all remember one after the same successful agreement, and forget it when
    # the default group is remade), so a first save skips this collective everywhere.
    if size > 1 and last is not None:
        unchanged_everywhere = _start_unchanged_check(request, plans, path, token, count)
        staged = None
        if meanwhile is not None and request is not None and request.structure() == last.structure:
            staged = meanwhile(request.entries, last.boxes, rank)
        if unchanged_everywhere():
            assert request is not None  # every rank's request is well formed and unchanged
            plans.advance()
            plan = _plan(path, staging, request, last.boxes, rank, size, step, extra, checksum_block_bytes)
            return plan, request.entries, staged

    def check() -> _Request:
        if failure is not None:
            raise failure
        assert request is not None
        return request

    def remove_staging() -> None:
        if request is not None and request.staging:
            shutil.rmtree(request.staging, ignore_errors=True)

    request, shared = collective_step(
        f"saving {path}", check, on_failure=remove_staging,
        share=lambda r: {"staging": r.staging, "token": [token, count], "signature": r.signature, "boxes": r.boxes,
                         "data": r.data_state})
    problem = _disagreement(shared)
    if problem is not None:
        remove_staging()
        raise CheckpointError(f"saving {path} failed: {problem}")
    boxes = [d["boxes"] for d in shared]
    plans.remember(request.structure(), boxes, *shared[0]["token"])
    plan = _plan(path, shared[0]["staging"], request, boxes, rank, size, step, extra, checksum_block_bytes)
    return plan, request.entries, meanwhile(request.entries, boxes, rank) if meanwhile is not None else None


def _plan(path: str, staging: str, request: _Request, boxes: list[dict[str, list]], rank: int, size: int,
          step: int | None, extra: Any, block: int) -> Plan:
    return Plan(path, staging, _index_tensors(request.entries), request.optim_meta, _mesh_info(), boxes, rank, size,
                step, extra, block, request.data_state)
