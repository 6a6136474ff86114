"""Communication that costs less: one GPT trained at stage 3 under each communication option, side by side on the
same data (docs/communication.md).

    python examples/communication.py [--world 4] [--node 2] [--steps 40]      # spawns --world gloo ranks
    torchrun --standalone --nproc-per-node 4 examples/communication.py

The task's loss falls (``examples.models.pattern_batch``: each token three times the one before plus one), so the
curves show what the lossy options cost. For each option rank 0 prints the loss every few steps, and of the last
step: the bytes each rank sent as the kernel counts them (``fxshard.report.wire``: every TCP socket between two
ranks), the part that crossed "nodes" of ``--node`` consecutive ranks, the ledger's bytes for the same step (the
payload; gloo adds 240 bytes a message), and the median step time.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import fxshard  # noqa: E402
from examples.launch import run_ranks  # noqa: E402
from examples.models import GPT, GPTConfig, pattern_batch  # noqa: E402
from fxshard import budget  # noqa: E402
from fxshard.report.wire import sent_during  # noqa: E402

CONFIG = GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=4, d_model=128)
PER_RANK_BATCH = 8
LR = 3e-3


def options_for(world: int, node: int) -> dict[str, dict]:
    """The options compared: plain stage 3, secondary shards over a node (where the world has more than one),
    and the quantized collectives."""
    options = {"plain stage 3": {}}
    if 1 < node < world and world % node == 0:
        options[f"reshard_after_forward={node}"] = {"reshard_after_forward": node}
    options.update({
        "bf16 weights + grads": {"quantize_weights": "bf16", "quantize_grads": "bf16"},
        "fp8 weights": {"quantize_weights": "fp8"},
        "int8 weights": {"quantize_weights": "int8"},
        "int8 weights + grads": {"quantize_weights": "int8", "quantize_grads": "int8"},
    })
    return options


@dataclasses.dataclass
class Run:
    losses: list[float]
    sent: dict[tuple[int, int], int]
    ledger_bytes: float
    step_s: float


def train(options: dict, steps: int) -> Run:
    torch._dynamo.reset()
    torch.manual_seed(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = fxshard.backend(stage=3, **options)
    model = GPT(CONFIG)
    model, opt = backend.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    run = torch.compile(model, backend=backend, fullgraph=True)
    generator = torch.Generator().manual_seed(1)
    losses, times, sent = [], [], {}
    for index in range(steps):
        tokens, targets = pattern_batch(CONFIG, world * PER_RANK_BATCH, generator)
        mine = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
        loss = None

        def step():
            nonlocal loss
            loss = run(tokens[mine], targets[mine])
            loss.backward()
            opt.step()
            opt.zero_grad()

        start = time.perf_counter()
        if index == steps - 1:
            sent = sent_during(step)
        else:
            step()
        times.append(time.perf_counter() - start)
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        losses.append(mean.item())
    ledger = budget.ledger(backend)
    return Run(losses, sent, ledger.at(ledger.communicated(moved=True)), statistics.median(times[1:-1]))


def compare(args: argparse.Namespace) -> None:
    world = dist.get_world_size()
    runs = {name: train(options, args.steps) for name, options in options_for(world, args.node).items()}
    if dist.get_rank():
        return
    params = sum(p.numel() for p in GPT(CONFIG).parameters())
    print(f"GPT of {params:,} parameters, stage 3 on {world} gloo ranks, AdamW lr {LR}, {PER_RANK_BATCH} x "
          f"{CONFIG.block_size} tokens per rank, the pattern task; nodes of {args.node} ranks\n")
    shown = sorted({0, *range(4, args.steps, 5), args.steps - 1})
    width = max(map(len, runs))
    print(f"{'loss at step':>{width}}  " + " ".join(f"{i + 1:>6}" for i in shown))
    for name, run in runs.items():
        print(f"{name:>{width}}  " + " ".join(f"{run.losses[i]:>6.3f}" for i in shown))
    plain = next(iter(runs.values()))
    print(f"\n{'last step, per rank':>{width}}  {'wire bytes':>11}  {'vs plain':>8}  {'across nodes':>12}  "
          f"{'ledger':>9}  {'step ms':>8}  {'final loss':>10}")
    for name, run in runs.items():
        wire = sum(run.sent.values()) / world
        across = sum(v for (a, b), v in run.sent.items() if a // args.node != b // args.node) / world
        change = (run.losses[-1] - plain.losses[-1]) / plain.losses[-1]
        print(f"{name:>{width}}  {wire:>11,.0f}  {wire / (sum(plain.sent.values()) / world):>7.2f}x  "
              f"{across:>12,.0f}  {run.ledger_bytes:>9,.0f}  {1e3 * run.step_s:>8.1f}  "
              f"{run.losses[-1]:>6.3f} ({change:+.1%})")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4, help="ranks to spawn (torchrun: its own)")
    parser.add_argument("--node", type=int, default=2, help="consecutive ranks that share a 'node'")
    parser.add_argument("--steps", type=int, default=40)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    run_ranks(compare, args, args.world)


if __name__ == "__main__":
    main()
