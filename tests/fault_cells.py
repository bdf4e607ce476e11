"""The fault-injection cells shared by tests/faults/ and scripts/bench_faults.py: one rank is killed, raises or
hangs at one point of a training step (forward, backward, a halo exchange, an FSDP all-gather, a TP all-reduce, the data
loader, a checkpoint save or load); every other rank reports what it raised and how long after the fault it learnt
of it.

The step: three ranks (batch 1, domain 3), a conv stack with FSDP over batch x domain and its input sharded in
slabs, inside ``dm.guard`` (the tp cell: model 3, a colwise/rowwise MLP). The fault time is read from the job's
store (the victim writes it just before the fault), so each survivor's latency is measured on one clock, the host's.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from torch.utils.data import TensorDataset

from mesh3d import PEER_LOST_EXIT_CODE, DistributedManager, Plan, WatchSettings, checkpoint, domain, parallelize
from mesh3d.data import MeshDataLoader, MeshSampler
from mesh3d._torch_private import default_store
from mesh3d.domain.comm import exchange
from rankpool.pool import RankFailure

POINTS = ("forward", "backward", "halo", "fsdp", "tp", "data", "save", "load")
ACTIONS = ("kill", "raise", "hang")
#: A hang in native code that holds the GIL (a stuck C extension): the victim's own watch thread stops beating too.
FREEZE = "freeze"
#: Short settings so a cell ends in seconds: the group timeout bounds a hang, the watch a loss.
GROUP_TIMEOUT_S = 6.0
WATCH = {"interval": 0.25, "suspect_after": 1.0, "dead_after": 4.0, "grace": 2.0}
VICTIM = 1
SLABS = (4, 4, 4)  # rows of the 12-row field on each domain rank


#: What FSDP2 calls to all-gather a unit's parameters (torch 2.13: ``all_gather_single``; before: into_tensor).
FSDP_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


class InjectedFault(RuntimeError):
    """What a ``raise`` cell's victim raises."""


#: The longest a victim hangs or freezes when the survivors do not report first. NOTE: the survivors' group timeout
#: starts when each enters its collective, which under load can be seconds after the victim faulted (an async save's
#: survivors finish their own shards first). The async-hang cell's survivors that once waited out the whole hang (12,
#: 18 s) were not load: their background commit ran over a checkpoint group kept from an earlier test's manager, with
#: that manager's timeout (fixed in mesh3d/checkpoint/inflight.py; test_checkpoint_async.py asserts it). The margin
#: stays: it costs nothing when the cell passes, since the survivors' reports end the hang.
HANG_MOST_S = 5 * GROUP_TIMEOUT_S


def _fault(action: str, key: str) -> None:
    default_store().set(key, repr(time.time()))
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "raise":
        raise InjectedFault("injected fault")
    if action == "freeze":
        _freeze_holding_the_gil(key, HANG_MOST_S)
        raise InjectedFault("woke up after the freeze")
    # A hang that outlasts the survivors' group timeout; it ends once every survivor has reported its outcome (they
    # count themselves under the key: outcome()), so the cell takes the survivors' time, not the hang's longest.
    deadline = time.monotonic() + HANG_MOST_S
    while time.monotonic() < deadline and default_store().add(f"{key}/reported", 0) < dist.get_world_size() - 1:
        time.sleep(0.2)
    raise InjectedFault("woke up after the hang")


class _PollFd(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


def _freeze_holding_the_gil(key: str, most: float) -> None:
    """Block in native code with the GIL held until the last survivor has reported (it writes a byte to a FIFO whose
    path is in the store under ``key/wake``: ``outcome``), or ``most`` seconds.

    NOTE: libc's poll through PyDLL keeps the GIL: no Python thread of this process runs, its watch's neither. Woken
    by the survivors rather than after a fixed sleep, a cell takes their time, not the freeze's longest."""
    folder = tempfile.mkdtemp(prefix="mesh3d-freeze-")
    path = os.path.join(folder, "wake")
    os.mkfifo(path)
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)  # read and write: never a FIFO without a writer (no POLLHUP)
    try:
        default_store().set(f"{key}/wake", path)
        ctypes.PyDLL(None).poll(ctypes.byref(_PollFd(fd, 1, 0)), 1, int(most * 1000))  # events: POLLIN
    finally:
        os.close(fd)
        shutil.rmtree(folder, ignore_errors=True)


