"""The mesh a plan is made for, with no process group: axis sizes, the domain grid, and where each rank sits.

Usage::

    mesh = JobMesh.resolve(4096, batch=-1, domain=(4, 4), model=4)   # JobMesh(batch=64, grid=(4, 4), model=4)
    mesh = JobMesh.parse("batch=8,domain=4x4,model=2")               # what ``--to`` takes ("8,4x4,2" too)
    b, d, m = mesh.coords(rank); mesh.bd_index(rank)                  # the rank's place, as the manager lays it out
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mesh3d.mesh_shape import resolve_domain_grid, resolve_mesh_shape

__all__ = ["JobMesh", "parse_grid"]


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

