"""Building a user's model on the meta device without leaving meta tensors in libraries' caches.

Usage::

    with built_on_meta():
        model = factory()            # parameters and buffers on meta, as under torch.device("meta")

Why: some libraries keep tensors in ``functools.lru_cache``s keyed by sizes, not by device: torch-harmonics 0.9.3
keeps its Legendre polynomials and quadrature weights so. A model built under ``torch.device("meta")`` (``mesh3d
plan``, ``mesh3d check``, ``mesh3d explain``, a meta-device init under Lightning) leaves meta tensors there, and the
next model of the same sizes built on the CPU or a GPU in that process gets meta buffers: its forward fails with
"Tensor on device cpu is not on the expected device meta!". ``built_on_meta`` builds under the meta device and forgets
those caches before and after.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch

__all__ = ["built_on_meta", "forget_device_blind_caches"]

#: Libraries whose lru caches hold tensors keyed without their device (top-level module names).
_LIBRARIES = ("torch_harmonics",)


@contextlib.contextmanager
def built_on_meta() -> Iterator[None]:
    """``torch.device("meta")`` for building a model, with ``forget_device_blind_caches()`` before (a cached CPU
    tensor would land on meta's model) and after (a cached meta tensor would land on the next real model)."""
    forget_device_blind_caches()
    try:
        with torch.device("meta"):
            yield
    finally:
        forget_device_blind_caches()


def forget_device_blind_caches() -> None:
    """Clear the lru caches of the imported libraries known to keep tensors by size alone (``_LIBRARIES``).

    Usage: ``forget_device_blind_caches()`` after anything built a library's modules under ``torch.device("meta")``
    """
    for name, module in list(sys.modules.items()):
        if module is None or name.split(".", 1)[0] not in _LIBRARIES:
            continue
        for value in list(vars(module).values()):
            _clear(value)
            for cell in getattr(value, "__closure__", None) or ():  # NOTE: a decorator's wrapper holds the cache
                try:
                    _clear(cell.cell_contents)
                except ValueError:  # an empty cell
                    continue


def _clear(value: object) -> None:
    clear = getattr(value, "cache_clear", None)
    if callable(clear) and not isinstance(value, type):
        clear()
