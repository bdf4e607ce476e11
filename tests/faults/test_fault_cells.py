"""The fault-injection suite: one rank of three is killed, raises or hangs at each point of a step; every survivor
must raise the named error (or, blocked inside a collective, print it and exit with PEER_LOST_EXIT_CODE) within the
documented bound, and nothing hangs (the pool's timeout would name a hang). See tests/fault_cells.py."""

from __future__ import annotations

import re

import pytest

from fault_cells import ACTIONS, GROUP_TIMEOUT_S, POINTS, VICTIM, WATCH, fault_cell_body
from mesh3d import PEER_LOST_EXIT_CODE
from rankpool.pool import RankFailure

#: The documented bounds (docs/troubleshooting.md): a loss is named within suspect_after + grace + two beats after
#: the fault; a hang within the group timeout plus two beats. Generous slack for two busy cores.
LOSS_BOUND_S = WATCH["suspect_after"] + WATCH["grace"] + 2 * WATCH["interval"] + 6.0
HANG_BOUND_S = GROUP_TIMEOUT_S + 2 * WATCH["interval"] + 6.0


def _sections(text: str) -> dict[int, str]:
    marks = [(m.start(), int(m.group(1))) for m in re.finditer(r"--- rank (\d+)", text)]
    return {rank: text[start:(marks[i + 1][0] if i + 1 < len(marks) else len(text))] for i, (start, rank) in enumerate(marks)}


def run_cell(ranks, tmp_path, point: str, action: str, tag: str) -> dict[int, dict]:
    """Every survivor's outcome: ``{"error", "message", "seconds"}``, or ``{"exit": 76, "message": log}``."""
    try:
        replies = ranks.run(3, fault_cell_body, point, action, str(tmp_path), tag, timeout=GROUP_TIMEOUT_S * 4 + 30)
        return {r["rank"]: r for r in replies if r["rank"] != VICTIM}
    except RankFailure as failure:
        sections = _sections(str(failure))
        outcomes = {r: v for r, v in failure.results.items() if r != VICTIM}
        for rank in set(range(3)) - {VICTIM} - set(outcomes):
            outcomes[rank] = {"error": "exit", "message": sections.get(rank, "")}
        return outcomes


#: Errors that name a lost or failed peer. A victim that raises inside a domain op is reported by the domain's own
#: notice (DomainDivergenceError: "domain rank 1 failed in a domain op"), and inside a checkpoint phase by the
#: checkpointer's agreement (CheckpointError: "rank 1: InjectedFault ..."): both reach every rank at once.
NAMED = {"kill": ("PeerLostError", "DomainPeerLostError"),
         "raise": ("PeerLostError", "DomainPeerLostError", "DomainDivergenceError", "CheckpointError"),
         "hang": ("CollectiveTimeoutError", "PeerLostError")}


def check_outcome(rank: int, out: dict, action: str) -> None:
    """A survivor's outcome names the victim, within the bound."""
    text = out["message"]
    if out["error"] == "exit":  # blocked in a collective: the watch printed the error and ended the process
        assert f"exit status {PEER_LOST_EXIT_CODE}" in text and "PeerLostError" in text, (rank, text)
    else:
        assert out["error"] in NAMED[action], (rank, out)
        assert out["seconds"] < (HANG_BOUND_S if action == "hang" else LOSS_BOUND_S), (rank, out)
    assert re.search(rf"\brank {VICTIM}\b", text), (rank, text)
    if out["error"] in ("PeerLostError", "CollectiveTimeoutError", "exit"):
        assert f"rank {VICTIM} (batch 0, domain {VICTIM}, model 0)" in text, (rank, text)
    if action == "raise":
        assert "injected fault" in text, (rank, text)
    if action == "hang" and out["error"] == "CollectiveTimeoutError":
        assert "fault_cells.py" in text.split(f"rank {VICTIM} (batch 0, domain {VICTIM}, model 0): ")[-1], (rank, text)


@pytest.mark.parametrize("action", ACTIONS)
@pytest.mark.parametrize("point", POINTS)
def test_every_survivor_names_the_fault(ranks, tmp_path, point, action):
    outcomes = run_cell(ranks, tmp_path, point, action, f"{point}-{action}")
    assert sorted(outcomes) == [0, 2]
    for rank, out in outcomes.items():
        check_outcome(rank, out, action)
