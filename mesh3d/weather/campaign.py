"""``forecast_ensemble``: an ensemble forecast campaign on the mesh, each rank writing its block of one zarr store.

The samples are (init time, member) pairs, ``sample = init * members + member``; each batch rank takes a contiguous
share of them and runs them ``batch_size`` at a time, its domain ranks each holding a (lat, lon) block of every
state (read from the dataset by that rank alone), its model ranks splitting the weights (one of them writes). Each
lead is written as it comes, block by block (nothing is gathered); after a lead the writers of a batch rank meet in a
barrier and one of them records it. A run started again on the same store (any mesh) continues from the last lead
recorded: from the saved state where one is kept (``restart_every``), else by recomputing without writing.

Usage::

    result = forecast_ensemble(model, "era5.zarr", {"z": [500], "t2m": None}, "fc.zarr", init_times=[40, 44],
                               leads=10, lead=np.timedelta64(6, "h"), stats=stats, members=8, seed=0, perturbation=0.05)
    result.written, result.skipped          # blocks this rank wrote, sample-leads it found written already
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from itertools import groupby
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from mesh3d.host_memory import return_freed_memory
from mesh3d.manager import DistributedManager
from mesh3d.weather.agreement import agreed
from mesh3d.weather.ensemble import MemberKey, MemberNoise, Perturbation, perturb_initial
from mesh3d.weather.inputs import ForecastInputs, variable_pairs
from mesh3d.weather.layout import FieldBlocks, block_of, default_tile
from mesh3d.weather.store import MOVABLE, ForecastStore, StoreSpec, create_store, hours, read_spec

__all__ = ["ForecastProgress", "ForecastResult", "forecast_ensemble"]


@dataclass
class ForecastResult:
    """What one rank did: blocks written, sample-leads found already written, steps recomputed without writing.

    Usage: ``r = forecast_ensemble(...); print(r.written, r.skipped, r.bytes_written / r.write_seconds)``
    """

    path: str
    samples: list[int]
    written: int = 0
    skipped: int = 0
    recomputed: int = 0
    state_writes: int = 0
    bytes_written: int = 0
    write_seconds: float = 0.0
    seconds: float = 0.0


@dataclass(frozen=True)
class ForecastProgress:
    """One lead of one batch of samples done (what the progress callback receives, on every rank).

    Usage: ``forecast_ensemble(..., progress=lambda p: print(p.line()) if p.lead == p.leads else None)``
    """

    lead: int
    leads: int
    lead_time: np.timedelta64
    batch: int
    batches: int
    samples: tuple[int, ...]
    seconds: float

    def line(self) -> str:
        return (f"forecast: batch {self.batch + 1}/{self.batches} (samples {self.samples[0]}-{self.samples[-1]}), lead "
                f"{self.lead}/{self.leads} (+{hours(self.lead_time)}): {self.seconds:.1f} s")


def _print_rank0(p: ForecastProgress) -> None:
    if not DistributedManager.is_initialized() or DistributedManager().rank == 0:
        print(p.line(), flush=True)


def _share(n: int, parts: int, index: int) -> list[int]:
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return list(range(start, start + base + (index < extra)))


def _numpy_name(dtype: torch.dtype) -> str:
    """A torch float dtype's numpy name (bfloat16, which numpy lacks, is kept as float32: exact)."""
    return "float32" if dtype == torch.bfloat16 else str(dtype).removeprefix("torch.")


def _runs(samples: list[int], chosen: Any, joins: Callable[[int, int], bool]) -> list[list[int]]:
    """Positions in ``samples`` of the ``chosen`` ones, in runs of neighbours that ``joins(previous, next)`` links."""
    runs: list[list[int]] = []
    for j, s in enumerate(samples):
        if s not in chosen:
            continue
        if runs and runs[-1][-1] == j - 1 and joins(samples[j - 1], s):
            runs[-1].append(j)
        else:
            runs.append([j])
    return runs


def _model_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        return p.dtype
    return torch.get_default_dtype()


