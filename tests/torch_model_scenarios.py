"""Models as users bring them to torch.compile (dropout, activation checkpointing, HuggingFace architectures), run
on every rank of a WorkerPool against what DDP would compute."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

import fxshard
from examples.model_zoo import zoo_batch, zoo_model
from fxshard.testing import rank_and_world
from scenarios import full_state

SGD_LR = 0.1


class DropoutNet(nn.Module):
    """Dropout in forward and inside an activation-checkpointed block, whose backward recomputes it."""

    def __init__(self, p: float = 0.3):
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.drop = nn.Dropout(p)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Dropout(p), nn.Linear(32, 32))
        self.out = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.inp(x)))
        h = h + torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False)
        return self.out(h)


def _average_grads(model: nn.Module) -> None:
    """What DDP does to a backward's gradients."""
    for param in model.parameters():
        dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)


def _train_with_dropout(net, optimizer, sync, steps: int) -> list[float]:
    """``steps`` SGD steps on the same batches on every rank, each rank's generator seeded apart before each forward
    (so the masks alone tell the ranks apart); ``sync`` averages the gradients, where the model does not itself."""
    rank, _ = rank_and_world()
    generator = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        inputs, targets = torch.randn(4, 8, generator=generator), torch.randn(4, 5, generator=generator)
        torch.manual_seed(1000 * step + rank)
        loss = F.mse_loss(net(inputs), targets)
        loss.backward()
        sync()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def dropout_against_ddp(stages: tuple[int, ...], steps: int = 3) -> dict:
    """DropoutNet under fxshard's default compiler (Inductor) at each of ``stages``, beside one copy compiled by
    plain ``torch.compile`` whose gradients are averaged as DDP averages them, on the same batches and seeds.
    Returns the reference's losses and parameters, and per stage fxshard's."""
    torch.manual_seed(0)
    initial = DropoutNet()
    reference = copy.deepcopy(initial)
    reference_losses = _train_with_dropout(torch.compile(reference), torch.optim.SGD(reference.parameters(),
                                                                                        lr=SGD_LR),
                                           lambda: _average_grads(reference), steps)
    runs = {}
    for stage in stages:
        torch._dynamo.reset()
        backend = fxshard.backend(stage=stage)
        model = copy.deepcopy(initial)
        model, opt = backend.prepare(model, torch.optim.SGD(model.parameters(), lr=SGD_LR))
        losses = _train_with_dropout(torch.compile(model, backend=backend, fullgraph=True), opt, lambda: None, steps)
        runs[stage] = {"losses": losses, "final": full_state(model),
                       "compiled_graphs": sorted({(r.graph_id, r.kind) for r in backend.graphs})}
    return {"reference_losses": reference_losses, "expected": reference.state_dict(), "stages": runs}


# --- the HuggingFace zoo (examples/model_zoo.py) ------------------------------------------------------------------


def _local(batch: dict, rank: int, per_rank: int) -> dict:
    return {k: v[rank * per_rank:(rank + 1) * per_rank] for k, v in batch.items()}


def zoo_against_single_process(name: str, stages: tuple[int, ...], steps: int = 2) -> dict:
    """Each stage of ``stages`` trains a tiny ``name`` model without dropout, compiled op by op, with SGD on this
    rank's part of each global batch, beside one process that sees the whole batch. Returns per stage the full
    parameters after and the reference's."""
    import transformers

    rank, world = rank_and_world()
    per_rank = 2
    # transformers' logger.warning_once (GPT-2 given labels=) would break fullgraph=True: Dynamo's limit, not ours
    torch._dynamo.config.ignore_logging_functions.add(transformers.utils.logging.warning_once)
    results = {}
    for stage in stages:
        torch._dynamo.reset()
        model = zoo_model(name, dropout=False)
        reference = copy.deepcopy(model)
        reference_opt = torch.optim.SGD(reference.parameters(), lr=SGD_LR)
        backend = fxshard.backend(stage=stage, compiler="eager")
        model, opt = backend.prepare(model, torch.optim.SGD(model.parameters(), lr=SGD_LR))
        run = torch.compile(model, backend=backend, fullgraph=True)
        generator = torch.Generator().manual_seed(1)
        for _ in range(steps):
            batch = zoo_batch(name, per_rank * world, generator)
            run(**_local(batch, rank, per_rank)).loss.backward()
            opt.step()
            opt.zero_grad()
            reference(**batch).loss.backward()
            reference_opt.step()
            reference_opt.zero_grad()
        results[stage] = {"final": full_state(model), "expected": reference.state_dict()}
    return results