def _wake_a_frozen_victim(key: str) -> None:
    """What the last survivor to report does: write to the FIFO a frozen victim polls (``_freeze_holding_the_gil``)."""
    if not default_store().check([f"{key}/wake"]):
        return
    try:
        fd = os.open(default_store().get(f"{key}/wake").decode(), os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return  # the victim is no longer polling: its bound passed
    try:
        os.write(fd, b"x")
    finally:
        os.close(fd)


class _GradTap(torch.autograd.Function):
    """Identity whose backward calls ``at_backward`` (a fault in the middle of the backward pass)."""

    @staticmethod
    def forward(ctx, x, at_backward):
        ctx.at_backward = at_backward
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.at_backward()
        return grad, None


class _Tap(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.at_forward: Callable[[], None] | None = None
        self.at_backward: Callable[[], None] | None = None

    def forward(self, x):
        if self.at_forward is not None:
            self.at_forward()
        if self.at_backward is not None:
            local = _GradTap.apply(x.to_local(), self.at_backward)
            return domain.from_local(local, dim=2, sizes=SLABS)
        return x


def _once(fn: Callable[[], None], after: int = 0) -> Callable[..., None]:
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == after + 1:
            fn()
    return wrapped


def victim_name(point: str) -> str:
    """How every error names the victim: its global rank and mesh coordinates (the tp cell's mesh is (1, 1, 3))."""
    return f"rank {VICTIM} (batch 0, domain 0, model {VICTIM})" if point == "tp" else \
        f"rank {VICTIM} (batch 0, domain {VICTIM}, model 0)"


def _tp_or_data_step(dm, point: str, victim: bool, fault: Callable[[], None]) -> None:
    """The tp cell (a colwise/rowwise MLP on the model axis; the victim faults before the rowwise all-reduce) and the
    data cell (a MeshDataLoader, a short wait per batch, then the stop agreement; the victim faults at its 2nd batch)."""
    if point == "tp":
        net = parallelize(nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 6)),
                          Plan(batch=None, model={"0": "colwise", "2": "rowwise"}))
        if victim:
            net[2].register_forward_pre_hook(lambda *_: fault())
        for _ in range(2):
            net(torch.randn(2, 6)).square().sum().backward()
        return
    loader = MeshDataLoader(TensorDataset(torch.arange(8.0)), MeshSampler(8, global_batch_size=1))
    for i, _ in enumerate(loader):
        if victim and i == 1:
            fault()
        time.sleep(0.2)
    dm.should_stop()


def fault_cell_body(point: str, action: str, root: str, tag: str) -> dict:
    """One cell on one rank; returns what this rank raised and the seconds from the fault to it."""
    sizes = {"batch": 1, "domain": 1, "model": -1} if point == "tp" else {"batch": 1, "domain": -1}
    dm = DistributedManager.initialize(**sizes, timeout=GROUP_TIMEOUT_S, watch=WatchSettings(**WATCH))
    key = f"fault_cells/{tag}"
    torch.manual_seed(0)
    tap = _Tap()
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1), tap, nn.Conv2d(4, 1, 3, padding=1))
    net = parallelize(net, Plan(batch="fsdp", units=["0", "1", "3"])) if point != "tp" else net
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    xs = domain.shard(torch.randn(1, 1, sum(SLABS), 6), dim=2, sizes=SLABS) if point != "tp" else None
    ckpt = os.path.join(root, f"{tag}-ckpt")
    victim = dm.rank == VICTIM
    fault = _once(lambda: _fault(action, key))
    restore = []
    if victim and point == "forward":
        tap.at_forward = fault
    if victim and point == "backward":
        tap.at_backward = fault
    if victim and point == "halo":
        real = exchange.start_exchange
        exchange.start_exchange = lambda *a, **k: (fault(), real(*a, **k))[1]
        restore.append(lambda: setattr(exchange, "start_exchange", real))
    if victim and point == "fsdp":
        name = FSDP_ALL_GATHER
        real_ag = getattr(dist, name)
        on_second = _once(lambda: _fault(action, key), after=1)  # the second unit's all-gather: mid-forward
        setattr(dist, name, lambda *a, **k: (on_second(), real_ag(*a, **k))[1])
        restore.append(lambda: setattr(dist, name, real_ag))
    if point == "load":
        checkpoint.save(ckpt, net, opt, step=0)
    started = time.time()
    try:
        with dm.guard(f"cell {point}/{action}"):
            if point == "save":
                checkpoint.save(ckpt, net, opt, step=1,
                                stage_hook=(lambda s: fault() if s == "mid_shard" else None) if victim else None)
            elif point == "load":
                if victim:
                    fault()
                checkpoint.load(ckpt, net, opt)
            elif point in ("tp", "data"):
                _tp_or_data_step(dm, point, victim, fault)
            else:
                train_steps(net, opt, xs)
        return outcome(dm.rank, key, started, None)
    except Exception as err:  # the cell's outcome, reported to the test
        return outcome(dm.rank, key, started, err)
    finally:
        for undo in restore:
            undo()


