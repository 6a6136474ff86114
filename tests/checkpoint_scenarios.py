"""Rank functions of tests/test_checkpoint.py (module level, so that WorkerPool ranks import them).

Every run trains the MLP (``scenarios.build_model("mlp")``: fc1 16 x 8, fc2 5 x 16) with AdamW on one stream of
global batches of 12 rows, each rank its slice, so runs at world sizes 2 and 3 and FSDP2 runs see the same data.
At world 2, fc1's rows split evenly over the ranks (a DTensor's rows are the flat shard) and fc2's 5 rows do not (the
rows cross shard boundaries): both conversions run. At world 3 neither weight splits evenly (16 rows: 6 / 6 / 4; 5
rows: 2 / 2 / 1); the biases, 1-D, are views of the flat shards at every world size.

The tests save at world 2 and at world 3 and load each checkpoint at the other, so every function here runs at both.
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
from fxshard.runtime import layout
from fxshard.runtime.layout import gather_full
from fxshard.runtime.param import prepared_param, spec_of
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


def _layout(value, flat: torch.Tensor | None = None) -> dict:
    """How a state dict holds one tensor: a DTensor's full shape, placements, mesh size, local shape, and whether its
    local tensor shares storage with ``flat`` (the flat shard it was made from)."""
    if not isinstance(value, DTensor):
        return {"type": type(value).__name__, "shape": tuple(value.shape)}
    local = value.to_local()
    shares = flat is not None and local.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    return {"type": "DTensor", "shape": tuple(value.shape), "placements": tuple(value.placements),
            "mesh_size": value.device_mesh.size(), "local_shape": tuple(local.shape), "view_of_shard": shares}


def _layouts(model, opt, model_sd: dict, optim_sd: dict) -> tuple[dict, dict]:
    """``_layout`` of every entry of ``model.state_dict()`` and of ``opt.state_dict()`` (as ``name.kind``), each
    beside the flat shard (parameter, optimizer state) it was made from."""
    shards = {name: p if prepared_param(p).flat is None else prepared_param(p).flat  # stages 2, 3: under the rows
              for name, p in model.named_parameters()}
    updated = [p for group in opt.param_groups for p in group["params"]]
    model_layout = {k: _layout(v, shards.get(k)) for k, v in model_sd.items()}
    optim_layout = {f"{spec_of(updated[key]).name}.{kind}": _layout(value, opt.state[updated[key]][kind])
                    for key, kinds in optim_sd["state"].items() for kind, value in kinds.items()}
    return model_layout, optim_layout


def _gathered_from_flat_shards(model) -> dict:
    """Every parameter's full value gathered straight from its flat shard (not through a state dict): what a single
    process training the same steps holds. A collective."""
    return {name: gather_full(shard, spec_of(shard)) for name, shard in model.named_parameters()}


def save_and_continue(directory: str) -> dict:
    """At stage 3 (compiled): train, save the checkpoint three ways (torch's ``get_state_dict`` + ``dcp.save`` under
    ``torch_api``; ``model.state_dict()`` / ``opt.state_dict()`` + ``dcp.save`` under ``plain``;
    ``fxshard.checkpoint.save`` under ``saved``), train on. Then, for each of the first two, prepare afresh (an
    optimizer without state), load it the way it was saved, and train the same steps again."""
    root = pathlib.Path(directory)
    full_options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    backend, model, opt, run = _prepared(3, compiled=True)
    initial_full_model, _ = checkpoint.get_state_dict(model, opt, options=full_options)
    batches = _batches()
    before = _train(run, opt, batches, STEPS_BEFORE)
    model_sd, optim_sd = torch_get_state_dict(run, opt)  # the compiled wrapper, as FSDP2 users pass theirs
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=root / "torch_api")
    ours = checkpoint.get_state_dict(model, opt)
    plain_model, plain_optim = model.state_dict(), opt.state_dict()
    model_layout, optim_layout = _layouts(model, opt, plain_model, plain_optim)
    dcp.save({"model": plain_model, "optim": plain_optim}, checkpoint_id=root / "plain")
    del plain_model, plain_optim
    checkpoint.save(model, opt, root / "saved", extra_state={"step": STEPS_BEFORE})
    full_model, full_optim = checkpoint.get_state_dict(model, opt, options=full_options)
    every_rank_full_optim = backend.full_optimizer_state_dict()
    gathered_model = _gathered_from_flat_shards(model)
    same_as_torch = _same_state_dicts((model_sd, optim_sd), ours)
    after = _train(run, opt, batches, STEPS_AFTER)

    # resumed from model.state_dict() / opt.state_dict() templates of a fresh prepare
    _, fresh_model, fresh_opt, fresh_run = _prepared(3)
    template = {"model": fresh_model.state_dict(), "optim": fresh_opt.state_dict()}
    state_after_template = len(fresh_opt.state)  # the template asked for state without adding any
    dcp.load(template, checkpoint_id=root / "plain")
    fresh_model.load_state_dict(template["model"])
    fresh_opt.load_state_dict(template["optim"])
    resumed_plain = _train(fresh_run, fresh_opt, _batches(skip=STEPS_BEFORE), STEPS_AFTER)

    resumed_torch_api = _resumed_through_torch_api(3, root / "torch_api")

    # resumed with fxshard.checkpoint.load
    _, fresh_model, fresh_opt, fresh_run = _prepared(3)
    extra = checkpoint.load(fresh_model, fresh_opt, root / "saved")
    resumed_saved = _train(fresh_run, fresh_opt, _batches(skip=STEPS_BEFORE), STEPS_AFTER)
    return {
        "before": before, "after": after, "resumed_plain": resumed_plain, "resumed_torch_api": resumed_torch_api,
        "resumed_saved": resumed_saved, "extra": extra, "same_as_torch": same_as_torch,
        "model_layout": model_layout, "optim_layout": optim_layout, "state_after_template": state_after_template,
        "full_model": full_model, "full_optim": full_optim, "every_rank_full_optim": every_rank_full_optim,
        "initial_full_model": initial_full_model, "single_process_initial": build_model("mlp").state_dict(),
        "gathered_model": gathered_model, "local_model_elements": _local_elements(model_sd),
    }


def _same_state_dicts(torchs: tuple[dict, dict], ours: tuple[dict, dict]) -> bool:
    """torch's ``get_state_dict`` and ``fxshard.checkpoint.get_state_dict`` agree: the same keys, groups and values
    (DTensors compared in full: a collective)."""

    def full(value):
        return value.full_tensor() if isinstance(value, DTensor) else value

    def equal(a, b) -> bool:
        return torch.equal(full(a), full(b)) if torch.is_tensor(a) else a == b

    (model_sd, optim_sd), (our_model, our_optim) = torchs, ours
    return (
        model_sd.keys() == our_model.keys() and all(equal(model_sd[k], our_model[k]) for k in model_sd)
        and optim_sd["param_groups"] == our_optim["param_groups"]
        and optim_sd["state"].keys() == our_optim["state"].keys()
        and all(kinds.keys() == our_optim["state"][name].keys()
                and all(equal(value, our_optim["state"][name][kind]) for kind, value in kinds.items())
                for name, kinds in optim_sd["state"].items())
    )


def save_at_stages(directory: str, stages: tuple[int, ...] = (0, 1, 2)) -> dict:
    """For each stage: train, save twice (``model.state_dict()`` / ``opt.state_dict()`` + ``dcp.save`` into
    ``plain_stage_<s>``; torch's ``get_state_dict`` + ``dcp.save`` into ``named_stage_<s>``, checked against
    ``fxshard.checkpoint.get_state_dict``), train on; then prepare afresh at the same stage, load each the way it was
    saved (the second FSDP2's way: torch's ``get_state_dict`` template, ``dcp.load``, torch's ``set_state_dict``)
    and train the same steps again."""
    root = pathlib.Path(directory)
    results = {}
    for stage in stages:
        _, model, opt, run = _prepared(stage)
        batches = _batches()
        _train(run, opt, batches, STEPS_BEFORE)
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=root / f"plain_stage_{stage}")
        model_sd, optim_sd = torch_get_state_dict(model, opt)
        same_as_ours = _same_state_dicts((model_sd, optim_sd), checkpoint.get_state_dict(model, opt))
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=root / f"named_stage_{stage}")
        del model_sd, optim_sd
        after = _train(run, opt, batches, STEPS_AFTER)

        resumed_plain = _resumed_through_dcp(stage, root / f"plain_stage_{stage}")
        resumed_named = _resumed_through_torch_api(stage, root / f"named_stage_{stage}")
        results[stage] = {"after": after, "resumed_plain": resumed_plain, "resumed_named": resumed_named,
                          "same_as_ours": same_as_ours}
    return results


def _resumed_through_torch_api(stage: int, checkpoint_id) -> list:
    """A fresh prepare at ``stage`` loads ``checkpoint_id`` FSDP2's way (torch's ``get_state_dict`` as the template,
    ``dcp.load``, torch's ``set_state_dict``), then trains on: the losses."""
    _, model, opt, run = _prepared(stage)
    model_sd, optim_sd = torch_get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint_id)
    torch_set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return _train(run, opt, _batches(skip=STEPS_BEFORE), STEPS_AFTER)


