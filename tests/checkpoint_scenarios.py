"""Rank functions of tests/test_checkpoint.py (module level, so that WorkerPool ranks import them).

Every run trains the MLP (``scenarios.build_model("mlp")``: fc1 16 x 8, fc2 5 x 16) with AdamW on one stream of
global batches of 12 rows, each rank its slice, so runs at world sizes 2 and 3 and FSDP2 runs see the same data.
At world 2, fc1's rows split evenly over the ranks (a DTensor's rows are the flat shard) and fc2's 5 rows do not (the
rows cross shard boundaries): both conversions run. At world 3 neither weight splits evenly.
"""

from __future__ import annotations

import os
import pathlib
import weakref

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.checkpoint.state_dict import get_state_dict as torch_get_state_dict
from torch.distributed.checkpoint.state_dict import set_state_dict as torch_set_state_dict
from torch.distributed.tensor import DTensor

import fxshard
from fxshard import checkpoint
from fxshard.testing import rank_and_world
from scenarios import build_model, global_batch, hybrid_mesh, make_optimizer, peak_allocated_bytes

GLOBAL_BATCH = 12
LAYER_WIDTH = 255  # large enough that DCP's own bookkeeping (plans, metadata: ~100 KB) is small beside a weight
STEPS_BEFORE, STEPS_AFTER = 2, 2


def _batches(skip: int = 0):
    rank, world = rank_and_world()
    per_rank = GLOBAL_BATCH // world
    generator = torch.Generator().manual_seed(1)
    for index in range(STEPS_BEFORE + STEPS_AFTER):
        inputs, targets = global_batch("mlp", GLOBAL_BATCH, generator)
        if index >= skip:
            yield inputs[rank * per_rank : (rank + 1) * per_rank], targets[rank * per_rank : (rank + 1) * per_rank]


def _train(run, opt, batches, steps: int) -> list[float]:
    """``steps`` AdamW steps; the loss of each, averaged over the ranks (the global batch's loss)."""
    losses = []
    for _ in range(steps):
        inputs, targets = next(batches)
        loss = F.mse_loss(run(inputs), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        losses.append(mean.item())
    return losses


def _prepared(stage: int, compiled: bool = False, mesh_shape: tuple | None = None):
    torch._dynamo.reset()
    model = build_model("mlp")
    backend = fxshard.backend(compiler="eager", stage=stage, mesh=hybrid_mesh(mesh_shape))
    model, opt = backend.prepare(model, make_optimizer("adamw", model.parameters()))
    run = torch.compile(model, backend=backend, fullgraph=True) if compiled else model
    return backend, model, opt, run


def _fsdp2():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build_model("mlp")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model.fc1, mesh=mesh)
    fully_shard(model.fc2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, make_optimizer("adamw", model.parameters())


def _local_elements(state_dict: dict) -> int:
    return sum(v.to_local().numel() for v in state_dict.values() if isinstance(v, DTensor))


def save_and_continue(directory: str) -> dict:
    """At stage 3 (compiled): train, save the checkpoint three ways (torch's ``get_state_dict`` + ``dcp.save`` under
    ``torch_api``; ``model.state_dict()`` / ``opt.state_dict()`` + ``dcp.save`` under ``plain``;
    ``fxshard.checkpoint.save`` under ``saved``), train on. Then, for each of the first two, prepare afresh (an
    optimizer without state), load it the way it was saved, and train the same steps again."""
    rank, world = rank_and_world()
    root = pathlib.Path(directory)
    backend, model, opt, run = _prepared(3, compiled=True)
    batches = _batches()
    before = _train(run, opt, batches, STEPS_BEFORE)
    model_sd, optim_sd = torch_get_state_dict(run, opt)  # the compiled wrapper, as FSDP2 users pass theirs
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=root / "torch_api")
    ours = checkpoint.get_state_dict(model, opt)
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=root / "plain")
    checkpoint.save(model, opt, root / "saved", extra_state={"step": STEPS_BEFORE})
    full_options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full_model, full_optim = checkpoint.get_state_dict(model, opt, options=full_options)
    every_rank_full_optim = backend.full_optimizer_state_dict()
    layouts = {k: (type(v).__name__, tuple(v.shape), v.to_local().shape[0] if isinstance(v, DTensor) else None)
               for k, v in model_sd.items()}
    same_as_torch = (
        model_sd.keys() == ours[0].keys()
        and all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(model_sd.values(), ours[0].values()))
        and optim_sd["state"].keys() == ours[1]["state"].keys()
        and optim_sd["param_groups"] == ours[1]["param_groups"]
    )
    after = _train(run, opt, batches, STEPS_AFTER)

    # resumed from model.state_dict() / opt.state_dict() templates of a fresh prepare
    _, fresh_model, fresh_opt, fresh_run = _prepared(3)
    template = {"model": fresh_model.state_dict(), "optim": fresh_opt.state_dict()}
    state_after_template = len(fresh_opt.state)  # the template asked for state without adding any
    dcp.load(template, checkpoint_id=root / "plain")
    fresh_model.load_state_dict(template["model"])
    fresh_opt.load_state_dict(template["optim"])
    resumed_plain = _train(fresh_run, fresh_opt, _batches(skip=STEPS_BEFORE), STEPS_AFTER)

    # resumed the FSDP2 way: torch's get_state_dict template, dcp.load, torch's set_state_dict
    _, fresh_model, fresh_opt, fresh_run = _prepared(3)
    model_template, optim_template = torch_get_state_dict(fresh_model, fresh_opt)
    dcp.load({"model": model_template, "optim": optim_template}, checkpoint_id=root / "torch_api")
    torch_set_state_dict(fresh_model, fresh_opt, model_state_dict=model_template, optim_state_dict=optim_template)
    resumed_torch_api = _train(fresh_run, fresh_opt, _batches(skip=STEPS_BEFORE), STEPS_AFTER)

    # resumed with fxshard.checkpoint.load
    _, fresh_model, fresh_opt, fresh_run = _prepared(3)
    extra = checkpoint.load(fresh_model, fresh_opt, root / "saved")
    resumed_saved = _train(fresh_run, fresh_opt, _batches(skip=STEPS_BEFORE), STEPS_AFTER)
    return {
        "before": before, "after": after, "resumed_plain": resumed_plain, "resumed_torch_api": resumed_torch_api,
        "resumed_saved": resumed_saved, "extra": extra, "layouts": layouts, "same_as_torch": same_as_torch,
        "state_after_template": state_after_template,
        "full_model": full_model, "full_optim": full_optim, "every_rank_full_optim": every_rank_full_optim,
        "local_model_elements": _local_elements(model_sd),
    }