def train_steps(net: nn.Module, opt: torch.optim.Optimizer, xs: torch.Tensor, steps: int = 2) -> None:
    """The cells' step: ``steps`` forward, backward and optimizer steps of ``net`` on ``xs``."""
    for _ in range(steps):
        net(xs).square().sum().backward()
        opt.step()
        opt.zero_grad()


def outcome(rank: int, key: str, started: float, err: Exception | None) -> dict:
    """What a rank reports from a cell: its error (None: none) and the seconds from the fault (the victim wrote its
    time under ``key`` in the store) to it."""
    # a hanging victim stops hanging once every survivor has (_fault); a frozen one is woken by the last
    if default_store().add(f"{key}/reported", 1) >= dist.get_world_size() - 1:
        _wake_a_frozen_victim(key)
    if err is None:
        return {"rank": rank, "error": None, "message": "", "seconds": time.time() - started}
    faulted = float(default_store().get(key)) if default_store().check([key]) else started
    return {"rank": rank, "error": type(err).__name__, "message": str(err), "seconds": round(time.time() - faulted, 3)}


#: The documented bounds (docs/troubleshooting.md): a loss is named within suspect_after + grace + two beats after
#: the fault; a hang within the group timeout plus two beats. Generous slack for two busy cores.
LOSS_BOUND_S = WATCH["suspect_after"] + WATCH["grace"] + 2 * WATCH["interval"] + 6.0
HANG_BOUND_S = GROUP_TIMEOUT_S + 2 * WATCH["interval"] + 6.0


def _sections(text: str) -> dict[int, str]:
    marks = [(m.start(), int(m.group(1))) for m in re.finditer(r"--- rank (\d+)", text)]
    return {rank: text[start:(marks[i + 1][0] if i + 1 < len(marks) else len(text))] for i, (start, rank) in enumerate(marks)}


def run_cell(run: Callable[..., list], root: str, point: str, action: str, tag: str, body: Callable[..., dict] | None = None,
             world: int = 3, victim: int = VICTIM) -> dict[int, dict]:
    """Every survivor's outcome: ``{"error", "message", "seconds"}``, or ``{"error": "exit", "message": its log}``.

    ``run(fn, *args, timeout=)`` runs ``fn`` on ``world`` ranks (a ``RankPool``'s ``run``); ``body`` is the cell
    (default ``fault_cell_body``; tests/fault_families.py has its own), ``victim`` the rank that faults."""
    try:
        replies = run(body or fault_cell_body, point, action, root, tag, timeout=GROUP_TIMEOUT_S * 4 + 30)
        return {r["rank"]: r for r in replies if r["rank"] != victim}
    except RankFailure as failure:
        sections = _sections(str(failure))
        outcomes = {r: v for r, v in failure.results.items() if r != victim}
        for rank in set(range(world)) - {victim} - set(outcomes):
            outcomes[rank] = {"error": "exit", "message": sections.get(rank, ""), "seconds": None}
        return outcomes


