"""Host-staged gloo: ranks that compute on CUDA talk over gloo, every device tensor moved through pinned host buffers.

For tests on one GPU (several ranks share it: NCCL refuses that) and for machines without NCCL; never as fast as NCCL.
``DistributedManager.initialize(backend="gloo", device="cuda")`` uses it for every group of the mesh (docs/manager.md).

Usage::

    from mesh3d.staged_gloo import STAGED, STAGED_BACKEND
    STAGED.register()
    group = dist.new_group(ranks, backend=STAGED_BACKEND)   # any collective or send/recv of CUDA tensors works
"""

from mesh3d.staged_gloo.buffers import HostBuffers, StagingStats
from mesh3d.staged_gloo.copies import CudaCopies, DeviceCopies
from mesh3d.staged_gloo.group import STAGED_BACKEND, StagedGlooGroup
from mesh3d.staged_gloo.transport import STAGED, StagedGlooTransport
from mesh3d.staged_gloo.work import StagedWork

__all__ = ["STAGED", "STAGED_BACKEND", "CudaCopies", "DeviceCopies", "HostBuffers", "StagedGlooGroup",
           "StagedGlooTransport", "StagedWork", "StagingStats"]