def resume_at_stage(directory: str, stage: int) -> dict:
    """Load the world-2 stage-3 checkpoints into a fresh prepare for ``stage`` at this world size and train on:
    ``torch_api`` through fxshard.checkpoint.load (any stage, stage 1 included), ``plain`` through
    ``dcp.load(model.state_dict(), opt.state_dict())``; then the misuses, each refused before anything changed."""
    root = pathlib.Path(directory)
    _, model, opt, run = _prepared(stage)
    checkpoint.load(model, opt, root / "torch_api")
    through_load = _train(run, opt, _batches(skip=STEPS_BEFORE), STEPS_AFTER)

    _, model, opt, run = _prepared(stage)
    template = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(template, checkpoint_id=root / "plain")
    model.load_state_dict(template["model"])
    opt.load_state_dict(template["optim"])
    through_plain = _train(run, opt, _batches(skip=STEPS_BEFORE), STEPS_AFTER)
    return {"through_load": through_load, "through_plain": through_plain}


def resume_on_a_mesh(directory: str, stage: int, mesh_shape: tuple) -> dict:
    """On a hybrid mesh: load the world-2 stage-3 checkpoint (``torch_api``) and train on; then save this run's
    own checkpoint after those steps, load it into a fresh prepare on the same mesh and train on from both."""
    root = pathlib.Path(directory)
    _, model, opt, run = _prepared(stage, mesh_shape=mesh_shape)
    checkpoint.load(model, opt, root / "torch_api")
    batches = _batches(skip=STEPS_BEFORE)
    resharded = _train(run, opt, batches, 1)
    checkpoint.save(model, opt, root / f"mesh_stage_{stage}")
    continued = _train(run, opt, batches, 1)
    _, fresh_model, fresh_opt, fresh_run = _prepared(stage, mesh_shape=mesh_shape)
    checkpoint.load(fresh_model, fresh_opt, root / f"mesh_stage_{stage}")
    resumed = _train(fresh_run, fresh_opt, _batches(skip=STEPS_BEFORE + 1), 1)

    gathers, gather = [], dist.gather  # the full state dict: gathered by the first rank's shard group alone
    dist.gather = lambda *args, **kwargs: gathers.append(1) or gather(*args, **kwargs)
    try:
        full_model, _ = checkpoint.get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
                                                                                       cpu_offload=True))
    finally:
        dist.gather = gather
    expected = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    full_is_exact = bool(full_model) and all(torch.equal(full_model[k], v) for k, v in expected.items())
    return {"resharded": resharded + continued, "continued": continued, "resumed": resumed,
            "full_state_dict": "exact" if full_is_exact else ("empty" if not full_model else "wrong"),
            "gathers": len(gathers)}


