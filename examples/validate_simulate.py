"""How close is fxshard.simulate? Calibrate on one configuration, predict the others, compare with measured steps.

    torchrun --standalone --nproc-per-node 2 examples/validate_simulate.py [--steps 10]
    python examples/validate_simulate.py [--steps 10] [--calibrate-on "stage 3, prefetch 1"]   # spawns its ranks

Two gloo ranks on this machine train the GPT of examples/models.py (its default config, AdamW) under each
configuration below, all compiled first (two untimed steps each). ``fxshard.simulate.calibrate`` runs once, on
one configuration's backend and step; every other configuration is predicted with that machine, so its ratio tests
the model, not a fit to itself. Then ``--steps`` rounds time one step of every configuration in turn, each after a
barrier; a configuration's measured step is its median, averaged over the ranks. Rank 0 prints the machine and
the table.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import fxshard  # noqa: E402
from examples.models import GPT, GPTConfig, gpt_batch  # noqa: E402
from examples.launch import run_ranks  # noqa: E402
from fxshard.simulate import calibrate  # noqa: E402

CONFIGURATIONS = {
    "stage 3, prefetch 1": {"stage": 3, "prefetch": 1},
    "stage 3, prefetch 0": {"stage": 3, "prefetch": 0},
    "stage 2": {"stage": 2},
    "stage 1": {"stage": 1},
    "stage 0": {"stage": 0},
}


def prepared_step(options: dict, rank: int, batch_size: int):
    """(backend, step): a fresh GPT with AdamW prepared and compiled under ``options``, and a callable that runs
    one training step of it on this rank's next batch (forward, backward, optimizer step, zero_grad)."""
    torch.manual_seed(0)
    config = GPTConfig()
    model = GPT(config)
    # the simulator times the rewritten graph node by node: run it as it is, not fused by Inductor
    backend = fxshard.backend(**{"compiler": "eager", **options})
    model, optimizer = backend.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    generator = torch.Generator().manual_seed(rank)

    def step() -> None:
        compiled(*gpt_batch(config, batch_size, generator)).backward()
        optimizer.step()
        optimizer.zero_grad()

    return backend, step


def median_step_seconds(steps: dict, rounds: int) -> dict:
    """Median seconds of each of ``steps`` (name: step callable) over ``rounds`` rounds that time every step once,
    each after a barrier, averaged over the ranks. Round-robin, so that a change in the machine's load during the
    run hits every configuration alike."""
    times = {name: [] for name in steps}
    started = time.monotonic()
    for done in range(1, rounds + 1):
        for name, step in steps.items():
            dist.barrier()
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
        if dist.get_rank() == 0 and (done % 5 == 0 or done == rounds):
            elapsed = time.monotonic() - started
            remaining = elapsed / done * (rounds - done)
            print(f"round {done}/{rounds}: elapsed {elapsed:.0f} s, remaining ~{remaining:.0f} s", file=sys.stderr,
                  flush=True)
    medians = torch.tensor([statistics.median(times[name]) for name in steps], dtype=torch.float64)
    dist.all_reduce(medians)
    return dict(zip(steps, (medians / dist.get_world_size()).tolist()))


def validate(args: argparse.Namespace) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    names = [args.calibrate_on] + [name for name in CONFIGURATIONS if name != args.calibrate_on]
    backends, steps = {}, {}
    started = time.monotonic()
    for index, name in enumerate(names, 1):
        if rank == 0:
            print(f"[{index}/{len(names)}] {name}: compiling (elapsed {time.monotonic() - started:.0f} s)",
                  file=sys.stderr, flush=True)
        backends[name], steps[name] = prepared_step(CONFIGURATIONS[name], rank, args.batch_size)
        for _ in range(2):  # the first step compiles
            steps[name]()
    compiled = {name: len(backend.graphs) for name, backend in backends.items()}
    if rank == 0:
        print(f"calibrating on {args.calibrate_on} (elapsed {time.monotonic() - started:.0f} s), then timing "
              f"{args.steps} rounds", file=sys.stderr, flush=True)
    calibrating = time.monotonic()
    machine = calibrate(backend=backends[args.calibrate_on], step=steps[args.calibrate_on])
    if rank == 0:
        print(f"calibrated in {time.monotonic() - calibrating:.0f} s (elapsed {time.monotonic() - started:.0f} s)",
              file=sys.stderr, flush=True)
    measured = median_step_seconds(steps, args.steps)
    recompiled = [name for name, backend in backends.items() if len(backend.graphs) != compiled[name]]
    if rank == 0:
        print(f"machine (calibrated on {args.calibrate_on}): {machine}\n")
        if recompiled:
            print(f"warning: {recompiled} compiled again while timed; their measured steps include compiling\n")
        print("| configuration | measured step | predicted step | compute / comm / exposed / overhead | ratio |")
        print("|---|---:|---:|---|---:|")
        for name in names:
            t = fxshard.simulate(backends[name], world_size, machine=machine)
            parts = " / ".join(f"{1e3 * x:.1f}" for x in (t.compute_time, t.comm_time, t.exposed_comm,
                                                            t.overhead_time))
            label = name + (" (calibrated)" if name == args.calibrate_on else "")
            print(f"| {label} | {1e3 * measured[name]:.1f} ms | {1e3 * t.step_time:.1f} ms | {parts} ms | "
                  f"{t.step_time / measured[name]:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="timed rounds (one step of each configuration)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--calibrate-on", choices=list(CONFIGURATIONS), default="stage 3, prefetch 1")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    run_ranks(validate, args, args.world_size)


if __name__ == "__main__":
    main()
