"""How close is fxshard.simulate? Calibrate on one configuration, predict the others, compare with measured steps.

    torchrun --standalone --nproc-per-node 2 examples/validate_simulate.py [--steps 10]
    python examples/validate_simulate.py [--world-size 4] [--steps 10] [--calibrate-on "stage 3"]   # spawns ranks

gloo ranks on this machine train the benchmark's GPT (examples/benchmark.py's config, AdamW, ``--batch-size``
sequences per rank) under each configuration below, all compiled first (two untimed steps each): the stages, and
stage 3 under the communication options (docs/communication.md). ``fxshard.simulate.calibrate`` runs once, on one
configuration's backend and step; every other configuration is predicted with that machine, so its ratio tests the
model, not a fit to itself. Each option is predicted twice: from its own graphs, and from plain stage 3's graphs
priced with ``WhatIf`` (what ``python -m fxshard simulate --options`` does without compiling it). Then ``--steps``
rounds time ``--block`` consecutive steps of every configuration in turn (as training runs them; round after round,
so that a change in the machine's load hits every configuration alike), each step after a barrier; a
configuration's measured step is its median, averaged over the ranks. Rank 0 prints the machine and the table.
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
from examples.benchmark import MODEL  # noqa: E402
from examples.launch import run_ranks  # noqa: E402
from examples.models import GPT, gpt_batch  # noqa: E402
from fxshard.simulate import calibrate  # noqa: E402
from fxshard.simulate.simulator import WhatIf  # noqa: E402

PLAIN = "stage 3"
INT8 = {"quantize_weights": "int8", "quantize_grads": "int8"}


def configurations(world: int) -> dict[str, dict]:
    """The configurations timed: the stages, and stage 3 under communication options (secondary shards over pairs
    of ranks where the world has more than two)."""
    stages = {PLAIN: {"stage": 3}, "stage 3, prefetch 0": {"stage": 3, "prefetch": 0},
              "stage 3, int8 weights + grads": {"stage": 3, **INT8}}
    if world > 2 and world % 2 == 0:
        stages["stage 3, reshard_after_forward=2"] = {"stage": 3, "reshard_after_forward": 2}
    return {**stages, "stage 2": {"stage": 2}, "stage 1": {"stage": 1}, "stage 0": {"stage": 0}}


def what_if(options: dict) -> WhatIf | None:
    """The option of a stage 3 configuration as a ``WhatIf`` on plain stage 3's graphs; None for the others."""
    if options.get("stage") != 3 or not ({"quantize_weights", "reshard_after_forward"} & options.keys()):
        return None
    return WhatIf(quantize_weights=options.get("quantize_weights"), quantize_grads=options.get("quantize_grads"),
                  secondary=options.get("reshard_after_forward"))


def prepared_step(options: dict, rank: int, batch_size: int):
    """(backend, step): a fresh GPT with AdamW prepared and compiled under ``options``, and a callable that runs
    one training step of it on this rank's next batch (forward, backward, optimizer step, zero_grad)."""
    torch.manual_seed(0)
    config = MODEL
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


def median_step_seconds(steps: dict, rounds: int, block: int) -> dict:
    """Median seconds of each of ``steps`` (name: step callable) over ``rounds`` rounds that time ``block``
    consecutive steps of each in turn, each after a barrier, averaged over the ranks."""
    times = {name: [] for name in steps}
    started = time.monotonic()
    for done in range(1, rounds + 1):
        for name, step in steps.items():
            for _ in range(block):
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
    # As this GPT trains, subnormal floats appear and slow the CPU's arithmetic: its stage-3 step at 4 ranks climbs
    # from 396 to 556 ms over 60 steps (flushed: 365 to 368). Flushed, a configuration costs the same from the
    # first timed step to the last, which the comparison needs; both the calibration and the timing see it alike.
    torch.set_flush_denormal(True)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    options = configurations(world_size)
    if args.calibrate_on not in options:
        raise SystemExit(f"--calibrate-on must be one of {list(options)}")
    names = [args.calibrate_on] + [name for name in options if name != args.calibrate_on]
    backends, steps = {}, {}
    started = time.monotonic()
    for index, name in enumerate(names, 1):
        if rank == 0:
            print(f"[{index}/{len(names)}] {name}: compiling (elapsed {time.monotonic() - started:.0f} s)",
                  file=sys.stderr, flush=True)
        backends[name], steps[name] = prepared_step(options[name], rank, args.batch_size)
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
    measured = median_step_seconds(steps, args.steps, args.block)
    recompiled = [name for name, backend in backends.items() if len(backend.graphs) != compiled[name]]
    if rank == 0:
        print(f"machine (calibrated on {args.calibrate_on}): {machine}\n")
        if recompiled:
            print(f"warning: {recompiled} compiled again while timed; their measured steps include compiling\n")
        print("| configuration | measured step | predicted step | compute / comm / exposed / overhead | ratio |")
        print("|---|---:|---:|---|---:|")
        predictions = [(name + (" (calibrated)" if name == args.calibrate_on else ""), name, backends[name], None)
                       for name in names]
        predictions += [(f"{name}, priced on {PLAIN}'s graphs", name, backends[PLAIN], what_if(options[name]))
                        for name in names if what_if(options[name])]
        for label, name, backend, option in predictions:
            t = fxshard.simulate(backend, world_size, machine=machine, what_if=option)
            parts = " / ".join(f"{1e3 * x:.1f}" for x in (t.compute_time, t.comm_time, t.exposed_comm,
                                                            t.overhead_time))
            print(f"| {label} | {1e3 * measured[name]:.1f} ms | {1e3 * t.step_time:.1f} ms | {parts} ms | "
                  f"{t.step_time / measured[name]:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="timed rounds (--block steps of each configuration)")
    parser.add_argument("--block", type=int, default=3, help="consecutive steps of a configuration in a round")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--calibrate-on", default=PLAIN, help="the configuration calibrate fits (default: %(default)s)")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    run_ranks(validate, args, args.world_size)


if __name__ == "__main__":
    main()
