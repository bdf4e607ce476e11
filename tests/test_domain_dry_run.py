"""``exchange.dry_run``: exchanges report what they would send and count it, with no process group at all."""

from __future__ import annotations

import torch

from mesh3d.domain.core.group import DomainComm
from mesh3d.domain.comm.exchange import count_traffic, dry_run, exchange_all, gather_rows
from mesh3d.domain.comm.rows import Span, plan_exchange


def test_a_dry_run_reports_peers_and_counts_bytes_without_a_process_group():
    sizes = (4, 3, 5)  # this is rank 1: it needs one row from each neighbour (a 3-row window)
    needs = tuple((Span.rows(max(o - 1, 0), min(o + s + 1, 12)),) for o, s in zip((0, 4, 7), sizes))
    seen = []
    local = torch.arange(3 * 2, dtype=torch.float64).view(3, 2)
    with dry_run(lambda comm, out, inc: seen.append(([p for p, _ in out], [(p, b.shape[0]) for p, b in inc]))):
        with count_traffic() as traffic:
            ext = gather_rows(local, 0, plan_exchange(sizes, needs, 1), DomainComm(None, (0, 1, 2), 1))
    assert seen == [([0, 2], [(0, 1), (2, 1)])]
    assert ext.shape == (5, 2) and torch.equal(ext[1:4], local)  # own rows in place; received rows left as allocated
    assert (traffic.bytes_sent, traffic.messages, traffic.rounds) == (2 * 2 * 8, 2, 1)


def test_a_dry_run_counts_meta_tensors_and_reductions_like_a_real_exchange():
    with dry_run(lambda *_: None), count_traffic() as traffic:
        parts = exchange_all(torch.empty(3, device="meta"), DomainComm(None, (0, 1, 2, 3), 2))
    assert len(parts) == 4 and all(p.is_meta for p in parts)
    assert (traffic.bytes_sent, traffic.messages) == (3 * 4 * 3, 3)


def test_nothing_to_send_or_receive_is_not_a_round():
    with dry_run(lambda *_: None), count_traffic() as traffic:
        gather_rows(torch.ones(2, 1), 0, plan_exchange((2, 2), ((Span.rows(0, 2),), (Span.rows(2, 4),)), 0),
                    DomainComm(None, (0, 1), 0))
    assert (traffic.bytes_sent, traffic.rounds) == (0, 0)
