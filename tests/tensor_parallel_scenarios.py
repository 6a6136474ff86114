"""Tensor parallelism beside fxshard, on 4 gloo ranks as a (dp=2, tp=2) mesh: functions every rank of a WorkerPool
runs. The tensor-parallel plans are torchtitan's: Colwise into a block, Rowwise out of it."""

from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fxshard
from examples.models import LlamaConfig, LlamaForCausalLM
from scenarios import LR, PER_RANK_BATCH, build_model, full_state, global_batch, loss_of, make_optimizer

MESH = (2, 2)  # (dp, tp)


def _llama_plan(model) -> dict:
    plan = {}
    for i, _ in enumerate(model.layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    return plan


def _model(name: str) -> torch.nn.Module:
    if name == "llama":
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig())
    return build_model(name)


def _plan(name: str, model) -> dict:
    return _llama_plan(model) if name == "llama" else {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


def _batch(name: str, size: int, generator: torch.Generator):
    if name == "llama":
        config = LlamaConfig()
        tokens = torch.randint(config.vocab_size, (size, 9), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]
    return global_batch(name, size, generator)


def _loss(name: str, model, batch) -> torch.Tensor:
    if name == "llama":
        return model(*batch)
    return loss_of(name, model, batch)


def layout_of(value) -> tuple:
    """How a state dict holds one tensor: (placements, mesh dimension names, local shape), or ("plain", shape)."""
    if isinstance(value, DTensor):
        return tuple(str(p) for p in value.placements), value.device_mesh.mesh_dim_names, tuple(value.to_local().shape)
    return "plain", tuple(value.shape)


def train_against_reference(model_name: str, optimizer: str, stage: int, steps: int = 3,
                            clip: float | None = None, compiled: bool = True) -> dict:
    """A model made tensor-parallel over "tp" (``parallelize_module``) and prepared over "dp", trained on its dp
    rank's slice of each global batch beside one process on the whole batch; both models' full parameters, the
    clip norms, the graphs compiled and how the state dicts hold each tensor."""
    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("dp", "tp"))
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    model = _model(model_name)
    reference = copy.deepcopy(model)
    reference_opt = make_optimizer(optimizer, reference.parameters())
    model = parallelize_module(model, mesh["tp"], _plan(model_name, model))
    backend = fxshard.backend(stage=stage, compiler="eager", mesh=mesh["dp"])
    model, opt = backend.prepare(model, make_optimizer(optimizer, model.parameters()))
    run = torch.compile(model, backend=backend, fullgraph=True) if compiled else model
    generator = torch.Generator().manual_seed(1)
    norms, reference_norms = [], []
    for _ in range(steps):
        batch = _batch(model_name, dp * PER_RANK_BATCH, generator)
        local = tuple(t[dp_rank * PER_RANK_BATCH : (dp_rank + 1) * PER_RANK_BATCH] for t in batch)
        _loss(model_name, run, local).backward()
        if clip is not None:
            norms.append(backend.clip_grad_norm_(clip).item())
        opt.step()
        opt.zero_grad()
        _loss(model_name, reference, batch).backward()
        if clip is not None:
            reference_norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), clip).item())
        reference_opt.step()
        reference_opt.zero_grad()
    return {
        "final": full_state(model),
        "expected": reference.state_dict(),
        "norms": norms,
        "reference_norms": reference_norms,
        "compiled_graphs": sorted({(r.graph_id, r.kind) for r in backend.graphs}),
        "model_layout": {k: layout_of(v) for k, v in model.state_dict().items()},
        "optimizer_layout": {k: layout_of(v) for k, v in opt.state_dict()["state"][0].items()},
        "lr": LR[optimizer],
    }
