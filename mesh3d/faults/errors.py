"""The errors a survivor raises when a peer is lost or a collective times out, and the exit status of a fail-stop.

Usage::

    try:
        with dm.guard("train step"):
            train_step(batch)
    except PeerLostError as err:
        err.lost          # {global rank: why it is considered lost}
    except CollectiveTimeoutError as err:
        err.where         # {global rank: what it was doing and where its main thread was}
"""

from __future__ import annotations

__all__ = ["CollectiveTimeoutError", "PEER_LOST_EXIT_CODE", "PeerLostError", "STORE_RANK", "WHAT_TO_DO"]

#: The exit status of a survivor that the peer watch ended because its main thread stayed blocked inside a
#: backend collective after a peer was lost (gloo cannot abort a collective from another thread: gloo#388).
#: Any non-zero status makes ``torchrun --max-restarts`` restart the job; 76 tells this case apart in logs.
PEER_LOST_EXIT_CODE = 76

#: The key of ``PeerLostError.lost`` when the job's store itself is unreachable (its host is gone).
STORE_RANK = -1

#: What a survivor of a lost peer should do (every PeerLostError ends with it).
WHAT_TO_DO = (
    "This rank cannot finish the step without it: let this process end (every survivor reports this too) and "
    "restart the job from its latest complete checkpoint (torchrun --max-restarts does it by itself; "
    "docs/recipes.md). The lost rank's own log says why it ended.")


class PeerLostError(RuntimeError):
    """One or more ranks of the job are gone (killed, failed, or silent): raised on every survivor.

    Usage: ``except PeerLostError as err: print(err.lost)  # {rank: reason}; then end, and restart``
    """

    def __init__(self, message: str, lost: dict[int, str]) -> None:
        super().__init__(message)
        self.lost = lost

    @classmethod
    def naming(cls, lost: dict[int, str], describe, doing: str, cause: BaseException | None) -> PeerLostError:
        """The error for ``lost`` ({rank: reason}) as seen by a rank that was ``doing`` something."""
        names = "; ".join(
            ("the job's store (its host is gone)" if rank == STORE_RANK else describe(rank)) + f": {reason}"
            for rank, reason in sorted(lost.items()))
        seen = f" ({type(cause).__name__}: {_first_line(cause)})" if cause is not None else ""
        return cls(f"lost {names}. This rank was {doing or 'between steps'}{seen}. {WHAT_TO_DO}", dict(lost))


class CollectiveTimeoutError(RuntimeError):
    """A collective waited longer than the group timeout: the message says where every rank was at that moment.

    Usage: ``except CollectiveTimeoutError as err: print(err.where)  # {rank: activity and main-thread line}``
    """

    def __init__(self, message: str, where: dict[int, str]) -> None:
        super().__init__(message)
        self.where = where


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0][:200] if lines else ""
