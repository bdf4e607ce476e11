"""Print which rank sits where on the (batch, domain, model) mesh, and which ranks share each group.

Usage::

    torchrun --nproc-per-node 8 examples/mesh_table.py --batch 2 --domain 2 --model -1
    python examples/mesh_table.py              # no launcher: a world of one
"""

from __future__ import annotations

import argparse

import torch.distributed as dist

from mesh3d import AXES, DistributedManager


def mesh_rows(dm: DistributedManager) -> list[dict]:
    """Every rank's coordinates and groups, gathered to all ranks."""
    mine = {"rank": dm.rank, **dm.coordinates, **{f"{a} group": dm.axis_ranks(a) for a in (*AXES, "batch_domain")}}
    rows: list[dict] = [{} for _ in range(dm.world_size)]
    dist.all_gather_object(rows, mine, group=dm.group("world"))
    return rows


def format_table(rows: list[dict]) -> str:
    headers = list(rows[0])
    cells = [[str(row[h]).replace(" ", "") for h in headers] for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    line = lambda values: "  ".join(v.rjust(w) for v, w in zip(values, widths))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=-1)
    parser.add_argument("--domain", type=int, default=1)
    parser.add_argument("--model", type=int, default=1)
    args = parser.parse_args()
    dm = DistributedManager.initialize(batch=args.batch, domain=args.domain, model=args.model)
    rows = mesh_rows(dm)
    if dm.rank == 0:
        shape = " x ".join(f"{a}={n}" for a, n in dm.shape.items())
        print(f"mesh {shape} on {dm.world_size} rank(s), backend={dm.backend}, launcher={dm.launcher}")
        print(format_table(rows), flush=True)
    DistributedManager.shutdown()


if __name__ == "__main__":
    main()
