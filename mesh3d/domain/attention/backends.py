"""Where attention blocks run and which CUDA attention ops they call: one object, replaceable for planning and tests.

A ring block (and gather's and Ulysses' SDPA call) asks a ``BlockKernels`` three things: the platform of its tensors
(``"cpu"``, ``"cuda"`` or another: math), which of torch's CUDA kernels would take the call (``choose``, torch's
own choice; ``can_use``, one kernel's constraints), and, to run it, the kernel ops themselves (flash,
memory-efficient and cuDNN forward and backward, each returning or reading its log-sum-exp in its own layout:
``mesh3d._torch_private.kernels``). ``BLOCK_KERNELS.value`` holds the one in force:

* ``BlockKernels()`` (the default): tensors' own devices, torch's choice on this GPU, torch's ops;
* ``PlannedCudaKernels(workspace)``: what ``mesh3d plan --kernels cuda`` models on meta tensors: they stand for
  CUDA ones, the kernel is chosen by ``kernel_rules`` (no GPU to ask), the same ops run their meta kernels, and
  ``workspace`` adds what a kernel holds inside beside its outputs (the planner's CUDA model);
* a stand-in of the tests (CPU tensors standing for CUDA ones, the ops computed explicitly under the same contract),
  so the choice and the calls around each kernel are tested without a GPU.

Usage::

    with use_block_kernels(PlannedCudaKernels(cuda_kernel_workspace)):
        loss = model(x_on_meta).sum()            # ring blocks planned as the fused kernels CUDA runs

NOTE: a slot on an object, like ``core.settings.SETTINGS`` (Dynamo traces an attribute read, not a ContextVar);
the ring saves the object its forward ran with for its backward (autograd may run that on another thread).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.compiler import is_dynamo_compiling
from torch.backends.cuda import SDPAParams, can_use_cudnn_attention, can_use_efficient_attention, \
    can_use_flash_attention

from mesh3d._torch_private import (cuda_cudnn_backward, cuda_cudnn_forward, cuda_efficient_backward,
                                   cuda_efficient_forward, cuda_flash_backward, cuda_flash_forward, cuda_sdpa_choice,
                                   efficient_lse_rows)
from mesh3d.domain.attention.kernel_rules import SdpaCall, kernel_accepts, sdpa_choice
from mesh3d.domain.core.settings import ValueSlot

__all__ = ["BLOCK_KERNELS", "BlockKernels", "KernelsSlot", "PlannedCudaKernels", "use_block_kernels"]

_CAN_USE = {"flash": can_use_flash_attention, "efficient": can_use_efficient_attention,
            "cudnn": can_use_cudnn_attention}


class BlockKernels:
    """Torch's own: the tensors' devices, torch's kernel choice on this GPU, torch's fused attention ops.

    The op methods take and return what ``mesh3d._torch_private.kernels`` documents (SDPA's (B, H, L, E) layout;
    flash's log-sum-exp (B, H, Lq), the memory-efficient one's padded to ``lse_rows(Lq)``, cuDNN's (B, H, Lq, 1)).
    """

    def platform(self, t: torch.Tensor) -> str:
        """Whose kernels run a block of ``t``: ``"cpu"``, ``"cuda"``, or another device (the math kernel)."""
        return t.device.type

    def choose(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
               gqa: bool) -> str:
        """The kernel torch's SDPA would run for this call: ``"flash"``, ``"efficient"``, ``"cudnn"`` or ``"math"``.

        NOTE: Dynamo cannot trace torch's choice (an op returning an int: a graph break in every compiled attention
        call); while it traces, the rules of torch's default order answer (``kernel_rules``)."""
        if is_dynamo_compiling():
            return sdpa_choice(SdpaCall.of(q, k, v, mask, causal))
        return cuda_sdpa_choice(q, k, v, mask, causal, gqa)

    def can_use(self, kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                causal: bool) -> bool:
        """Whether ``kernel`` takes this call (torch's public ``can_use_*`` checks; K/V heads as the queries')."""
        if is_dynamo_compiling():
            return kernel_accepts(kernel, SdpaCall.of(q, k, v, mask, causal))
        return bool(_CAN_USE[kernel](SDPAParams(q, k, v, mask, 0.0, causal, False)))

    def lse_rows(self, rows: int) -> int:
        """The memory-efficient kernel's log-sum-exp length for ``rows`` queries."""
        return efficient_lse_rows(rows)

    def internal_workspace(self, func: Any, args: tuple, kwargs: dict, out: Any) -> int:
        """Bytes an op holds inside beside its inputs and outputs (only a plan counts them)."""
        return 0

    def flash_forward(self, q, k, v, causal: bool, scale: float):
        return cuda_flash_forward(q, k, v, causal, scale)

    def flash_backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        return cuda_flash_backward(dout, q, k, v, out, lse, causal, scale)

    def efficient_forward(self, q, k, v, bias, causal: bool, scale: float):
        return cuda_efficient_forward(q, k, v, bias, causal, scale)

    def efficient_backward(self, dout, q, k, v, bias, out, lse, causal: bool, scale: float):
        return cuda_efficient_backward(dout, q, k, v, bias, out, lse, causal, scale)

    def cudnn_forward(self, q, k, v, causal: bool, scale: float):
        return cuda_cudnn_forward(q, k, v, causal, scale)

    def cudnn_backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        return cuda_cudnn_backward(dout, q, k, v, out, lse, causal, scale)


@dataclass(frozen=True, eq=True)
class PlannedCudaKernels(BlockKernels):
    """A plan's CUDA kernels on meta tensors (module docstring); ``order``: torch's priority order to model."""

    workspace: Callable[[Any, tuple, dict, Any], int] | None = None
    order: tuple[str, ...] = ("flash", "efficient", "math", "cudnn")

    def platform(self, t: torch.Tensor) -> str:
        return "cuda" if t.device.type == "meta" else t.device.type

    def choose(self, q, k, v, mask, causal, gqa) -> str:
        return sdpa_choice(SdpaCall.of(q, k, v, mask, causal), self.order)

    def can_use(self, kernel, q, k, v, mask, causal) -> bool:
        return kernel_accepts(kernel, SdpaCall.of(q, k, v, mask, causal))

    def lse_rows(self, rows: int) -> int:
        return -(-rows // 32) * 32  # what the meta kernel allocates

    def internal_workspace(self, func, args, kwargs, out) -> int:
        return self.workspace(func, args, kwargs, out) if self.workspace is not None else 0


class KernelsSlot(ValueSlot[BlockKernels]):
    """Holds the ``BlockKernels`` in force (``value``); ``replaced(k)`` puts ``k`` there inside a ``with`` block."""

    def __init__(self) -> None:
        super().__init__(BlockKernels(), "block kernels")


#: The block kernels of this process.
BLOCK_KERNELS = KernelsSlot()


def use_block_kernels(kernels: BlockKernels) -> contextlib.AbstractContextManager[BlockKernels]:
    """Run attention blocks with ``kernels`` inside the ``with`` block (module docstring).

    Usage: ``with use_block_kernels(PlannedCudaKernels(workspace)): ...``
    """
    return BLOCK_KERNELS.replaced(kernels)
