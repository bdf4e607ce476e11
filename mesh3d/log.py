"""Rank-aware logging: every record carries the rank and its mesh coordinates.

Usage::

    from mesh3d.log import get_logger, configure_logging
    configure_logging()                       # "[rank 3 b1 d0 m1] message" on stderr
    log = get_logger(__name__)                # any name, __main__ included: printed by that handler
    log.info("step %d", step)                 # from every rank
    log.info_rank0("loss %.4f", loss)         # from rank 0 only
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any
from mesh3d.manager import DistributedManager

__all__ = ["get_logger", "configure_logging", "RankLogger", "rank_context"]

_ROOT = "mesh3d"
_FORMAT = "%(asctime)s [%(rankinfo)s] %(levelname)s %(name)s: %(message)s"


def rank_context() -> tuple[int, str]:
    """This process's rank and a short tag with its mesh coordinates (``"rank 3 b1 d0 m1"``)."""
    if DistributedManager.is_initialized():
        dm = DistributedManager()
        c = dm.coordinates
        return dm.rank, f"rank {dm.rank} b{c['batch']} d{c['domain']} m{c['model']}"
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    return rank, f"rank {rank}"


class RankLogger(logging.LoggerAdapter):
    """A logger whose records carry ``rank`` and ``rankinfo``, with ``*_rank0`` helpers."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        rank, info = rank_context()
        extra = dict(kwargs.get("extra") or {})
        extra.setdefault("rank", rank)
        extra.setdefault("rankinfo", info)
        kwargs["extra"] = extra
        return msg, kwargs

    def log_rank0(self, level: int, msg: str, *args: Any, **kwargs: Any) -> None:
        """Log only on global rank 0 (nothing is communicated)."""
        if rank_context()[0] == 0:
            self.log(level, msg, *args, **kwargs)

    def info_rank0(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self.log_rank0(logging.INFO, msg, *args, **kwargs)

    def warning_rank0(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self.log_rank0(logging.WARNING, msg, *args, **kwargs)


def get_logger(name: str = "mesh3d") -> RankLogger:
    """A :class:`RankLogger` around the logger ``name`` inside the ``mesh3d`` hierarchy: ``mesh3d`` and its children as
    they are, any other name as the child ``mesh3d.<name>`` (``get_logger(__name__)`` in a script is
    ``mesh3d.__main__``), so ``configure_logging``'s handler prints it, whichever of the two is called first.

    Usage: ``log = get_logger("train"); log.info_rank0("step %d", step)``
    """
    if name != _ROOT and not name.startswith(_ROOT + "."):
        # NOTE: a script's own logger ("__main__") is not below "mesh3d", where configure_logging puts its handler
        # (not on the root logger: that would print every library's records on every rank); nesting it there does.
        name = f"{_ROOT}.{name}"
    return RankLogger(logging.getLogger(name), {})


class _RankInfoFilter(logging.Filter):
    """Fills ``rankinfo`` for records that did not come through a RankLogger."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "rankinfo"):
            record.rank, record.rankinfo = rank_context()
        return True


def configure_logging(level: int | str = logging.INFO, stream: Any = None) -> logging.Handler:
    """Attach one stderr handler with the rank-aware format to the ``mesh3d`` logger (every ``get_logger`` logger is
    below it).

    Usage: ``configure_logging(); get_logger(__name__).info("printed on every rank")``
    """
    logger = logging.getLogger(_ROOT)
    for handler in list(logger.handlers):
        if getattr(handler, "_mesh3d", False):
            logger.removeHandler(handler)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT))
    handler.addFilter(_RankInfoFilter())
    handler._mesh3d = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(level)
    return handler