def _resumed_through_dcp(stage: int, checkpoint_id) -> list:
    """A fresh prepare at ``stage`` loads ``checkpoint_id`` through ``dcp.load`` into ``model.state_dict()`` and
    ``opt.state_dict()``, then trains on: the losses."""
    _, model, opt, run = _prepared(stage)
    template = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(template, checkpoint_id=checkpoint_id)
    model.load_state_dict(template["model"])
    opt.load_state_dict(template["optim"])
    return _train(run, opt, _batches(skip=STEPS_BEFORE), STEPS_AFTER)


# The stage-0/1/2 checkpoint each stage loads at another world size: every saving stage is loaded at another one.
RESHARD_SOURCE = {0: 1, 1: 2, 2: 0, 3: 1}


def resume_at_stage(directory: str, stage: int) -> dict:
    """Load checkpoints saved at another world size into a fresh prepare for ``stage`` at this world size and train
    on: the stage-3 ``torch_api`` through fxshard.checkpoint.load, the stage-3 ``plain`` through
    ``dcp.load(model.state_dict(), opt.state_dict())``, and the checkpoints saved at stage ``RESHARD_SOURCE[stage]``
    through torch's ``get_state_dict`` / ``set_state_dict`` (``named_stage_<s>``) and ``dcp.load`` into
    ``model.state_dict()`` / ``opt.state_dict()`` (``plain_stage_<s>``)."""
    root = pathlib.Path(directory)
    source = RESHARD_SOURCE[stage]
    named_from_stage = _resumed_through_torch_api(stage, root / f"named_stage_{source}")

    plain_from_stage = _resumed_through_dcp(stage, root / f"plain_stage_{source}")

    _, model, opt, run = _prepared(stage)
    checkpoint.load(model, opt, root / "torch_api")
    through_load = _train(run, opt, _batches(skip=STEPS_BEFORE), STEPS_AFTER)

    through_plain = _resumed_through_dcp(stage, root / "plain")
    return {"through_load": through_load, "through_plain": through_plain, "source": source,
            "named_from_stage": named_from_stage, "plain_from_stage": plain_from_stage}


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