def forecast_ensemble(model: nn.Module | Callable[..., torch.Tensor], source: Any,
                      variables: Sequence[str] | Mapping[str, Sequence[Any] | None], out: str, *,
                      init_times: Sequence[Any], leads: int, lead: Any = 1, stats: Any = None, members: int = 1,
                      seed: int = 0, member_range: tuple[int, int] | None = None,
                      perturbation: Perturbation = None, model_noise: bool = False, batch_size: int = 1,
                      tile: tuple[int, int] | None = None, store_dtype: Any = None, compress: bool = True,
                      restart_every: int = 1, release_memory: bool = True, convention: str = "cf",
                      progress: bool | Callable[[ForecastProgress], None] | None = True,
                      names: Mapping[str, str] | None = None, run: Mapping[str, Any] | None = None) -> ForecastResult:
    """Forecast ``leads`` steps of ``members`` members from each init time into the zarr store ``out``; every rank calls it.

    Usage: ``forecast_ensemble(model, "era5.zarr", vars, "fc.zarr", init_times=[40], leads=10, members=8, stats=s)``

    Args:
        model: maps a normalized ``(B, C, H, W)`` state (plain, or a DomainTensor of this rank's block) to the next one,
            in the same layout; with ``model_noise``, called as ``model(x, noise)`` (a :class:`MemberNoise`).
        source, variables, lead, stats, names: the dataset of initial conditions (as ``WeatherDataset``: a path or
            an ``xarray.Dataset``, channels, the model's step, its normalization, dim names if not detected).
        init_times: datetimes, or indices into the dataset's times.
        members, seed, perturbation: the ensemble: member ``m`` of init ``t`` draws from ``MemberKey(seed, m, t)``;
            ``perturbation`` is a Gaussian scale (or one per channel) or a function ``f(x, noise)`` (mesh3d.weather.ensemble).
        member_range: ``(start, stop)``: this job runs members ``start..stop-1`` of the ``members`` of the store (default
            all), so separate jobs write disjoint members of one campaign into one store (each member depends on its
            seed only: the store equals one job's). The last job to complete the store finishes it.
        model_noise: the model draws its own noise from ``noise.normal(...)`` (and torch's generator is seeded per
            member and lead: draws from it are the same on every mesh only with ``batch_size=1``).
        tile: the store's (lat, lon) chunk tile (default: 8 x 8 tiles of the globe); the domain split follows it.
        store_dtype: the store's dtype (default: the model's); compress: zstd (zarr's default codec) or raw bytes;
            restart_every: keep the state every n leads (0: never).
        release_memory: give each freed block-sized array back to the OS at once, so this rank's memory stays flat
            over any number of leads (glibc: a fixed mmap threshold of 1 MiB for the rest of the process, see
            :mod:`mesh3d.host_memory`; False leaves the allocator as it is).
        convention: the store's names, for the tool that reads it (:mod:`mesh3d.weather.conventions`): ``"cf"``
            (default), ``"weatherbench2"`` (WeatherBench 2's forecast dims) or ``"earth2studio"`` (a variable per
            channel, as earth2studio's inference outputs); a store is continued only in its own convention.
        progress: True (a line per lead on global rank 0), False or None (quiet), or a function called after each lead
            of each batch on every rank with a :class:`ForecastProgress`.
        run: JSON-able facts about the run recorded in the store (and checked when it resumes).
    """
    started = time.perf_counter()
    dm = DistributedManager() if DistributedManager.is_initialized() else None
    if not isinstance(leads, int) or leads < 1 or not isinstance(members, int) or members < 1 or batch_size < 1:
        raise ValueError(f"leads={leads!r}, members={members!r} and batch_size={batch_size!r} must be ints >= 1")
    start, stop = (0, members) if member_range is None else (int(member_range[0]), int(member_range[1]))
    if not 0 <= start < stop <= members:
        raise ValueError(f"member_range={member_range!r} must be (start, stop) with 0 <= start < stop <= members "
                         f"({members}): the members of the campaign this job runs")
    if restart_every < 0:
        raise ValueError(f"restart_every={restart_every} must be >= 0 (0: keep no state; a resume recomputes)")
    if release_memory:
        return_freed_memory()
    state_dtype = _model_dtype(model) if isinstance(model, nn.Module) else torch.get_default_dtype()
    probe = ForecastInputs(source, variables, lead=lead, stats=stats, names=names)
    shape = (len(probe.lat), len(probe.lon))
    tile = tuple(int(t) for t in (tile or default_tile(shape)))
    blocks = FieldBlocks.for_mesh(shape, tile)
    inputs = ForecastInputs(source, variables, lead=lead, stats=probe.stats, blocks=blocks, names=names) \
        if blocks.split else probe
    inits = inputs.init_times(init_times)
    window = (min(inits), max(inits) + leads * inputs.lead)   # the times this campaign reads and is scored on
    spec = StoreSpec(inits, inputs.lead, leads, members, inputs.channels, inputs.lat, inputs.lon,
                     tile, str(store_dtype or _numpy_name(state_dtype)).removeprefix("torch."), _numpy_name(state_dtype),
                     _run_record(model, run, seed, perturbation, model_noise, inputs, variables, names, window),
                     compress=compress, convention=convention)
    store = _open_or_create(out, spec, dm)
    batch_rank, batch_ranks = (dm.axis_rank("batch"), dm.axis_size("batch")) if dm is not None else (0, 1)
    coords = dm.coordinates if dm is not None else {"model": 0, "domain": 0}
    mine = [s for s in range(spec.samples) if start <= s % members < stop]   # NOTE: sample = init * members + member
    result = ForecastResult(out, [mine[j] for j in _share(len(mine), batch_ranks, batch_rank)])
    runner = _Runner(model, inputs, store, spec, result, blocks, model_noise, perturbation, seed, restart_every,
                     writes=coords["model"] == 0, leads_rank=coords["model"] == 0 and coords["domain"] == 0, dm=dm,
                     progress=_print_rank0 if progress is True else (progress or None), state_dtype=state_dtype)
    batches = [result.samples[i:i + batch_size] for i in range(0, len(result.samples), batch_size)]
    # NOTE: guarded: a rank that fails mid-campaign (its model, a read, a write) tells every peer at once, which all
    # raise PeerLostError naming it and its error, instead of waiting in a halo exchange or a lead's barrier for the
    # group's timeout. A killed rank is named the same way by the watch's heartbeats.
    guarded = dm.guard(f"the forecast into {os.path.basename(out)}") if dm is not None and dm.world_size > 1 \
        else nullcontext()
    with guarded:
        with torch.no_grad():
            for number, samples in enumerate(batches):
                runner.run(samples, number, len(batches))
        if dm is not None and dm.world_size > 1:
            dist.barrier(group=dm.world_mesh.get_group())
    # NOTE: every member of every init written (by this job, or with the other jobs' members): rank 0 finishes the
    # store (removes the restart record, consolidates); agreed, so its failure is every rank's
    agreed(f"forecast: finish the store {out}", lambda: store.finish() if (dm is None or dm.rank == 0) and store.leads_done(
        list(range(spec.samples))).min() >= spec.leads else None, dm)
    result.written, result.state_writes, result.bytes_written = store.writes, store.state_writes, store.bytes_written
    result.seconds = time.perf_counter() - started
    return result


