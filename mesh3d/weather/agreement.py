"""Steps every rank of a forecast or a scoring runs before the next collective, with their outcome agreed: a rank that
fails tells the others, which all raise, instead of leaving them in the next collective until the group's timeout.

- ``agreed(what, step, dm)``: any rank's failure becomes the same ``CheckpointError`` on every rank (the checkpointer's
  agreed-error step: rank 0 creating the store, finishing it);
- ``agreed_checks(what, check, dm)``: a request checked on every rank; a refusal every rank gives alike is raised as
  itself (its type and words: a ``ValueError`` stays one), marked as shared by every rank so it is reported once;
  refusals that differ between ranks are one ``CheckpointError`` naming each.

Usage::

    spec = agreed_checks("score_forecast: the request", lambda: read_spec(path), dm)
    agreed(f"forecast: create the store {out}", create, dm)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from mesh3d.checkpoint.comm import allgather_json, collective_step, raise_if_any_failed
from mesh3d.faults.summary import mark_shared
from mesh3d.manager import DistributedManager

__all__ = ["agreed", "agreed_checks"]

T = TypeVar("T")


def agreed(what: str, step: Callable[[], None], dm: DistributedManager | None) -> None:
    """``step()`` on every rank, then agreed: a rank that fails (rank 0 writing the store's metadata: a full disk, no
    permission) tells every rank, which all raise its error. One process: ``step()`` itself."""
    if dm is not None and dm.world_size > 1:
        collective_step(what, step, group=dm.world_mesh.get_group())
    else:
        step()


def agreed_checks(what: str, check: Callable[[], T], dm: DistributedManager | None) -> T:
    """``check()`` on every rank; its result when every rank passed, else every rank raises (see the module)."""
    if dm is None or dm.world_size == 1:
        return check()
    mine: Exception | None = None
    text = None
    try:
        result = check()
    except Exception as err:  # shared with every rank below, so all raise together
        mine, text = err, f"{type(err).__name__}: {' '.join(str(err).split())}"
    group = dm.world_mesh.get_group()
    texts = allgather_json(text, group=group)
    if all(t is None for t in texts):
        return result
    if mine is not None and all(t == text for t in texts):
        raise mark_shared(mine, range(dm.world_size))
    raise_if_any_failed(text, what, group=group)   # NOTE: every rank takes this path: they saw the same texts
    raise AssertionError("unreachable: a rank failed")