def _snapshot(model, opt) -> tuple:
    """Copies of what a load could change: this rank's parameter shards, every optimizer state, the groups'
    hyperparameters."""
    params = [p.detach().clone() for p in model.parameters()]
    state = [{kind: v.clone() if torch.is_tensor(v) else v for kind, v in opt.state[p].items()}
             for group in opt.param_groups for p in group["params"]]
    groups = [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
    return params, state, groups


def _same(a: tuple, b: tuple) -> bool:
    (params_a, state_a, groups_a), (params_b, state_b, groups_b) = a, b
    return (
        all(torch.equal(x, y) for x, y in zip(params_a, params_b, strict=True))
        and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k]
                                             for k in x) for x, y in zip(state_a, state_b, strict=True))
        and groups_a == groups_b
    )


def _on_first_rank(action) -> None:
    """Change the files on one rank; the others wait until it is done."""
    if rank_and_world()[0] == 0:
        action()
    dist.barrier()


def misuse_is_refused(directory: str) -> dict:
    """A trained stage-3 model and optimizer (with state), and every misuse docs/checkpointing.md lists: each must
    raise FxShardError and leave the parameters, the optimizer state and the groups' hyperparameters as they were.
    Also what a raw ``dcp.load`` of another model's checkpoint raises, and what ``latest`` picks beside a killed
    save's ``.partial`` directory and a directory without ``.metadata``."""
    import shutil

    root = pathlib.Path(directory)
    torch._dynamo.reset()
    other = build_model("mlp_uneven")  # the same names, other shapes (fc2.bias alike)
    other_backend = fxshard.backend(compiler="eager", stage=3)
    other, other_opt = other_backend.prepare(other, make_optimizer("adamw", other.parameters()))
    other(torch.randn(4, 7)).square().mean().backward()
    other_opt.step()
    other_opt.zero_grad()
    checkpoint.save(other, other_opt, root / "other_model")
    other_model_sd, other_optim_sd = checkpoint.get_state_dict(other, other_opt)
    other_plain_optim = other_opt.state_dict()

    _, model, opt, run = _prepared(3)
    _train(run, opt, _batches(), 1)
    saved_files = sorted((p.name, p.stat().st_size) for p in (root / "saved").iterdir())

    def without(directory: pathlib.Path, name: str) -> None:
        shutil.copytree(root / "saved", directory)
        os.remove(directory / name)

    def truncated() -> None:
        shutil.copytree(root / "saved", root / "truncated")
        with open(root / "truncated" / "__1_0.distcp", "r+b") as file:
            file.truncate(os.path.getsize(root / "saved" / "__1_0.distcp") // 2)

    _on_first_rank(lambda: without(root / "missing_shard", "__1_0.distcp"))
    _on_first_rank(truncated)
    _on_first_rank(lambda: without(root / "step_000002.partial", ".metadata"))
    refused_options = StateDictOptions(broadcast_from_rank0=True)
    attempts = {
        "other model": lambda: checkpoint.load(model, opt, root / "other_model"),
        "other state dict": lambda: checkpoint.set_state_dict(model, opt, model_state_dict=other_model_sd,
                                                              optim_state_dict=other_optim_sd),
        "other optimizer state dict": lambda: opt.load_state_dict(other_plain_optim),
        "missing shard": lambda: checkpoint.load(model, opt, root / "missing_shard"),
        "truncated shard": lambda: checkpoint.load(model, opt, root / "truncated"),
        "partial": lambda: checkpoint.load(model, opt, root / "step_000002.partial"),
        "no such directory": lambda: checkpoint.load(model, opt, root / "step_000099"),
        "save into an existing path": lambda: checkpoint.save(model, opt, root / "saved"),
        "broadcast_from_rank0": lambda: checkpoint.set_model_state_dict(model, {}, options=refused_options),
    }
    errors, unchanged = {}, {}
    for misuse, attempt in attempts.items():
        before = _snapshot(model, opt)
        try:
            attempt()
            errors[misuse] = None
        except fxshard.FxShardError as error:
            errors[misuse] = str(error)
        unchanged[misuse] = _same(before, _snapshot(model, opt))
    saved_untouched = saved_files == sorted((p.name, p.stat().st_size) for p in (root / "saved").iterdir())

    raw_dcp_error = None
    try:  # DCP's own recipe has no such check: DCP raises its own error
        dcp.load({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=root / "other_model")
    except BaseException as error:  # CheckpointException derives from BaseException
        raw_dcp_error = type(error).__name__

    newest = root / "newest"
    _on_first_rank(lambda: (shutil.copytree(root / "saved", newest / "step_000001"),
                            shutil.copytree(root / "step_000002.partial", newest / "step_000002.partial"),
                            (newest / "step_000003").mkdir()))
    return {"errors": errors, "unchanged": unchanged, "saved_untouched": saved_untouched,
            "raw_dcp_error": raw_dcp_error, "latest": checkpoint.latest(newest).name}


def fsdp2_interop(directory: str) -> dict:
    """FSDP2 <-> fxshard through DCP: FSDP2 trains and saves (get_state_dict + dcp.save), trains on; fxshard at each
    stage 0-3 loads FSDP2's checkpoint and trains the same steps; FSDP2 loads fxshard's checkpoints saved at stages
    3, 1 and 2 through torch's get_state_dict (a get_state_dict template, dcp.load, set_state_dict) and trains the
    same steps."""
    root = pathlib.Path(directory)
    model, opt = _fsdp2()
    batches = _batches()
    fsdp2_before = _train(model, opt, batches, STEPS_BEFORE)
    model_sd, optim_sd = torch_get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=root / f"fsdp2_world_{rank_and_world()[1]}")
    fsdp2_after = _train(model, opt, batches, STEPS_AFTER)

    fxshard_from_fsdp2 = {}
    for stage in (0, 1, 2, 3):  # stages 1 and 3 through torch's get_state_dict / set_state_dict, 0 and 2 through load
        fsdp2_checkpoint = root / f"fsdp2_world_{rank_and_world()[1]}"
        if stage % 2:
            fxshard_from_fsdp2[stage] = _resumed_through_torch_api(stage, fsdp2_checkpoint)
            continue
        _, fx_model, fx_opt, fx_run = _prepared(stage)
        checkpoint.load(fx_model, fx_opt, fsdp2_checkpoint)
        fxshard_from_fsdp2[stage] = _train(fx_run, fx_opt, _batches(skip=STEPS_BEFORE), STEPS_AFTER)

    fsdp2_from_fxshard = {}
    for stage, name in ((3, "torch_api"), (1, "named_stage_1"), (2, "named_stage_2")):
        model, opt = _fsdp2()
        model_template, optim_template = torch_get_state_dict(model, opt)
        dcp.load({"model": model_template, "optim": optim_template}, checkpoint_id=root / name)
        torch_set_state_dict(model, opt, model_state_dict=model_template, optim_state_dict=optim_template)
        fsdp2_from_fxshard[stage] = _train(model, opt, _batches(skip=STEPS_BEFORE), STEPS_AFTER)
    return {"fsdp2_before": fsdp2_before, "fsdp2_after": fsdp2_after, "fxshard_from_fsdp2": fxshard_from_fsdp2,
            "fsdp2_from_fxshard": fsdp2_from_fxshard}


def _model_for_memory(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "layers":  # 8 layers whose 255 rows split unevenly over 2 ranks (128 / 127 and a row of padding)
        return torch.nn.Sequential(*[torch.nn.Linear(LAYER_WIDTH, LAYER_WIDTH) for _ in range(8)])
    from examples.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, d_model=64))  # train_gpt.py's


