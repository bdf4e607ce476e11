"""What activation checkpointing's recomputation needs from the forward it repeats, on domain tensors.

Usage (``mesh3d.domain`` installs it when imported; nothing to call)::

    install()  # torch.utils.checkpoint / Plan(checkpoint=...) then recompute a region as its forward ran

A checkpointed region is recomputed in backward. Two things must be as they were in forward:
* its inputs are domain tensors. A checkpointed module inside a checkpointed module gets them back from
  another checkpoint's saved tensors, and unpacking makes plain tensors: the spec kept beside each input
  wraps the shard again;
* the attention mode and halo/compute overlap in force (``attention_mode``, ``window_overlap``): backward runs
  outside the ``with`` block the forward ran in. Another mode saves other tensors (torch's checkpoint then
  raises) and rounds differently.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import ContextManager

import torch

from mesh3d._torch_private import patch_checkpoint_recomputation
from mesh3d.domain.attention_modes import ATTENTION
from mesh3d.domain.overlap import OVERLAP
from mesh3d.domain.tensor import DomainSpec, DomainTensor, wrap

__all__ = ["install"]


def _input_spec(t: torch.Tensor) -> DomainSpec | None:
    return t._spec if isinstance(t, DomainTensor) else None


def _as_domain_tensor(unpacked: torch.Tensor, spec: DomainSpec) -> DomainTensor:
    return unpacked if isinstance(unpacked, DomainTensor) else wrap(unpacked, spec)


#: The settings a rule reads at call time, which a recomputation must see as its forward did (not ``OVERLAP.calls``,
#: a counter).
_SETTINGS = ((ATTENTION, ("mode", "head_groups", "kernel", "balance", "ring_min_tokens")), (OVERLAP, ("enabled", "blocks")))


def _read_settings() -> list[tuple[object, str, object]]:
    return [(owner, name, getattr(owner, name)) for owner, names in _SETTINGS for name in names]


def _put_settings(settings: list[tuple[object, str, object]]) -> None:
    for owner, name, value in settings:
        setattr(owner, name, value)


def _forward_settings() -> Callable[[], ContextManager]:
    """The attention and overlap settings now (at forward time), as a context manager factory that re-enters them."""
    in_forward = _read_settings()

    @contextlib.contextmanager
    def as_in_forward() -> Iterator[None]:
        before = _read_settings()
        _put_settings(in_forward)
        try:
            yield
        finally:
            _put_settings(before)

    return as_in_forward


def install() -> bool:
    """Patch torch's checkpoint frame once (``_torch_private.patch_checkpoint_recomputation``); False if already done
    or if this torch has no such frame (nested checkpointing of domain tensors is then unsupported)."""
    return patch_checkpoint_recomputation(_input_spec, _as_domain_tensor, _forward_settings)
