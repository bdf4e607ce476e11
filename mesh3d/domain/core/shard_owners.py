"""Which wrapper domain tensor a plain shard belongs to, while both live: the marks ``core.wrapped`` reads.

Usage::

    SHARD_OWNERS.mark(local, wrapper)     # local is the wrapper's shard, or a differentiable alias of it
    SHARD_OWNERS.owner(local)             # that wrapper while it lives, else None
    SHARD_OWNERS.marked(local)            # whether local was ever marked (then it is no fresh result)

NOTE: kept beside the tensors, never among their attributes: a shard may be the user's own tensor (wrapped whole on
one rank, ``domain.from_local``'s, what ``to_local()`` answers), and a weak reference in its ``__dict__`` made
``torch.save`` of it fail (weak references do not pickle) and was carried into its deep copies. A mark goes with
its tensor (a weak reference's callback); a mark whose owner is gone answers None.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch


__all__ = ["SHARD_OWNERS", "ShardOwners", "version_of"]


class _Mark(weakref.ref):
    """A weak reference to a marked shard, carrying a weak reference to its owner."""

    __slots__ = ("owner",)
    owner: weakref.ref


#: How many marks the table holds before its first sweep of the marks of dead shards
_FIRST_SWEEP = 4096


class ShardOwners:
    """The marks of the shards of live wrapper tensors, by the shard's identity (module docstring).

    Usage: ``SHARD_OWNERS.mark(local, out); SHARD_OWNERS.owner(local) is out``

    NOTE: a dead shard's mark stays until the table doubles, then a sweep drops every dead one. A callback per mark
    (the weak reference's) cost a Python call each time a shard died, on every op; a dead mark answers as no mark
    (its reference is None, never the tensor asked about, though that tensor may reuse the dead one's id).
    """

    def __init__(self) -> None:
        self._marks: dict[int, _Mark] = {}
        self._sweep_at = _FIRST_SWEEP

    def mark(self, local: torch.Tensor, owner: Any) -> None:
        """``local`` belongs to ``owner`` (replacing any earlier mark of it)."""
        mark = _Mark(local)
        mark.owner = weakref.ref(owner)
        marks = self._marks
        marks[id(local)] = mark
        if len(marks) > self._sweep_at:
            self._sweep()

    def owner(self, local: Any) -> Any:
        """The live wrapper tensor ``local`` was marked for, else None."""
        mark = self._marks.get(id(local))
        return None if mark is None or mark() is not local else mark.owner()

    def marked(self, local: Any) -> bool:
        """Whether ``local`` was marked, whether or not its owner still lives."""
        mark = self._marks.get(id(local))
        return mark is not None and mark() is local

    def fresh(self, local: Any) -> bool:
        """Whether ``local``, a plain result of torch's call on shards, is memory of its own: no view, and no shard
        a wrapper was made of (``x.float()`` of a float shard is the shard). A fresh result becomes a new wrapper with
        nothing to hand back or record as a view (``core.wrapped.fresh_wrapper``).

        Usage: ``out = fresh_wrapper(o, spec) if SHARD_OWNERS.fresh(o) else DomainTensor._from_local(o, spec)``
        """
        return local._base is None and not self.marked(local)

    def __len__(self) -> int:
        """The marks held, of dead shards too until the next sweep."""
        return len(self._marks)

    def _sweep(self) -> None:
        marks = self._marks
        for key in [key for key, mark in marks.items() if mark() is None]:
            del marks[key]
        self._sweep_at = max(_FIRST_SWEEP, 2 * len(marks))


#: The marks of this process's wrapper tensors.
SHARD_OWNERS = ShardOwners()


def version_of(t: torch.Tensor) -> int:
    """``t._version``, or 0 for an inference tensor (made under ``torch.inference_mode``): it keeps no version counter.

    Usage: ``out._seen_version = version_of(local)``
    """
    try:
        return t._version
    except RuntimeError:  # NOTE: "Inference tensors do not track version counter": wrapping one crashed every op
        return 0
