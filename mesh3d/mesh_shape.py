"""The rule that turns requested axis sizes into a (batch, domain, model) mesh shape.

Pure arithmetic on the world size: it runs before any collective, so every rank
reaches the same verdict and a bad request fails everywhere instead of hanging.

Usage::

    resolve_mesh_shape(8, batch=2, domain=2, model=-1)   # (2, 2, 2)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["AXES", "JobMesh", "divisors", "grid_factorizations", "parse_grid", "resolve_domain_grid", "resolve_mesh_shape"]

#: The mesh axes, always all three and always in this (row-major) order.
AXES: tuple[str, str, str] = ("batch", "domain", "model")


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n`` in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _fmt(sizes: dict[str, int]) -> str:
    return ", ".join(f"{name}={size}" for name, size in sizes.items())


def _fixes(world_size: int, sizes: dict[str, int]) -> list[str]:
    """For each axis, the value that would make the product equal the world size."""
    fixes = []
    for name in AXES:
        others = math.prod(size for other, size in sizes.items() if other != name)
        if world_size % others == 0:
            fixes.append(f"{name}={world_size // others}")
    return fixes


def _launch(ranks: int, multiple: bool = False) -> str:
    """How to launch ``ranks`` processes (or a multiple of them), in the launchers' own words."""
    if ranks == 1 and not multiple:
        return "run one process (python script.py, no launcher)"
    n = f"a multiple of {ranks}" if multiple else str(ranks)
    return f"launch {n} processes (torchrun --nproc-per-node {ranks}, srun -n {ranks})"


