"""Pending domain notices at teardown: each is waited for once, so repeated shutdowns never wait on it again."""

from __future__ import annotations

from datetime import timedelta

from mesh3d.domain.comm.exchange import PendingNotices


class _Work:
    """A posted notice: ``lands`` says whether a peer takes it; counts the waits."""

    def __init__(self, lands: bool) -> None:
        self.lands = lands
        self.waits = 0

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waits += 1
        if not self.lands:
            raise RuntimeError("Timed out waiting for the send to complete")  # what gloo raises
        return True


def test_a_notice_no_peer_takes_is_waited_for_once_then_held():
    notices = PendingNotices()
    taken, lost = _Work(lands=True), _Work(lands=False)
    notices.keep([taken, lost])
    notices.settle(timedelta(milliseconds=10))
    assert (notices.pending, notices.abandoned) == (0, 1)
    assert (taken.waits, lost.waits) == (1, 1)
    later = _Work(lands=True)
    notices.keep([later])
    for _ in range(3):  # the next meshes' shutdowns
        notices.settle(timedelta(milliseconds=10))
    assert (lost.waits, later.waits) == (1, 1)  # the lost notice is never waited for again
    assert (notices.pending, notices.abandoned) == (0, 1)
