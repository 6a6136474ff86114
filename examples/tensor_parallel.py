"""Tensor parallelism inside, fxshard across: a Llama made tensor-parallel over "tp" and sharded over "dp", trained
beside FSDP2 + TP on the same data (docs/tensor-parallel.md).

    python examples/tensor_parallel.py [--mesh 2x2] [--stage 3] [--steps 6]          # dp x tp, spawns 4 ranks
    python examples/tensor_parallel.py --mesh 2x2x2                                   # replicate x shard x tp
    torchrun --standalone --nproc-per-node 4 examples/tensor_parallel.py --mesh 2x2

Each run builds the model, applies torchtitan's plan with ``parallelize_module`` (Colwise into attention and the MLP,
Rowwise out of them) over the "tp" dimension, then shards it over the data-parallel dimension(s): with fxshard
(``fxshard.backend(stage=..., mesh=mesh["dp"])``, compiled) and with FSDP2 (``fully_shard`` per layer and the model,
eager). Rank 0 prints both runs' losses, the bytes of parameters, gradients and optimizer state this rank holds,
the collectives gloo ran in the last step (whoever asked: fxshard's or FSDP2's dp gathers and reductions, DTensor's
tp all-reduces) with the bytes of their tensors, and the median step time.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import fxshard  # noqa: E402
from examples.launch import run_ranks  # noqa: E402
from examples.models import LlamaConfig, LlamaForCausalLM  # noqa: E402
from examples.benchmark import count_collectives  # noqa: E402

CONFIG = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)
PER_RANK_BATCH, SEQ = 4, 64
KINDS = {"AG": "all-gather", "AR": "all-reduce", "A2A": "all-to-all"}  # gloo's collectives (examples/benchmark.py)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mesh", default="2x2", help="dp x tp (e.g. 2x2) or replicate x shard x tp (e.g. 2x2x2)")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    return parser.parse_args(argv)


def mesh_of(shape: str):
    """The DeviceMesh ``--mesh`` names, and the slice fxshard shards over."""
    sizes = tuple(int(n) for n in shape.lower().split("x"))
    if len(sizes) == 2:
        mesh = init_device_mesh("cpu", sizes, mesh_dim_names=("dp", "tp"))
        return mesh, mesh["dp"]
    if len(sizes) == 3:
        mesh = init_device_mesh("cpu", sizes, mesh_dim_names=("replicate", "shard", "tp"))
        return mesh, mesh["replicate", "shard"]
    raise SystemExit(f"--mesh takes dp x tp or replicate x shard x tp, got {shape}")


def tensor_parallel_plan(model: LlamaForCausalLM) -> dict:
    """torchtitan's plan for a Llama layer: Colwise into attention and the MLP, Rowwise out of them."""
    plan = {}
    for i in range(len(model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    return plan


def tensor_parallel_llama(mesh) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG)
    return parallelize_module(model, mesh["tp"], tensor_parallel_plan(model))


def with_fxshard(mesh, dp_mesh, stage: int):
    model = tensor_parallel_llama(mesh)
    backend = fxshard.backend(stage=stage, mesh=dp_mesh)
    model, opt = backend.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return torch.compile(model, backend=backend, fullgraph=True), model, opt


def with_fsdp2(mesh, dp_mesh):
    from torch.distributed.fsdp import fully_shard

    model = tensor_parallel_llama(mesh)
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model, model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def local_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` on this rank (a DTensor's local piece)."""
    storages = {}
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def train(run, model, opt, dp_rank: int, dp: int, steps: int) -> dict:
    generator = torch.Generator().manual_seed(1)
    losses, times = [], []
    for step in range(steps):
        tokens = torch.randint(CONFIG.vocab_size, (dp * PER_RANK_BATCH, SEQ + 1), generator=generator)
        mine = tokens[dp_rank * PER_RANK_BATCH : (dp_rank + 1) * PER_RANK_BATCH]
        profiled = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
        with profiled if step == steps - 1 else contextlib.nullcontext() as prof:
            start = time.perf_counter()
            loss = run(mine[:, :-1], mine[:, 1:])
            loss.backward()
            grads = local_bytes(p.grad for p in model.parameters() if p.grad is not None)
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - start)
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        losses.append(mean.item())
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    return {"losses": losses, "step_s": statistics.median(times[1:-1]), "parameters": local_bytes(model.parameters()),
            "gradients": grads, "optimizer": local_bytes(state), "collectives": count_collectives(prof)[1]}


def compare(args: argparse.Namespace) -> None:
    mesh, dp_mesh = mesh_of(args.mesh)
    dp_rank, dp = 0, dp_mesh.size()  # this rank's slice of each global batch: its place on the dp dimension(s)
    for coordinate, size in zip(dp_mesh.get_coordinate(), dp_mesh.shape):
        dp_rank = dp_rank * size + coordinate
    runs = {f"fxshard stage {args.stage}": train(*with_fxshard(mesh, dp_mesh, args.stage), dp_rank, dp, args.steps),
            "FSDP2": train(*with_fsdp2(mesh, dp_mesh), dp_rank, dp, args.steps)}
    if dist.get_rank():
        return
    params = sum(math.prod(p.shape) for p in LlamaForCausalLM(CONFIG).parameters())
    print(f"Llama of {params:,} parameters, mesh {args.mesh} ({', '.join(mesh.mesh_dim_names)}), AdamW, "
          f"{PER_RANK_BATCH} x {SEQ} tokens per dp rank")
    for name, run in runs.items():
        print(f"{name:>16}: loss " + " ".join(f"{x:.6f}" for x in run["losses"]))
    print(f"\n{'rank 0':>16}  {'parameters':>12}  {'gradients':>12}  {'optimizer':>12}  {'gloo bytes':>16}  "
          f"{'step ms':>8}")
    for name, run in runs.items():
        moved = sum(nbytes for _, nbytes in run["collectives"].values())
        print(f"{name:>16}  {run['parameters']:>12,}  {run['gradients']:>12,}  {run['optimizer']:>12,}  "
              f"{moved:>16,}  {1e3 * run['step_s']:>8.1f}")
    for name, run in runs.items():
        print(f"{name:>16}: " + ", ".join(f"{KINDS[kind]} {calls} calls {nbytes:,} B"
                                          for kind, (calls, nbytes) in sorted(run["collectives"].items())))


def main(argv=None) -> None:
    args = parse_args(argv)
    world = math.prod(int(n) for n in args.mesh.lower().split("x"))
    run_ranks(compare, args, world)


if __name__ == "__main__":
    main()
