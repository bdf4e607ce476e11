"""Can two ranks share one GPU on nccl? (A one-GPU machine's only way to run a multi-rank nccl check.)

Usage: ``python scripts/nccl_two_ranks.py``: prints what the all-reduce returned, or the error NCCL raised.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", 0))
    t = torch.full((4,), float(rank + 1), device="cuda")
    try:
        dist.all_reduce(t)
        torch.cuda.synchronize()
        print(f"rank {rank}: all_reduce on one shared GPU gave {t.tolist()}", flush=True)
    except Exception as e:  # noqa: BLE001 - the probe reports whatever NCCL says
        print(f"rank {rank}: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port,), nprocs=2, join=True)


if __name__ == "__main__":
    main()
