"""The one exception type the checkpointer raises for bad checkpoints or bad requests.

Usage::

    try:
        checkpoint.load(path, model)
    except CheckpointError as err:
        print(err)          # names the file and the tensor
"""

from __future__ import annotations

__all__ = ["CheckpointError", "CheckpointFormatError"]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message says which file/tensor and why.

    Usage: ``except CheckpointError as err:`` around ``checkpoint.save``/``load``; ``str(err)`` names file and tensor

    Raised for a step every rank takes together, it carries every failed rank's traceback in ``rank_tracebacks``
    ({rank: text}; empty otherwise): the message itself gives each cause in one line.
    """

    def __init__(self, *args: object, rank_tracebacks: dict[int, str] | None = None) -> None:
        super().__init__(*args)
        self.rank_tracebacks: dict[int, str] = dict(rank_tracebacks or {})


class CheckpointFormatError(CheckpointError, ValueError):
    """``index.json`` (or a shard header) is malformed: the checkpoint is refused before any read.

    Usage: ``except CheckpointFormatError: ...  # a malformed index.json, found before any read``
    """
