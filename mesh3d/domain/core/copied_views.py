"""Views that are copies: a ``view`` whose rows had to move between ranks (windows cut across ranks on slabs, a window
partition or a patching on blocks) cannot alias the tensor it views, as torch's view does. While both are alive, a
write into either is refused, naming the view: the other would not see it (silently wrong otherwise).

Usage (a rule that made such a view, and the dispatcher before a write)::

    out = mark_copied_view(out, x, "torch.Tensor.view")    # out is a copy of x's rows
    refuse_write_through_copy(target, "torch.Tensor.mul_")  # raises while target or its copy/base is alive
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.compiler import is_compiling

__all__ = ["has_copy_marks", "is_made_as_copy", "made_as_copy", "mark_copied_view", "refuse_write_through_copy"]

#: On a copy: (a weak reference to the tensor it views, the view op's name). On that tensor: weak references to its
#: live copies. NOTE: plain instance attributes (the tensors' ``__dict__``), read only by a write.
_OF, _COPIES = "_mesh3d_copy_of", "_mesh3d_copies"
#: On the result of a call that may answer with a view in torch (``reshape``, ``flatten``) where its rows moved: a copy
_MADE_AS_COPY = "_mesh3d_made_as_copy"


def made_as_copy(out: Any) -> Any:
    """Record that ``out``, the result of a call torch may answer with a view (``reshape``), is a copy on every rank
    (its rows moved): it is written as a tensor of its own. Returns it.

    Usage: ``return made_as_copy(run_step(step))``
    """
    if isinstance(out, torch.Tensor) and not is_compiling():
        setattr(out, _MADE_AS_COPY, True)
    return out


def is_made_as_copy(t: Any) -> bool:
    """Whether ``t`` is a copy made by a view function's rule (``made_as_copy``, ``mark_copied_view``)."""
    d = getattr(t, "__dict__", None)
    return bool(d) and (_MADE_AS_COPY in d or _OF in d)


def mark_copied_view(out: Any, base: torch.Tensor, op: str) -> Any:
    """Record that ``out`` (a domain tensor a view op made) holds a copy of ``base``'s rows, not an alias; returns it."""
    if not isinstance(out, torch.Tensor) or is_compiling():
        return out  # NOTE: no weak references in a traced graph (its values are not the tensors a user holds)
    setattr(out, _OF, (weakref.ref(base), op))
    copies = getattr(base, _COPIES, None)
    if copies is None:
        copies = []
        setattr(base, _COPIES, copies)
    copies[:] = [r for r in copies if r() is not None] + [weakref.ref(out)]
    return out


def has_copy_marks(t: Any) -> bool:
    """Whether ``t`` (a domain tensor) was ever a copied view or had one: the cheap test before a write's check."""
    d = t.__dict__
    return _OF in d or _COPIES in d


def refuse_write_through_copy(target: Any, op: str) -> None:
    """Raise if ``target`` is a live copy of a live tensor, or a tensor with a live copy (an in-place ``op`` into it
    would not reach the other, as it would in one process)."""
    d = getattr(target, "__dict__", None)
    if not d:
        return
    of = d.get(_OF)
    if of is not None and of[0]() is not None:
        raise NotImplementedError(
            f"{op} into the result of {of[1]}, which mesh3d made as a copy (its rows had to move between ranks: "
            "windows cut across ranks, or a window partition or patching on blocks), not a view: the tensor it views "
            "would not change as in one process. Write out of place (y = y * m, not y.mul_(m)), or write into the "
            "tensor before taking the view")
    copies = d.get(_COPIES)
    if copies and any(r() is not None for r in copies):
        names = {r()._mesh3d_copy_of[1] for r in copies if r() is not None}
        raise NotImplementedError(
            f"{op} into a domain tensor whose {', '.join(sorted(names))} result is alive as a copy (its rows had to "
            "move between ranks: windows cut across ranks, or a window partition or patching on blocks), not a view: "
            "the copy would not change as a view does in one process. Write out of place (x = x * m), or drop the "
            "view first")
