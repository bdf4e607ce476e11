"""What the examples' runs share: output folders a second run starts afresh in, whole parameters to check against.

Usage (one process, before it writes anything: the parent that starts the ranks, or rank 0 before the mesh exists)::

    from _runs import fresh_output, torchrun_env, whole
    fresh_output("runs/graph_weather", "examples/graph_weather.py", ["era5_like.zarr", "ckpt"])
    weights = [whole(p) for p in model.parameters()]     # on every rank: a collective for each DTensor
    subprocess.run(["torchrun", "--nproc-per-node", "4", ...], env=torchrun_env())

An example names what it writes in its folder. The first run marks the folder as its own (a file ``.mesh3d-example``
listing the examples that wrote there); a later run removes those names from a folder so marked, and only those
(never the folder itself, nor anything else in it), and says so in one line. mesh3d never overwrites a checkpoint
(``checkpoint.save`` and ``coalesce`` refuse an existing path), so a rerun makes room for its own new ones this way.
An unmarked folder that holds nothing but names the example writes (``known``: the output of a run from before the
marker existed) counts as its own too. Any other folder that holds one of the names (a folder of the user's, another
example's) is left as it is: the run stops, saying what is in the way.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["MARKER", "fresh_output", "torchrun_env", "whole"]

#: The file that marks a folder as the output of the examples it lists (one per line).
MARKER = ".mesh3d-example"


def fresh_output(folder: str | os.PathLike, example: str, names: Iterable[str], known: Iterable[str] = ()) -> list[str]:
    """Make ``folder`` ready for a fresh run of ``example``: remove the ``names`` a previous run of it left there.

    ``known``: every name the example writes there, in any phase (``names`` are always among them). Returns the
    names removed (printed in one line when any). Raises ``SystemExit`` with a message, touching nothing, when one
    of ``names`` exists in a folder that is not ``example``'s.
    """
    root = Path(folder)
    names = list(names)
    present = [n for n in names if os.path.lexists(root / n)]
    marker = root / MARKER
    owners = marker.read_text().split() if marker.is_file() else []
    # NOTE: an unmarked folder holding nothing this example does not write is the output of a run from before the marker.
    if present and example not in owners and (owners or not set(os.listdir(root)) <= {*names, *known}):
        whose = f"marked by {', '.join(owners)}" if owners else f"holds other files and no {MARKER} file of {example}"
        raise SystemExit(f"{example}: {root} already holds {', '.join(present)}, and the folder {whose}: not removing "
                         "anything; move those away or choose another output folder")
    root.mkdir(parents=True, exist_ok=True)
    for name in present:
        path = root / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    if example not in owners:
        marker.write_text("".join(f"{o}\n" for o in [*owners, example]))
    if present:
        print(f"{example}: starting afresh in {root}: removed {', '.join(present)} (its previous run's output)", flush=True)
    return present


def whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind ``t``, detached: for a DTensor a collective, to call on every rank.

    One mesh dim at a time, the outermost (FSDP's) first: a parameter of FSDP over tensor parallelism is split twice
    along one dim (``_StridedShard``), and ``full_tensor()`` runs the same two all-gathers but logs a warning that it
    cannot merge them; each step here is one all-gather torch plans without that message.
    """
    if not isinstance(t, DTensor):
        return t.detach()
    mesh = t.device_mesh
    for k in range(mesh.ndim):
        t = t.redistribute(mesh, [Replicate()] * (k + 1) + list(t.placements[k + 1:]))
    return t.to_local().detach()


def torchrun_env() -> dict[str, str]:
    """The environment for a ``torchrun`` an example starts itself: ``OMP_NUM_THREADS`` as torchrun sets it anyway (1
    thread per process unless the user chose), so torchrun does not print its banner saying that it set it."""
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
