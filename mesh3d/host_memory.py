"""Host memory that follows tensor lifetimes: large allocations get their own mappings, so freeing returns them.

A long loop over large CPU tensors (a forecast's leads, a measured step) should hold the same resident memory at
its hundredth iteration as at its second. glibc's ``malloc`` does not promise that by default; this module asks
it to, where it can, and says so when it cannot.

NOTE: glibc serves an allocation of 128 KiB or more from a mapping of its own and unmaps it when freed, but each
such free raises that threshold to the freed size (up to 32 MiB). From the first freed intermediate on, tensors
up to that size come from malloc's heap, where freed chunks stay resident and are reused piecemeal. Measured on a
721 x 1440 x 70 forecast split over 4 ranks (a rank's block 73 MB, its 16-channel activations 17 MB): a rank's
resting RSS grew by 34 MiB from lead 1 to lead 2 and its peak by the same, where a fixed threshold keeps both
flat (scripts/bench_forecast.py). Setting the threshold explicitly turns glibc's adaptation off
(``mallopt(M_MMAP_THRESHOLD)``, as ``MALLOC_MMAP_THRESHOLD_`` in the environment does).

Usage::

    from mesh3d.host_memory import return_freed_memory
    return_freed_memory()          # True on glibc; allocations of 1 MiB or more are unmapped when freed
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["DEFAULT_OWN_MAPPING_BYTES", "return_freed_memory"]

#: glibc's mallopt parameter number for the mmap threshold
_M_MMAP_THRESHOLD = -3

#: The smallest allocation :func:`return_freed_memory` gives its own mapping by default. 1 MiB keeps the many
#: small tensors of a step (biases, norms' statistics) in the heap, where a fresh mapping would cost a system call
#: and zeroed pages each time, while every block-sized tensor of a field goes back to the OS when freed.
DEFAULT_OWN_MAPPING_BYTES = 1 << 20

#: glibc's own upper bound for the threshold (``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit)
_GLIBC_MAX_THRESHOLD = 32 << 20


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError, AttributeError):   # not a name this platform knows (macOS, Windows)
        return False


def return_freed_memory(own_mapping_bytes: int = DEFAULT_OWN_MAPPING_BYTES) -> bool:
    """Give every allocation of ``own_mapping_bytes`` or more its own mapping from now on (glibc only).

    Usage: ``return_freed_memory()  # before a long loop over large CPU tensors``

    Returns True where the threshold is now fixed (glibc), False where this process's C library is not glibc
    (musl, macOS: their allocators do not adapt this way) or where ``MALLOC_MMAP_THRESHOLD_`` is set in the
    environment (the user's own setting wins: it fixed the threshold when the process started). The setting
    lasts for the process: glibc cannot restore its adaptive default.
    """
    if not isinstance(own_mapping_bytes, int) or not 0 < own_mapping_bytes <= _GLIBC_MAX_THRESHOLD:
        raise ValueError(f"own_mapping_bytes={own_mapping_bytes!r} must be an int in 1..{_GLIBC_MAX_THRESHOLD} "
                         "(glibc's largest mmap threshold, 32 MiB)")
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or not _glibc():
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, own_mapping_bytes))