def peak_during_save(directory: str, model_name: str = "layers") -> dict:
    """Stage 3, one AdamW step (so the optimizer has its state), then the peak bytes allocated during
    ``fxshard.checkpoint.save``, beside the bytes of the largest parameter, of this rank's shards (parameters and
    optimizer state) and of the whole model and optimizer state in full."""
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
    gather_full = layout.gather_full

    def counted_gather_full(*args, **kwargs):  # every full tensor the save gathers, and how many live at once
        full = gather_full(*args, **kwargs)
        gathered["made"] += 1
        gathered["alive"] += 1
        gathered["most_alive"] = max(gathered["most_alive"], gathered["alive"])
        weakref.finalize(full, gathered.__setitem__, "alive", gathered["alive"] - 1)
        return full

    layout.gather_full = counted_gather_full
    try:
        peak = peak_allocated_bytes(lambda: checkpoint.save(model, opt, pathlib.Path(directory) / model_name))
    finally:
        layout.gather_full = gather_full
    specs = [spec_of(p) for p in model.parameters()]
    kinds = 1 + sum(1 for v in next(iter(opt.state.values())).values() if v.dim())  # the parameter + its states
    return {
        "gathered": gathered["made"],
        "most_gathered_at_once": gathered["most_alive"],
        "peak": peak,
        "largest_parameter": max(s.numel for s in specs) * 4,
        "local": kinds * sum(s.chunk for s in specs) * 4,
        "full": kinds * sum(s.numel for s in specs) * 4,
    }