def _fingerprint(model: Any) -> str | None:
    """A hash of the model's whole weights and buffers (the same on every mesh): a store continues only the same model."""
    if not isinstance(model, nn.Module):
        return None
    digest = hashlib.sha256()
    for name, value in model.state_dict().items():
        whole = value.full_tensor() if hasattr(value, "full_tensor") else value   # NOTE: a collective for split weights
        data = whole.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name} {data.dtype} {tuple(whole.shape)}".encode())
        digest.update(data.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:24]


def _run_record(model: Any, run: Mapping[str, Any] | None, seed: int, perturbation: Perturbation, model_noise: bool,
                inputs: ForecastInputs, variables: Any, names: Mapping[str, str] | None,
                window: tuple[np.datetime64, np.datetime64]) -> dict[str, Any]:
    record = dict(run or {})
    chosen = [list(pair) for pair in variable_pairs(variables)]  # NOTE: pairs: the store's JSON keeps their order
    if callable(perturbation):
        described: Any = f"{getattr(perturbation, '__module__', '?')}.{getattr(perturbation, '__qualname__', '?')}"
    else:
        described = None if perturbation is None else np.asarray(perturbation, dtype=np.float64).reshape(-1).tolist()
    # NOTE: what decides the values written (restart_every does not: a run may continue with another).
    record.update(weights=_fingerprint(model), seed=int(seed), perturbation=described, model_noise=bool(model_noise),
                  stats=None if inputs.stats is None else inputs.stats.to_dict(), variables=chosen,
                  names=dict(names) if names else None,
                  source=os.path.abspath(inputs.data.path) if inputs.data.path else None,   # None: an xarray.Dataset
                  source_digest=_dataset_digest(inputs, window))
    return json.loads(json.dumps(record))  # as the store will give it back (tuples as lists)


