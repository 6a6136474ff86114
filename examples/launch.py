"""How the examples start their ranks: under torchrun, or spawned by the example itself when run with plain python.

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py        # torchrun starts the ranks (env://)
    torchrun --nnodes 2 --node-rank 0 --rdzv-endpoint HOST:29500 --nproc-per-node 8 examples/train_gpt.py
    python examples/train_gpt.py --world-size 2                           # the example spawns them itself

Either way ``run_ranks`` initialises a gloo process group and calls ``fn(args)`` on every rank (the rank and world
size from ``torch.distributed``), then destroys the group.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def under_torchrun() -> bool:
    """Whether a launcher such as torchrun started this process as one rank (it sets these variables)."""
    return all(v in os.environ for v in TORCHRUN_VARIABLES)


def refuse_torchrun(script: str) -> None:
    """For the drivers that start fresh ranks per configuration themselves (benchmark, stress): exit with a message
    instead of every torchrun rank running the whole driver."""
    if under_torchrun():
        sys.exit(f"{script} starts its own ranks for every configuration it runs; run it with python, not torchrun")


def _spawned(rank: int, world_size: int, port: int, fn: Callable, args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        fn(args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[[argparse.Namespace], None], args: argparse.Namespace, world_size: int) -> None:
    """``fn(args)`` on every rank: this process's one under torchrun (``world_size`` is then torchrun's), else
    ``world_size`` processes spawned here, one thread each (the ranks share this machine's cores)."""
    if under_torchrun():
        dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun
        try:
            fn(args)
        finally:
            dist.destroy_process_group()
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the spawned ranks
    torch.set_num_threads(1)
    mp.spawn(_spawned, args=(world_size, port, fn, args), nprocs=world_size)
