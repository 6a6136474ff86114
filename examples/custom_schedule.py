"""A custom communication schedule: issue every all-gather at the start of the graph.

    torchrun --standalone --nproc-per-node 2 examples/custom_schedule.py [--steps 5] [--compiler eager]
    python examples/custom_schedule.py [--steps 5] [--world-size 2]   # spawns its own ranks

fxshard's default ``prefetch_pass`` issues each all-gather a bounded number of units ahead. A researcher who wants
another policy passes ``schedule=`` to the backend: a function ``schedule(gm, ctx) -> gm`` that runs in place of the
prefetch pass on every lowered forward, backward and inference graph. It may only reorder nodes (the backend
checks that the result holds the same nodes in a valid order), and it must order them the same way on every rank.

``gathers_first`` below is the simplest policy there is: all gathers up front (the most overlap, every gathered
buffer alive at once, so the most memory), every wait left where it was. It finds collectives by their role in
``node.meta["fxshard"]``, never by op names, so it keeps working when the lowering adds casts or copies.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch
import torch.distributed as dist
from torch import fx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import fxshard  # noqa: E402
from examples.models import GPT, GPTConfig  # noqa: E402
from examples.launch import run_ranks  # noqa: E402
from fxshard.passes import PassContext  # noqa: E402
from fxshard.passes.prefetch import reorder  # noqa: E402


def gathers_first(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Move every all-gather, with the copy-in nodes it reads (same unit, a role in meta), to the graph's start."""
    front: list[fx.Node] = []
    for node in gm.graph.nodes:
        meta = node.meta.get("fxshard", {})
        if meta.get("role") != "all_gather":
            continue
        chain, pending = [], [node]
        while pending:  # the gather and its copy-in, in graph order (the inputs are placeholders: shards)
            current = pending.pop()
            chain.append(current)
            pending.extend(a for a in current.all_input_nodes if a.op != "placeholder"
                           and a.meta.get("fxshard", {}).get("unit") == meta["unit"])
        front.extend(sorted(chain, key=list(gm.graph.nodes).index))
    rest = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output") and n not in set(front)]
    return reorder(gm, front + rest)  # reorder() lints: a node before its inputs would fail here


def train(args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, d_model=64)
    model = GPT(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    backend = fxshard.backend(stage=3, schedule=gathers_first, compiler=args.compiler)
    model, optimizer = backend.prepare(model, optimizer)
    step = torch.compile(model, backend=backend, fullgraph=True)
    generator = torch.Generator().manual_seed(rank)
    say = print if rank == 0 else (lambda *a, **k: None)
    for i in range(args.steps):
        tokens = torch.randint(0, config.vocab_size, (8, config.block_size + 1), generator=generator)
        loss = step(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        say(f"step {i}  loss {loss.item():.4f}")
    forward = next(r.final for r in backend.graphs if r.kind == "forward")
    roles = [n.meta.get("fxshard", {}).get("role") for n in forward.graph.nodes]
    first_wait = roles.index("wait")
    say(f"forward graph: {roles.count('all_gather')} all-gathers, all issued before the first wait "
        f"(node {first_wait}): {'all_gather' not in roles[first_wait:]}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--compiler", choices=fxshard.api.COMPILERS, default=fxshard.api.DEFAULT_COMPILER,
                        help="how the rewritten graphs run (default: inductor)")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    run_ranks(train, args, args.world_size)


if __name__ == "__main__":
    main()
