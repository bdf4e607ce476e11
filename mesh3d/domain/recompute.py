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

from collections.abc import Callable
from typing import ContextManager

import torch

from mesh3d._torch_private import patch_checkpoint_recomputation
from mesh3d.domain.core.settings import SETTINGS
from mesh3d.domain.core.specs import DomainSpec
from mesh3d.domain.core.tensor import DomainTensor, wrap

__all__ = ["install"]


def _input_spec(t: torch.Tensor) -> DomainSpec | None:
    return t._spec if isinstance(t, DomainTensor) else None


def _as_domain_tensor(unpacked: torch.Tensor, spec: DomainSpec) -> DomainTensor:
    return unpacked if isinstance(unpacked, DomainTensor) else wrap(unpacked, spec)


def _forward_settings() -> Callable[[], ContextManager]:
    """The settings now (at forward time), as a context manager factory that puts them back in force."""
    in_forward = SETTINGS.value
    return lambda: SETTINGS.replaced(in_forward)


def install() -> bool:
    """Patch torch's checkpoint frame once (``_torch_private.patch_checkpoint_recomputation``); False if already done
    or if this torch has no such frame (nested checkpointing of domain tensors is then unsupported)."""
    return patch_checkpoint_recomputation(_input_spec, _as_domain_tensor, _forward_settings)