def _meshes_for(world_size: int, sizes: dict[str, int], limit: int = 4) -> str:
    """Meshes of ``world_size`` ranks close to the asked ``sizes``: one axis changed, else any (at most ``limit``)."""
    fits = [" ".join(f"{n}={world_size // math.prod(s for o, s in sizes.items() if o != n) if n == name else sizes[n]}"
                     for n in AXES) for name in AXES
            if world_size % math.prod(s for o, s in sizes.items() if o != name) == 0]
    if not fits:
        fits = [f"batch={b} domain={d} model={world_size // (b * d)}" for b in divisors(world_size)
                for d in divisors(world_size // b)][:limit]
    return " or ".join(f"({f.replace(' ', ', ')})" for f in fits[:limit])


def resolve_mesh_shape(world_size: int, batch: int = -1, domain: int = 1, model: int = 1) -> tuple[int, int, int]:
    """Validate axis sizes against the world size and infer the one given as -1.

    Usage: ``resolve_mesh_shape(8, batch=-1, domain=2, model=2)  # (2, 2, 2)``

    Raises ``ValueError`` naming the sizes, the world size, the launch that would fit the asked mesh and the meshes
    that would fit the launched world.
    """
    sizes = {"batch": batch, "domain": domain, "model": model}
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int):
            raise ValueError(f"{name}={size!r} is not an integer; axis sizes are positive integers, or -1 to infer one")
        if size != -1 and size < 1:
            raise ValueError(
                f"{name}={size} is not a valid axis size for world size {world_size}: use a positive integer "
                f"(a divisor of {world_size}: {', '.join(map(str, divisors(world_size)))}), or -1 to infer it"
            )
    inferred = [name for name, size in sizes.items() if size == -1]
    if len(inferred) > 1:
        raise ValueError(
            f"{' and '.join(f'{n}=-1' for n in inferred)}: at most one axis size may be -1 (inferred from world size "
            f"{world_size}); give the others explicitly, e.g. batch=-1, domain=1, model=1"
        )
    valid = ", ".join(map(str, divisors(world_size)))
    known = math.prod(size for size in sizes.values() if size != -1)
    if world_size % known == 0 and not inferred and known != world_size:
        raise ValueError(
            f"{_fmt(sizes)} make a mesh of {known} ranks, which does not match world size {world_size}; "
            f"{_launch(known)} for this mesh, or on {world_size} use {' or '.join(_fixes(world_size, sizes))}, or "
            "pass -1 for one axis to infer it"
        )
    if world_size % known != 0:
        bad = next((n for n, s in sizes.items() if s != -1 and world_size % s != 0), None)
        if bad is not None:
            lead = (f"{bad}={sizes[bad]} does not divide world size {world_size}; valid {bad} sizes are the divisors of "
                    f"{world_size}: {valid} (requested {_fmt({n: s for n, s in sizes.items() if n != bad})})")
        elif inferred:
            lead = (f"cannot infer {inferred[0]}: {_fmt({n: s for n, s in sizes.items() if n != inferred[0]})} use "
                    f"{known} ranks per {inferred[0]} slice, which does not divide world size {world_size}")
        else:
            lead = f"{_fmt(sizes)} make a mesh of {known} ranks, which does not match world size {world_size}"
        raise ValueError(f"{lead}; {_launch(known, multiple=bool(inferred))} for this mesh, or on {world_size} use "
                         f"{_meshes_for(world_size, {n: (1 if s == -1 else s) for n, s in sizes.items()})}")
    if inferred:
        sizes[inferred[0]] = world_size // known
    return sizes["batch"], sizes["domain"], sizes["model"]


def grid_factorizations(size: int, max_dims: int = 3) -> list[tuple[int, ...]]:
    """Every ordered grid of 1 to ``max_dims`` dims (each > 1, or the single size) whose product is ``size``.

    Usage: ``grid_factorizations(4)  # [(4,), (2, 2)]``
    """
    out: list[tuple[int, ...]] = [(size,)]
    frontier = [(d, size // d) for d in divisors(size) if 1 < d < size]
    for dims in range(2, max_dims + 1):
        nxt = []
        for *head, rest in frontier:
            out.append((*head, rest))
            if dims < max_dims:
                nxt += [(*head, d, rest // d) for d in divisors(rest) if 1 < d < rest]
        frontier = nxt
    return out


def resolve_domain_grid(world_size: int, batch: int, domain: int | tuple[int, ...], model: int) -> tuple[int, tuple[int, ...]]:
    """The domain axis size and its grid: ``domain=4`` is the 1-D grid (4,), ``domain=(2, 2)`` a 2x2 grid of blocks.

    Usage: ``resolve_domain_grid(8, batch=2, domain=(2, 2), model=1)  # (4, (2, 2))``

    A grid's product is the domain size; when it does not fit the world, the error names the grids that would.
    """
    if isinstance(domain, int):
        return domain, (domain,)
    grid = tuple(domain) if isinstance(domain, (tuple, list)) else None
    if not grid or len(grid) > 3 or any(isinstance(g, bool) or not isinstance(g, int) or g < 1 for g in grid):
        raise ValueError(f"domain={domain!r}: a domain grid is a tuple of 1 to 3 positive sizes, e.g. domain=(2, 2); "
                         "or pass one integer for slabs")
    size = math.prod(grid)
    try:
        resolve_mesh_shape(world_size, batch, size, model)
    except ValueError as err:
        try:
            fitting = resolve_mesh_shape(world_size, batch, -1, model)[1] if -1 not in (batch, model) else None
        except ValueError:
            fitting = None
        hint = (f"; grids of the {fitting} domain ranks that fit: "
                f"{', '.join(map(str, grid_factorizations(fitting)))}") if fitting else ""
        raise ValueError(f"domain grid {grid} has {size} ranks, which does not fit: {err}{hint}") from None
    return size, grid


def parse_grid(text: str) -> int | tuple[int, ...]:
    """``"4"`` → 4 (slabs), ``"4x4"`` → (4, 4) (blocks), ``"-1"`` → -1 (inferred).

    Usage: ``parse_grid("2x2x2")  # (2, 2, 2)``
    """
    parts = text.lower().split("x")
    try:
        sizes = tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(f"{text!r} is not an axis size: give an integer (4), -1, or a domain grid such as 4x4") from None
    return sizes[0] if len(sizes) == 1 else sizes


@dataclass(frozen=True)
class JobMesh:
    """Axis sizes of a (batch, domain, model) mesh; the domain axis as a grid (``(D,)`` for slabs).

    Usage: ``JobMesh.resolve(16, batch=2, domain=(2, 2), model=2).world  # 16``

    Ranks are laid out as ``DistributedManager`` lays them out: row-major over (batch, domain, model),
    so ``rank = (b * D + d) * M + m``; FSDP shards over the flattened batch×domain index ``b * D + d``.
    """

    batch: int
    grid: tuple[int, ...]
    model: int

    @classmethod
    def resolve(cls, world: int, batch: int = -1, domain: int | tuple[int, ...] = 1, model: int = 1) -> JobMesh:
        """The mesh of ``world`` ranks; one size may be -1 (inferred), as in ``DistributedManager.initialize``."""
        if not isinstance(world, int) or isinstance(world, bool) or world < 1:
            raise ValueError(f"world={world!r} must be a positive number of ranks")
        size, grid = resolve_domain_grid(world, batch, domain, model)
        b, d, m = resolve_mesh_shape(world, batch, size, model)
        return cls(b, grid if len(grid) > 1 else (d,), m)

    @classmethod
    def parse(cls, text: str) -> JobMesh:
        """``"batch=8,domain=4x4,model=2"`` or ``"8,4x4,2"`` (omitted keys are 1)."""
        fields = [f.strip() for f in text.split(",") if f.strip()]
        sizes: dict[str, int | tuple[int, ...]] = {"batch": 1, "domain": 1, "model": 1}
        if fields and all("=" not in f for f in fields):
            if len(fields) != 3:
                raise ValueError(f"mesh {text!r}: give three sizes BATCH,DOMAIN,MODEL (e.g. 8,4x4,2) or "
                                 "batch=8,domain=4x4,model=2")
            fields = [f"{k}={v}" for k, v in zip(sizes, fields)]
        for f in fields:
            key, _, value = f.partition("=")
            if key.strip() not in sizes:
                raise ValueError(f"mesh {text!r}: unknown axis {key.strip()!r}; the axes are batch, domain, model")
            sizes[key.strip()] = parse_grid(value.strip())
        domain = sizes["domain"]
        world = math.prod(domain) if isinstance(domain, tuple) else domain
        batch, model = sizes["batch"], sizes["model"]
        if not isinstance(batch, int) or not isinstance(model, int) or min(batch, model, world) < 1:
            raise ValueError(f"mesh {text!r}: every size must be a positive integer (the domain may be a grid)")
        return cls.resolve(world * batch * model, batch, domain, model)

    @property
    def domain(self) -> int:
        return math.prod(self.grid)

    @property
    def world(self) -> int:
        return self.batch * self.domain * self.model

    @property
    def batch_domain(self) -> int:
        return self.batch * self.domain

    def sizes(self) -> dict[str, int]:
        """``{"batch": B, "domain": D, "model": M}``: what ``Plan`` checks read."""
        return {"batch": self.batch, "domain": self.domain, "model": self.model}

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(batch, domain, model) coordinates of a global rank."""
        bd, m = divmod(rank, self.model)
        b, d = divmod(bd, self.domain)
        return b, d, m

    def rank_of(self, b: int, d: int, m: int) -> int:
        return (b * self.domain + d) * self.model + m

    def text(self) -> str:
        """``"batch 64 x domain 4x4 x model 4 (4096 ranks)"``."""
        grid = "x".join(map(str, self.grid))
        return f"batch {self.batch} x domain {grid} x model {self.model} ({self.world} ranks)"

    def short(self) -> str:
        """``"64,4x4,4"``: the form ``parse`` reads."""
        return f"{self.batch},{'x'.join(map(str, self.grid))},{self.model}"