def misuse_is_refused(directory: str) -> dict:
    """Loading a checkpoint of another model, or one with a shard file gone, raises FxShardError before the model or
    the optimizer changed."""
    root = pathlib.Path(directory)
    errors = {}
    torch._dynamo.reset()
    other = build_model("mlp_uneven")
    backend = fxshard.backend(compiler="eager", stage=3)
    other, other_opt = backend.prepare(other, make_optimizer("adamw", other.parameters()))
    before = [p.detach().clone() for p in other.parameters()]
    try:
        checkpoint.load(other, other_opt, root / "torch_api")
    except fxshard.FxShardError as error:
        errors["other model"] = str(error)
    try:
        checkpoint.set_state_dict(other, other_opt, model_state_dict={"fc1.weight": torch.zeros(3)},
                                  optim_state_dict={"state": {}, "param_groups": []})
    except fxshard.FxShardError as error:
        errors["other state dict"] = str(error)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, other.parameters())) and not other_opt.state

    _, model, opt, _ = _prepared(3)
    before = [p.detach().clone() for p in model.parameters()]
    damaged = root / "damaged"
    if rank_and_world()[0] == 0:
        import shutil

        shutil.copytree(root / "saved", damaged)
        os.remove(damaged / "__1_0.distcp")
    dist.barrier()
    try:
        checkpoint.load(model, opt, damaged)
    except fxshard.FxShardError as error:
        errors["missing shard"] = str(error)
    unchanged = unchanged and all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and not opt.state
    return {"errors": errors, "unchanged": unchanged}


def fsdp2_interop(directory: str) -> dict:
    """FSDP2 <-> fxshard through DCP: FSDP2 trains and saves (get_state_dict + dcp.save), trains on; fxshard stage 1
    loads FSDP2's checkpoint and trains the same steps; FSDP2 loads fxshard's stage-3 checkpoint (get_state_dict
    template, dcp.load, set_state_dict) and trains the same steps."""
    root = pathlib.Path(directory)
    model, opt = _fsdp2()
    batches = _batches()
    fsdp2_before = _train(model, opt, batches, STEPS_BEFORE)
    model_sd, optim_sd = torch_get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=root / "fsdp2")
    fsdp2_after = _train(model, opt, batches, STEPS_AFTER)

    _, fx_model, fx_opt, fx_run = _prepared(1)
    checkpoint.load(fx_model, fx_opt, root / "fsdp2")
    fxshard_from_fsdp2 = _train(fx_run, fx_opt, _batches(skip=STEPS_BEFORE), STEPS_AFTER)

    model, opt = _fsdp2()
    model_template, optim_template = torch_get_state_dict(model, opt)
    dcp.load({"model": model_template, "optim": optim_template}, checkpoint_id=root / "torch_api")
    torch_set_state_dict(model, opt, model_state_dict=model_template, optim_state_dict=optim_template)
    fsdp2_from_fxshard = _train(model, opt, _batches(skip=STEPS_BEFORE), STEPS_AFTER)
    return {"fsdp2_before": fsdp2_before, "fsdp2_after": fsdp2_after, "fxshard_from_fsdp2": fxshard_from_fsdp2,
            "fsdp2_from_fxshard": fsdp2_from_fxshard}


def _model_for_memory(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "layers":  # 8 layers whose 255 rows split unevenly over 2 ranks: every weight is gathered
        return torch.nn.Sequential(*[torch.nn.Linear(LAYER_WIDTH, LAYER_WIDTH) for _ in range(8)])
    from examples.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, d_model=64))  # train_gpt.py's


def peak_during_save(directory: str, model_name: str = "layers") -> dict:
    """Stage 3, one AdamW step (so the optimizer has its state), then the peak bytes allocated during
    ``fxshard.checkpoint.save``, beside the bytes of the largest parameter, of this rank's shards (parameters and
    optimizer state) and of the whole model and optimizer state in full."""
    from fxshard.prepare import spec_of

    rank, world = rank_and_world()
    torch._dynamo.reset()
    model = _model_for_memory(model_name)
    backend = fxshard.backend(compiler="eager", stage=3)
    model, opt = backend.prepare(model, make_optimizer("adamw", model.parameters()))
    if model_name == "layers":
        model(torch.randn(4, LAYER_WIDTH)).square().mean().backward()
    else:
        model(torch.randint(0, 128, (2, 32)), torch.randint(0, 128, (2, 32))).backward()
    opt.step()
    opt.zero_grad()
    gathered = {"made": 0, "alive": 0, "most_alive": 0}
    gather_full = checkpoint.gather_full

    def counted_gather_full(*args, **kwargs):  # every full tensor the save gathers, and how many live at once
        full = gather_full(*args, **kwargs)
        gathered["made"] += 1
        gathered["alive"] += 1
        gathered["most_alive"] = max(gathered["most_alive"], gathered["alive"])
        weakref.finalize(full, gathered.__setitem__, "alive", gathered["alive"] - 1)
        return full

    checkpoint.gather_full = counted_gather_full
    try:
        peak = peak_allocated_bytes(lambda: checkpoint.save(model, opt, pathlib.Path(directory) / model_name))
    finally:
        checkpoint.gather_full = gather_full
    specs = [spec_of(p) for p in model.parameters()]
    kinds = 1 + sum(1 for v in next(iter(opt.state.values())).values() if v.dim())  # the parameter + its states
    return {
        "gathered": gathered["made"],
        "most_gathered_at_once": gathered["most_alive"],
        "uneven_tensors": kinds * sum(1 for s in specs if not checkpoint.rows_are_shard(s)),
        "peak": peak,
        "largest_parameter": max(s.numel for s in specs) * 4,
        "local": kinds * sum(s.chunk for s in specs) * 4,
        "full": kinds * sum(s.numel for s in specs) * 4,
    }