#: Errors that name a lost or failed peer. A victim that raises inside a domain op is reported by the domain's own
#: notice (DomainDivergenceError: "domain rank 1 failed in a domain op"), and inside a checkpoint phase by the
#: checkpointer's agreement (CheckpointError: "rank 1: InjectedFault ..."): both reach every rank at once.
NAMED = {"kill": ("PeerLostError", "DomainPeerLostError"),
         "raise": ("PeerLostError", "DomainPeerLostError", "DomainDivergenceError", "CheckpointError"),
         "hang": ("CollectiveTimeoutError", "PeerLostError"),
         FREEZE: ("CollectiveTimeoutError", "PeerLostError")}


def bound_s(action: str) -> float:
    """The documented bound on a survivor's time to its error (checked by scripts/bench_faults.py, never by a test)."""
    return HANG_BOUND_S if action in ("hang", FREEZE) else LOSS_BOUND_S


def check_outcome(rank: int, out: dict, action: str, point: str = "forward", victim: int = VICTIM,
                  name: str | None = None) -> None:
    """A survivor's outcome names the victim (``victim``, described as ``name``: default ``victim_name(point)``)."""
    text, name = out["message"], name or victim_name(point)
    if out["error"] == "exit":  # blocked in a collective: the watch printed the error and ended the process
        assert f"exit status {PEER_LOST_EXIT_CODE}" in text and "PeerLostError" in text, (rank, text)
    else:
        assert out["error"] in NAMED[action], (rank, out)
    assert re.search(rf"\brank {victim}\b", text), (rank, text)
    if out["error"] in ("PeerLostError", "CollectiveTimeoutError", "exit"):
        assert name in text, (rank, text)
    if action == "raise":
        assert "injected fault" in text, (rank, text)
    if action == "hang" and out["error"] == "CollectiveTimeoutError":
        assert "fault_" in text.split(f"{name}: ")[-1], (rank, text)  # where the victim hangs: the cell's module


class BranchesOnLocalShape(nn.Module):
    """Pads its activation when the *local* height (``local_shape``, this rank's shard) is odd: ranks take different
    paths. ``loss_after_exchange=False``: no exchange after the branch, so the divergence is found in backward."""

    def __init__(self, loss_after_exchange: bool = True) -> None:
        super().__init__()
        self.a = nn.Conv2d(1, 2, 3, padding=1, dtype=torch.float64)
        self.b = nn.Conv2d(2, 1, 3, padding=1, dtype=torch.float64)
        self.loss_after_exchange = loss_after_exchange

    def forward(self, x):
        y = self.a(x)
        if y.local_shape[2] % 2:
            y = torch.nn.functional.pad(y, (0, 0, 0, 1))  # the line each rank's message must name
        if self.loss_after_exchange:
            return self.b(y).mean()
        return (y.to_local() ** 2).sum()


def diverging_body(sizes: tuple[int, ...], in_forward: bool) -> None:
    """Two steps of a model that branches on the local shape; raises (DomainDivergenceError, as every rank must: a
    rank that did not border the divergence learns it from its neighbour's notice at its next exchange)."""
    DistributedManager.initialize(batch=1, domain=-1)
    torch.manual_seed(0)
    model = BranchesOnLocalShape(in_forward)
    for _ in range(2):
        x = torch.randn(1, 1, sum(sizes), 6, dtype=torch.float64, requires_grad=True)
        model(domain.shard(x, dim=2, sizes=sizes)).backward()


def divergence_runs(run: Callable[..., list], runs: int, sizes: tuple[int, ...] = (5, 4, 4)) -> list[list[tuple[str, str]]]:
    """``runs`` diverging runs (forward and backward alternately) on three ranks: per run, what each rank raised."""
    outcomes = []
    for i in range(runs):
        try:
            run(diverging_body, sizes, i % 2 == 0, timeout=120)
            outcomes.append([("none", "")] * 3)
        except RankFailure as failure:
            sections = _sections(str(failure))
            per_rank = []
            for rank in range(3):
                text = sections.get(rank, "")
                found = re.findall(r"^(?:\w+\.)*(\w+(?:Error|Exception)): ", text, flags=re.MULTILINE)
                per_rank.append((found[-1] if found else "none", text))
            outcomes.append(per_rank)
    return outcomes
