"""The bytes PyTorch's CUDA caching allocator counts for one allocation (``torch.cuda.max_memory_allocated``).

torch 2.11-2.13, default settings (``c10/cuda/CUDACachingAllocator.cpp``; no ``expandable_segments``, no
``roundup_power2_divisions``):

* every request is rounded up to a multiple of 512 bytes (``kMinBlockSize``); an empty tensor allocates
  nothing;
* requests up to 1 MiB (``kSmallSize``) come from 2 MiB segments of the small pool, split exactly;
* larger ones from the large pool: a new segment is 20 MiB (``kLargeBuffer``) for requests under 10 MiB
  (``kMinLargeAlloc``), else the request rounded up to 2 MiB (``kRoundLarge``); the block is split off only
  if more than 1 MiB would remain, otherwise the whole segment is the block and is counted as allocated.

So a request of 10 MiB or more is counted at the next multiple of 2 MiB when that is at most 1 MiB away.
This is exact for a block cut from a new segment (the first step's); a block reused from the cache may be
counted up to 1 MiB larger (an unsplit cached block), which the verdict's fragmentation margin covers.

Usage::

    cuda_block_bytes(1000)              # 1024
    cuda_block_bytes(257 * 2**20 + 1)   # 258 MiB: a new 258 MiB segment, 1 MiB - 1 left: not split
"""

from __future__ import annotations

__all__ = ["cuda_block_bytes"]

_MIN_BLOCK = 512
_SMALL = 1 << 20
_MIN_LARGE_ALLOC = 10 << 20
_ROUND_LARGE = 2 << 20


def cuda_block_bytes(nbytes: int) -> int:
    """The bytes the caching allocator counts as allocated for a request of ``nbytes`` (module docstring).

    Usage: ``cuda_block_bytes(t.untyped_storage().nbytes())``
    """
    if nbytes <= 0:
        return 0
    size = -(-nbytes // _MIN_BLOCK) * _MIN_BLOCK
    if size < _MIN_LARGE_ALLOC:
        return size
    segment = -(-size // _ROUND_LARGE) * _ROUND_LARGE
    return segment if segment - size <= _SMALL else size
