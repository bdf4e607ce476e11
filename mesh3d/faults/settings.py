"""The peer watch's timing: heartbeat interval, how long silence means a peer is lost, the grace after a loss.

Usage: ``DistributedManager.initialize(watch=WatchSettings(interval=0.5, suspect_after=2, dead_after=30))``
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["WatchSettings"]


@dataclass(frozen=True)
class WatchSettings:
    """Seconds: heartbeat ``interval``; silence that means lost with (``suspect_after``) and without evidence
    (``dead_after``); how long a survivor blocked in a collective waits after a loss (``grace``) before it ends.

    Usage: ``WatchSettings.from_env()`` reads ``MESH3D_HEARTBEAT`` (the interval; 0 turns the watch off),
    ``MESH3D_PEER_DEAD_AFTER`` and ``MESH3D_PEER_GRACE``.
    """

    interval: float = 1.0
    suspect_after: float = 3.0
    dead_after: float = 60.0
    grace: float = 10.0

    def __post_init__(self) -> None:
        for name in ("interval", "suspect_after", "dead_after", "grace"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"WatchSettings.{name}={value!r} must be a number of seconds >= 0")
        if self.interval and not self.interval * 2 <= self.suspect_after <= self.dead_after:
            raise ValueError(
                f"WatchSettings needs 2 * interval <= suspect_after <= dead_after (a peer must miss two beats before it "
                f"is suspected); got interval={self.interval}, suspect_after={self.suspect_after}, "
                f"dead_after={self.dead_after}")

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    @classmethod
    def from_env(cls) -> WatchSettings:
        values = {}
        for field, env in (("interval", "MESH3D_HEARTBEAT"), ("dead_after", "MESH3D_PEER_DEAD_AFTER"),
                           ("grace", "MESH3D_PEER_GRACE")):
            if env in os.environ:
                try:
                    values[field] = float(os.environ[env])
                except ValueError:
                    raise ValueError(f"{env}={os.environ[env]!r} must be a number of seconds") from None
        if values.get("interval"):
            values.setdefault("suspect_after", max(cls.suspect_after, 3 * values["interval"]))
        return cls(**values)
