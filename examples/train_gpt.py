"""Train the small GPT on 2 gloo ranks with ZeRO-3 through torch.compile, and print what the compiler did.

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py [--steps 20] [--stage 3]
    python examples/train_gpt.py [--steps 20] [--world-size 2] [--stage 3]   # spawns its own ranks
    python examples/train_gpt.py --checkpoint-dir ckpt --checkpoint-every 10 [--resume]
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --mesh 2x2   # hybrid: 2 replicas of 2 shards

Each rank trains on its own slice of every global batch of a character-level corpus; parameters, gradients and
AdamW state live as flat shards. Rank 0 prints the loss per step (9 significant digits: the exact float32 value),
then the rewritten graphs' collectives.

With ``--checkpoint-dir DIR`` every ``--checkpoint-every`` steps go to ``DIR/step_<N>`` (``fxshard.checkpoint.save``:
each rank writes its shards; the directory appears only once complete). ``--resume`` continues from the newest
complete checkpoint there, at any world size and stage; at the same ones it continues exactly as the run that
wrote it did, also after that run was killed in the middle of a later save.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import fxshard  # noqa: E402
import fxshard.checkpoint  # noqa: E402
from examples.launch import run_ranks  # noqa: E402
from examples.models import GPT, GPTConfig  # noqa: E402

CORPUS = (
    "fxshard rewrites the training step of a plain model into a sharded one. "
    "it gathers each layer before its matmuls and scatters its gradients after. "
    "the optimizer sees only shards, so memory per rank shrinks with the world size. "
) * 8


def batches(config: GPTConfig, per_rank: int, rank: int, world_size: int, generator: torch.Generator):
    """Endless (inputs, targets) of this rank's slice of each global batch of random corpus windows."""
    data = torch.tensor([ord(c) % config.vocab_size for c in CORPUS])
    while True:
        starts = torch.randint(0, len(data) - config.block_size - 1, (per_rank * world_size,), generator=generator)
        mine = starts[rank * per_rank : (rank + 1) * per_rank]
        windows = torch.stack([data[s : s + config.block_size + 1] for s in mine.tolist()])
        yield windows[:, :-1], windows[:, 1:]


def hybrid_mesh(shape: str | None, world_size: int):
    """``--mesh RxS``: a 2-D mesh of R replicas of S-rank shard groups (docs/hybrid-sharding.md), or None."""
    if shape is None:
        return None
    replicas, shards = (int(n) for n in shape.lower().split("x"))
    if replicas * shards != world_size:
        raise SystemExit(f"--mesh {shape} needs {replicas * shards} ranks, got {world_size}")
    return init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))


def train(args: argparse.Namespace) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank
    config = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, d_model=64)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)

    backend = fxshard.backend(stage=args.stage, mesh=hybrid_mesh(args.mesh, world_size), compiler=args.compiler)
    model, optimizer = backend.prepare(model, optimizer)
    step = model if args.eager else torch.compile(model, backend=backend, fullgraph=True)

    generator = torch.Generator().manual_seed(1)
    data = batches(config, args.batch_size, rank, world_size, generator)
    say = print if rank == 0 else (lambda *a, **k: None)
    layout = f" as a {args.mesh} mesh (replicas x shard group)" if args.mesh else ""
    say(f"training GPT ({sum(p.numel() for p in GPT(config).parameters()):,} parameters) on {world_size} gloo "
        f"ranks{layout}, ZeRO stage {args.stage}", flush=True)
    first_step = 0
    newest = fxshard.checkpoint.latest(args.checkpoint_dir) if args.resume and args.checkpoint_dir else None
    if newest is not None:
        extra = fxshard.checkpoint.load(model, optimizer, newest)
        first_step = extra["step"]
        generator.set_state(extra["data"])  # the next batch is the one the saved run drew next
        say(f"resumed from {newest} at step {first_step}", flush=True)
    for i in range(first_step, args.steps):
        start = time.perf_counter()
        loss = step(*next(data))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
        say(f"step {i:3d}  loss {mean_loss.item():.9g}  {1000 * (time.perf_counter() - start):7.1f} ms", flush=True)
        if args.checkpoint_dir and (i + 1) % args.checkpoint_every == 0:
            fxshard.checkpoint.save(model, optimizer, args.checkpoint_dir / f"step_{i + 1:06d}",
                                    extra_state={"step": i + 1, "data": generator.get_state()})
    say("\nrewritten graphs (rank 0):")
    say(backend.report())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--mesh", help="hybrid sharding: RxS, R replicas of S-rank shard groups (R*S ranks)")
    parser.add_argument("--compiler", choices=fxshard.api.COMPILERS, default=fxshard.api.DEFAULT_COMPILER,
                        help="how the rewritten graphs run (default: inductor)")
    parser.add_argument("--eager", action="store_true", help="run the prepared model without torch.compile")
    parser.add_argument("--checkpoint-dir", type=pathlib.Path, help="save checkpoints into DIR/step_<N>")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    run_ranks(train, args, args.world_size)


if __name__ == "__main__":
    main()
