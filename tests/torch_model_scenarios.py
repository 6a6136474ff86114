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


def dropout_against_ddp(stage: int, steps: int = 3) -> dict:
    """DropoutNet under fxshard's default compiler (Inductor) beside a copy compiled by plain ``torch.compile`` whose
    gradients are averaged as DDP averages them. Each rank seeds its generator with its own seed before each
    forward of either model, and both read the same batch on every rank, so the masks alone tell the ranks apart."""
    rank, _ = rank_and_world()
    torch.manual_seed(0)
    model = DropoutNet()
    reference = copy.deepcopy(model)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=SGD_LR)
    reference_run = torch.compile(reference)
    backend = fxshard.backend(stage=stage)
    model, opt = backend.prepare(model, torch.optim.SGD(model.parameters(), lr=SGD_LR))
    run = torch.compile(model, backend=backend, fullgraph=True)
    generator = torch.Generator().manual_seed(1)
    losses, reference_losses = [], []
    for step in range(steps):
        inputs, targets = torch.randn(4, 8, generator=generator), torch.randn(4, 5, generator=generator)
        for net, optimizer, record, sync in ((run, opt, losses, None), (reference_run, reference_opt,
                                                                         reference_losses, _average_grads)):
            torch.manual_seed(1000 * step + rank)
            loss = F.mse_loss(net(inputs), targets)
            loss.backward()
            if sync is not None:
                sync(reference)
            optimizer.step()
            optimizer.zero_grad()
            record.append(loss.item())
    return {"losses": losses, "reference_losses": reference_losses, "final": full_state(model),
            "expected": reference.state_dict(), "compiled_graphs": sorted({(r.graph_id, r.kind)
                                                                           for r in backend.graphs})}


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
