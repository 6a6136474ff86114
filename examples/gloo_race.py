"""Reproduce the torch 2.13 ProcessGroupGloo worker-thread race without fxshard or torch.compile.

    python examples/gloo_race.py                  # default gloo group (2 worker threads): a rank usually dies
    python examples/gloo_race.py --threads 1      # a gloo group with one worker thread: runs to the end
    torchrun --standalone --nproc-per-node 2 examples/gloo_race.py [--threads 1]

Two ranks on this machine keep ``--in-flight`` functional all-gathers outstanding at once, ``--iters`` times. With
gloo's two worker threads, two all-gathers finish together and both threads assign the group's
``lastCompletedWorkName`` status string without a lock; one of them frees the buffer the other frees too, and the
rank aborts in malloc ("unaligned tcache chunk detected", "double free or corruption") or crashes in ``free``.
It usually dies within a minute on 2 cores. See docs/known-issues.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from examples.launch import run_ranks  # noqa: E402  (no fxshard: it only starts the ranks)


def gloo_group(threads: int) -> dist.ProcessGroup:
    """The world's ranks on a gloo group whose backend runs ``threads`` worker threads (gloo's default is 2; the
    options are private API because init_process_group and new_group ignore gloo options in torch 2.13)."""
    def create(store, rank, world_size, timeout):
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._threads = threads
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
        return dist.ProcessGroupGloo(store, rank, world_size, options)

    dist.Backend.register_backend("gloo_threads", create, devices=["cpu"])
    return dist.new_group(backend="gloo_threads", timeout=datetime.timedelta(seconds=60))


def race(args: argparse.Namespace) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD if args.threads is None else gloo_group(args.threads)
    c10d = torch.ops._c10d_functional
    shards = [torch.randn(args.size) for _ in range(args.in_flight)]
    start = time.monotonic()
    for i in range(args.iters):
        # On gloo a functional all_gather_into_tensor runs as allgather_coalesced: its op name, ALLGATHER_COALESCED
        # (19 characters), is longer than std::string's 15-character inline buffer, so each status update
        # allocates a new buffer and frees the old one.
        gathered = [c10d.all_gather_into_tensor(shard, world_size, group.group_name) for shard in shards]
        for tensor in gathered:
            c10d.wait_tensor(tensor)
        if rank == 0 and i % 5000 == 0:
            print(f"iteration {i}, {time.monotonic() - start:.1f} s", flush=True)
    dist.barrier()
    print(f"rank {rank}: {args.iters} iterations without a crash in {time.monotonic() - start:.1f} s", flush=True)
    os._exit(0)  # skip process-group teardown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="gloo worker threads (default: gloo's own, 2)")
    parser.add_argument("--iters", type=int, default=20000)
    parser.add_argument("--in-flight", type=int, default=4, help="all-gathers outstanding at once")
    parser.add_argument("--size", type=int, default=64, help="elements per shard")
    os.environ["LIBC_FATAL_STDERR_"] = "1"  # glibc's abort message to the rank's stderr (spawned ranks)
    run_ranks(race, parser.parse_args(), 2)


if __name__ == "__main__":
    main()
