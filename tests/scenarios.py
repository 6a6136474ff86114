"""Functions that run on every rank of a WorkerPool (module level so spawned ranks can import them)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import fxshard
from examples.models import GPT, MLP, GPTConfig, gpt_batch
from fxshard.testing import rank_and_world

PER_RANK_BATCH = 4
LR = {"sgd": 0.05, "adamw": 1e-2}


def build_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        return MLP()
    if name == "gpt":
        return GPT(GPTConfig())
    if name == "mlp_uneven":  # shapes that no world size of 2 or 3 divides
        return MLP(d_in=7, d_hidden=11, d_out=5)
    raise ValueError(name)


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=LR["sgd"], momentum=0.9)
    return torch.optim.AdamW(params, lr=LR["adamw"], weight_decay=0.1)


def global_batch(model_name: str, size: int, generator: torch.Generator):
    if model_name == "gpt":
        return gpt_batch(GPTConfig(), size, generator)
    d_in = 7 if model_name == "mlp_uneven" else 8
    return torch.randn(size, d_in, generator=generator), torch.randn(size, 5, generator=generator)


def loss_of(model_name: str, model, batch) -> torch.Tensor:
    if model_name == "gpt":
        return model(*batch)
    inputs, targets = batch
    return F.mse_loss(model(inputs), targets)


def train_against_reference(model_name: str, optimizer: str, steps: int = 5, compiled: bool = True) -> dict:
    """Train a prepared model (this rank's slice of each global batch) beside a single-process reference that
    sees the whole global batch; return both models' full parameters before and after."""
    rank, world = rank_and_world()
    model = build_model(model_name)
    reference = copy.deepcopy(model)
    initial = {k: v.clone() for k, v in reference.state_dict().items()}
    reference_opt = make_optimizer(optimizer, reference.parameters())
    backend = fxshard.backend(stage=3)
    model, opt = backend.prepare(model, make_optimizer(optimizer, model.parameters()))
    run = torch.compile(model, backend=backend, fullgraph=True) if compiled else model
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        batch = global_batch(model_name, world * PER_RANK_BATCH, generator)
        local = tuple(t[rank * PER_RANK_BATCH : (rank + 1) * PER_RANK_BATCH] for t in batch)
        loss_of(model_name, run, local).backward()
        opt.step()
        opt.zero_grad()
        loss_of(model_name, reference, batch).backward()
        reference_opt.step()
        reference_opt.zero_grad()
    return {
        "initial": initial,
        "final": model.state_dict(),
        "expected": reference.state_dict(),
        "compiled_graphs": sorted({(r.graph_id, r.kind) for r in backend.graphs}),
    }