def _dataset_digest(inputs: ForecastInputs, window: tuple[np.datetime64, np.datetime64]) -> str:
    """A hash of the dataset's grid, its times within ``window`` (those the campaign reads or is scored on) and its
    channels (names, levels, units): a store continues from a dataset that moved only if it still describes the same
    fields. Times outside the window are left out, so a dataset that grew since (new times appended) still continues
    its stores. Values are not read (that would read the whole dataset); a dataset rewritten with other values on the
    same coordinates is not told apart."""
    times = inputs.times.astype("datetime64[ns]")
    digest = hashlib.sha256()
    for values in (inputs.lat, inputs.lon, times[(times >= window[0]) & (times <= window[1])].astype(np.int64)):
        array = np.ascontiguousarray(np.asarray(values))
        digest.update(f"{array.dtype} {array.shape}".encode())
        digest.update(array.tobytes())
    digest.update(json.dumps([[c.name, c.variable, c.level, c.units] for c in inputs.channels]).encode())
    return digest.hexdigest()[:24]


def _open_or_create(out: str, spec: StoreSpec, dm: DistributedManager | None) -> ForecastStore:
    """Global rank 0 creates the store if it does not exist; then every rank checks it belongs to this run and opens it."""
    def create() -> None:
        if (dm is None or dm.rank == 0) and not os.path.exists(out):
            create_store(out, spec)

    agreed(f"forecast: create the store {out}", create, dm)
    recorded = read_spec(out)
    differences = spec.differences(recorded)  # every rank reads the same metadata: all raise, or none
    if differences:
        raise ValueError(f"{out} holds another forecast ({'; '.join(differences)}): continue it with the same settings, "
                         "or write to a new path (or remove it)")
    store = ForecastStore(out)
    if any(spec.run.get(key) != recorded.run.get(key) for key in MOVABLE):
        # NOTE: the same content found elsewhere (checked above): record where it is now
        agreed(f"forecast: record the inputs' new paths in {out}",
                lambda: store.move_inputs(spec.run) if dm is None or dm.rank == 0 else None, dm)
    return store


