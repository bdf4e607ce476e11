"""Small data rides in its exchange's header (``comm.divergence.inlined``): one round where there were two.

A domain reduction's partial sums, a norm's statistics and a small halo used to take a header round, then a data
round; data of at most ``INLINE_BYTES`` on the CPU now travel inside the header. Checked on real gloo ranks: every
rank receives each peer's values bitwise (the values are rebuilt here from the rank index, not by the code under
test), for every dtype a step sends, into buffers of any layout; data of one byte over the limit still takes its
own round; and ranks whose sizes disagree still raise on every side, with no rank left waiting.
"""

from __future__ import annotations

import pytest
import torch

from rankpool.pool import RankFailure

#: (dtype, element count): at the limit (4096 bytes) and one element over it, an empty-shaped 0-d, odd dtypes
CASES = [(torch.float32, 1), (torch.float64, 512), (torch.float32, 1025), (torch.complex64, 7), (torch.bool, 33),
         (torch.bfloat16, 2048), (torch.int64, 513), (torch.complex128, 3)]


def _value(rank: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    """What rank ``rank`` sends: distinct per rank and element, exact in every dtype."""
    base = torch.arange(n, dtype=torch.float64) * 3 + rank * 1000 + 0.5
    if dtype is torch.bool:
        return (torch.arange(n) + rank) % 3 == 0
    if dtype.is_complex:
        return torch.complex(base, -base).to(dtype)
    if dtype is torch.int64:
        return base.to(torch.int64) * (rank + 1)
    return base.remainder(250).to(dtype)  # NOTE: bf16 holds these halves exactly


def _rounds_body() -> list:
    from mesh3d import DistributedManager
    from mesh3d.domain.comm import divergence, exchange
    from mesh3d.domain.core.group import domain_groups

    DistributedManager.initialize(batch=1, domain=-1)
    comm = domain_groups()[0]
    posted: list[list[int]] = []
    real_post = exchange.post

    def counting_post(c, outgoing, incoming):
        posted.append([b.numel() * b.element_size() for _, b in [*outgoing, *incoming]])
        return real_post(c, outgoing, incoming)

    exchange.post = counting_post  # NOTE: the one binding start_exchange calls (restored below; ranks are reused)
    results = []
    try:
        for dtype, n in CASES:
            posted.clear()
            mine = _value(comm.index, dtype, n)
            if n == 1:
                mine = mine.reshape(())  # a 0-d partial sum, as a reduction's
            parts = exchange.exchange_all(mine, comm)
            exact = all(torch.equal(p, _value(q, dtype, n).reshape(mine.shape)) for q, p in enumerate(parts))
            results.append((str(dtype), n, exact, len(posted), posted[0]))
        # NOTE: a receive buffer of another layout (a transposed view) is filled through its own strides
        q = (comm.index + 1) % comm.size
        frm = (comm.index - 1) % comm.size
        target = torch.zeros(3, 4, dtype=torch.float64).t()
        exchange.run_exchange(comm, [(q, _value(comm.index, torch.float64, 12).view(4, 3))], [(frm, target)],
                              exchange.exchange_point(comm))
        results.append(("transposed", 12, torch.equal(target, _value(frm, torch.float64, 12).view(4, 3)), len(posted) - 1,
                        divergence.HEADER_WORDS * 8))
    finally:
        exchange.post = real_post
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_small_data_rides_in_its_header_and_arrives_bitwise(ranks, world):
    from mesh3d.domain.comm.divergence import HEADER_WORDS, INLINE_BYTES

    header = HEADER_WORDS * 8
    for rank, results in enumerate(ranks.run(world, _rounds_body, timeout=60)):
        for dtype, n, exact, rounds, first in results:
            assert exact, (rank, dtype, n)
            if dtype == "transposed":
                assert rounds == 1, (rank, rounds)
                continue
            nbytes = n * torch.empty((), dtype=getattr(torch, dtype.split(".")[1])).element_size()
            # one round of headers only, to and from each peer; over the limit, a second round of the data
            assert first == [header] * (2 * (world - 1)), (rank, dtype, n, first)
            assert rounds == (1 if nbytes <= INLINE_BYTES else 2), (rank, dtype, n, nbytes, rounds)


def _disagreeing_body() -> None:
    from mesh3d import DistributedManager
    from mesh3d.domain.comm.exchange import exchange_all
    from mesh3d.domain.core.group import domain_groups

    DistributedManager.initialize(batch=1, domain=-1)
    comm = domain_groups()[0]
    exchange_all(torch.ones(3 + 2 * comm.index), comm)  # NOTE: rank 1 sends 20 bytes where rank 0 sends 12


def test_ranks_whose_small_data_disagree_in_size_raise_on_every_side(ranks):
    with pytest.raises(RankFailure) as failure:  # a hang would be a RankTimeout instead
        ranks.run(2, _disagreeing_body, timeout=30)
    text = str(failure.value)
    for rank in (0, 1):
        part = text[text.find(f"--- rank {rank} ---"):]
        assert "DomainDivergenceError" in part, text
    assert "would send 20 bytes where 12 are expected" in text and "would send 12 bytes where 20" in text, text


def _norm_rounds_body(sizes: tuple[int, ...]) -> tuple[int, float, float]:
    import torch.nn.functional as F

    from mesh3d import DistributedManager, domain
    from mesh3d.domain.comm import exchange

    DistributedManager.initialize(batch=1, domain=-1)
    g = torch.Generator().manual_seed(0)
    # NOTE: a mean far from zero: statistics merged as E[x^2] - E[x]^2 would lose digits here
    x = torch.randn(2, 4, sum(sizes), 5, generator=g, dtype=torch.float64) * 3 + 1e4
    w, b = torch.randn(4, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64)
    xs = domain.shard(x, dim=2, sizes=sizes)
    posted: list[int] = []
    real_post = exchange.post

    def counting_post(c, outgoing, incoming):
        posted.append(len(outgoing))
        return real_post(c, outgoing, incoming)

    exchange.post = counting_post
    try:
        with torch.no_grad():
            y = F.group_norm(xs, 2, w, b)
    finally:
        exchange.post = real_post
    yb = F.batch_norm(xs, None, None, w, b, training=True)
    err = lambda a, ref: ((a.full_tensor().to_local() - ref).abs().max() / ref.abs().max()).item()  # noqa: E731
    return len(posted), err(y, F.group_norm(x, 2, w, b)), err(yb, F.batch_norm(x, None, None, w, b, training=True))


@pytest.mark.parametrize("sizes", [(4, 3), (4, 0, 3)], ids=["2 ranks", "3 ranks, one empty"])
def test_a_norm_combines_its_statistics_in_one_round(ranks, sizes):
    """A norm's count, mean and spread per rank travel in one exchange (one header round, the data inside), merged
    as Chan et al.'s parallel variance; it took two (the mean, then the squared deviations from it)."""
    for rounds, group_err, batch_err in ranks.run(len(sizes), _norm_rounds_body, sizes, timeout=60):
        assert rounds == 1, rounds
        assert group_err < 1e-10 and batch_err < 1e-10, (group_err, batch_err)


def _variance_body(sizes: tuple[int, ...]) -> tuple[int, int, float, float]:
    from mesh3d import DistributedManager, domain
    from mesh3d.domain.comm import exchange

    DistributedManager.initialize(batch=1, domain=-1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, sum(sizes), 4, generator=g, dtype=torch.float64) * 2 + 1e4
    posted = {"forward": 0, "backward": 0}
    phase = ["forward"]
    real_post = exchange.post

    def counting_post(c, outgoing, incoming):
        posted[phase[0]] += 1
        return real_post(c, outgoing, incoming)

    xs = domain.shard(x, dim=2, sizes=sizes).requires_grad_()
    exchange.post = counting_post
    try:
        v = xs.var((2, 3))
        phase[0] = "backward"
        v.sum().backward()
    finally:
        exchange.post = real_post
    ref = x.clone().requires_grad_()
    ref.var((2, 3)).sum().backward()
    grad = xs.grad.full_tensor().to_local()
    # NOTE: a second derivative through the variance (create_graph): its mean's own gradient is in the graph
    xs2 = domain.shard(x, dim=2, sizes=sizes).requires_grad_()
    (gx,) = torch.autograd.grad(xs2.std((2, 3)).sum(), xs2, create_graph=True)
    (gx * gx.detach().sin()).sum().backward()
    ref2 = x.clone().requires_grad_()
    (gr,) = torch.autograd.grad(ref2.std((2, 3)).sum(), ref2, create_graph=True)
    (gr * gr.detach().sin()).sum().backward()
    second = ((xs2.grad.full_tensor().to_local() - ref2.grad).abs().max() / ref2.grad.abs().max()).item()
    value = max(((v.to_local() - ref.var((2, 3))).abs().max() / ref.var((2, 3)).abs().max()).item(),
                ((grad - ref.grad).abs().max() / ref.grad.abs().max()).item())
    return posted["forward"], posted["backward"], value, second


@pytest.mark.parametrize("sizes", [(4, 3), (4, 0, 3)], ids=["2 ranks", "3 ranks, one empty"])
def test_a_variance_over_the_sharded_dim_takes_one_round_and_none_back(ranks, sizes):
    """``var`` over dims that include the sharded one: the ranks' moments in one exchange (it took two, the mean and
    then the deviations); its gradient is each rank's own rows of the one-process formula, with no exchange; second
    derivatives (a std's, through create_graph) equal one process."""
    for forward, backward, value_err, second_err in ranks.run(len(sizes), _variance_body, sizes, timeout=60):
        assert (forward, backward) == (1, 0), (forward, backward)
        assert value_err < 1e-10 and second_err < 1e-9, (value_err, second_err)


def _softmax_body(sizes: tuple[int, ...]) -> tuple[int, float, float]:
    from mesh3d import DistributedManager, domain
    from mesh3d.domain.comm import exchange

    DistributedManager.initialize(batch=1, domain=-1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, sum(sizes), 4, generator=g, dtype=torch.float64) * 30
    x[:, 0, :sizes[0], 1] = -torch.inf  # NOTE: rank 0's part of a column all -inf (a mask): its terms are 0, not nan
    w = torch.randn(x.shape, generator=g, dtype=torch.float64)
    posted: list[int] = []
    real_post = exchange.post

    def counting_post(c, outgoing, incoming):
        posted.append(1)
        return real_post(c, outgoing, incoming)

    def both(t: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return (torch.softmax(t, 2) * weights).sum() + (torch.nn.functional.log_softmax(t, 2) * weights).sum()

    xs = domain.shard(x, dim=2, sizes=sizes).requires_grad_()
    ws = domain.shard(w, dim=2, sizes=sizes)
    exchange.post = counting_post
    try:
        with torch.no_grad():
            torch.softmax(xs, 2)
    finally:
        exchange.post = real_post
    # value, gradient, and a second derivative (create_graph) of softmax and log_softmax together
    (gx,) = torch.autograd.grad(both(xs, ws), xs, create_graph=True)
    (gx * ws).sum().backward()
    ref = x.clone().requires_grad_()
    (gr,) = torch.autograd.grad(both(ref, w), ref, create_graph=True)
    (gr * w).sum().backward()
    ys, yr = torch.softmax(xs, 2).full_tensor().to_local(), torch.softmax(x, 2)
    value = max((ys - yr).abs().max().item(), (gx.full_tensor().to_local() - gr).abs().max().item() / gr.abs().max().item())
    second = ((xs.grad.full_tensor().to_local() - ref.grad).abs().max() / ref.grad.abs().max()).item()
    return len(posted), value, second


@pytest.mark.parametrize("sizes", [(4, 3), (4, 0, 3)], ids=["2 ranks", "3 ranks, one empty"])
def test_a_softmax_over_the_sharded_dim_takes_one_round(ranks, sizes):
    """softmax and log_softmax over the sharded dim: each rank's maximum and shifted sum in one exchange (a global
    maximum, then a global sum, took two); a column masked to -inf on one rank; values, gradients and second
    derivatives equal one process."""
    for rounds, value_err, second_err in ranks.run(len(sizes), _softmax_body, sizes, timeout=60):
        assert value_err < 1e-12 and second_err < 1e-10, (value_err, second_err)
        assert rounds == 1, rounds