class _Runner:
    """Runs one batch rank's samples: reads, steps, writes, records; resumes from the store's restart record."""

    def __init__(self, model, inputs, store, spec, result, blocks, model_noise, perturbation, seed, restart_every, *,
                 writes, leads_rank, dm, progress, state_dtype) -> None:
        self.model, self.inputs, self.store, self.spec, self.result = model, inputs, store, spec, result
        self.blocks, self.model_noise, self.perturbation, self.seed = blocks, model_noise, perturbation, seed
        self.restart_every, self.writes, self.leads_rank, self.dm = restart_every, writes, leads_rank, dm
        self.progress, self.state_dtype = progress, state_dtype
        self.rows, self.cols = blocks.rows, blocks.cols
        params = list(model.parameters()) if isinstance(model, nn.Module) else []
        self.device = params[0].device if params else torch.device("cpu")

    def _key(self, sample: int) -> MemberKey:
        i, m = divmod(sample, self.spec.members)
        return MemberKey(self.seed, m, self.spec.init_times[i])

    def run(self, samples: list[int], number: int, batches: int) -> None:
        done = self.store.leads_done(samples)
        slot_leads = self.store.state_leads(samples)
        self.result.skipped += int(np.minimum(done, self.spec.leads).sum())
        if done.min() >= self.spec.leads:
            return
        # NOTE: only the latest slot of a sample is trusted (an older one may be being overwritten when a run is killed).
        start = {s: (int(slot_leads[j].max()) if slot_leads[j].max() > 0 else 0) for j, s in enumerate(samples)}
        slots = {s: [int(v) for v in slot_leads[j]] for j, s in enumerate(samples)}
        todo = {s: int(d) for s, d in zip(samples, done)}
        for first, group in groupby(sorted((s for s in samples if todo[s] < self.spec.leads), key=lambda s: start[s]),
                                    key=lambda s: start[s]):
            self._run_from(list(group), first, todo, slots, number, batches)

    def _initial(self, samples: list[int], lead: int, slots: dict[int, list[int]]) -> torch.Tensor:
        """The states of ``samples`` at ``lead``: the initial conditions, perturbed (lead 0), or the saved states."""
        if lead > 0:
            saved = [self.store.read_state(s, int(np.argmax(slots[s])), self.rows, self.cols) for s in samples]
            return self.blocks.wrap(torch.from_numpy(np.stack(saved)).to(self.state_dtype).to(self.device))
        cache: dict[int, torch.Tensor] = {}
        for s in samples:
            i = s // self.spec.members
            if i not in cache:
                cache[i] = self.inputs.state(self.spec.init_times[i], self.state_dtype)
        x = self.blocks.wrap(torch.stack([cache[s // self.spec.members] for s in samples]).to(self.device))
        return perturb_initial(x, [self._key(s) for s in samples], self.perturbation)

    def _run_from(self, samples: list[int], first: int, todo: dict[int, int], slots: dict[int, list[int]], number: int,
                  batches: int) -> None:
        x = self._initial(samples, first, slots)
        started = time.perf_counter()
        for k in range(first + 1, self.spec.leads + 1):
            x = self._step(x, samples, k)
            if block_of(x)[1:] != (self.rows, self.cols):
                raise ValueError(f"the model returned a state holding rows {block_of(x)[1]} and columns {block_of(x)[2]} "
                                 f"of the field, but its input held {self.rows} and {self.cols}: return the next state in "
                                 "the input's layout (domain.redistribute(y, dims=x.spec.dims, sizes=x.spec.sizes))")
            fresh = [s for s in samples if k > todo[s]]
            self.result.recomputed += len(samples) - len(fresh)
            if not fresh:
                continue
            saved = self._write(x, samples, fresh, k, slots)
            self._agree()
            if self.leads_rank:
                self.store.record(fresh, k, saved)
            for s in fresh:
                todo[s] = k
                if s in saved:
                    slots[s][saved[s]] = k
            if self.progress is not None:
                self.progress(ForecastProgress(k, self.spec.leads, self.spec.lead * k, number, batches, tuple(samples),
                                               time.perf_counter() - started))

    def _step(self, x: torch.Tensor, samples: list[int], k: int) -> torch.Tensor:
        if not self.model_noise:
            return self.model(x)
        noise = MemberNoise([self._key(s) for s in samples], stream=k)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(noise.torch_seed())
            return self.model(x, noise)

    def _write(self, x: torch.Tensor, samples: list[int], fresh: list[int], k: int,
               slots: dict[int, list[int]]) -> dict[int, int]:
        """Write lead ``k`` of the ``fresh`` samples (and their state when it is kept); the slots written, by sample."""
        keep = self.restart_every and k % self.restart_every == 0 and k < self.spec.leads
        saved = {s: int(np.argmin(slots[s])) for s in fresh} if keep else {}
        if not self.writes:
            return saved
        local = (x.to_local() if hasattr(x, "to_local") else x).detach().cpu()
        local = local.float() if local.dtype == torch.bfloat16 else local
        began = time.perf_counter()
        members = self.spec.members
        # NOTE: in the wider of the model's and the store's dtypes (fp32 for both fp32: no fp64 copy of the block).
        dtype = np.result_type(local.numpy().dtype, np.dtype(self.spec.dtype))
        # NOTE: runs of samples of one init with consecutive members are written in one call (zarr writes them at once).
        for run in _runs(samples, fresh, lambda a, b: b == a + 1 and a // members == b // members):
            i, m = divmod(samples[run[0]], members)
            physical = self.inputs.physical(local[run[0]:run[-1] + 1].numpy(), dtype)
            self.store.write(i, k - 1, m, physical, self.rows, self.cols)
        self.result.write_seconds += time.perf_counter() - began
        for run in _runs(samples, saved, lambda a, b: b == a + 1 and saved[a] == saved[b]):
            self.store.write_state(samples[run[0]], saved[samples[run[0]]], local[run[0]:run[-1] + 1].numpy(),
                                   self.rows, self.cols)
        return saved

    def _agree(self) -> None:
        """Every writer of these samples has written (a barrier of the writers: model rank 0 of each domain rank)."""
        dm = self.dm
        if dm is not None and self.writes and dm.axis_size("domain") > 1:
            dist.barrier(group=dm.group("domain"))
