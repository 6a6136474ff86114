"""The backend's options, checked before anything is prepared or compiled: the stage, the compiler, the mesh, and
the knobs every pass reads (``fxshard.passes.PassContext``). A wrong option raises FxShardError naming it."""

from __future__ import annotations

import torch

from fxshard.errors import FxShardError
from fxshard.passes.context import KNOBS
from fxshard.passes.quantize import GRAD_SCHEMES, SCHEMES
from fxshard.runtime.groups import group_over

STAGES = (0, 1, 2, 3)
COMPILERS = ("eager", "inductor")
# Inductor: faster than running the rewritten graphs op by op, with less peak memory (docs/benchmark.md)
DEFAULT_COMPILER = "inductor"
BUCKETS = ("layer", "block", "auto")

def checked_knobs(knobs: dict) -> dict:
    """The backend's knobs (``PassContext``'s fields after the facts), each of the right kind, or FxShardError."""
    unknown = sorted(set(knobs) - set(KNOBS))
    if unknown:
        raise FxShardError(f"unknown backend option(s) {unknown}; the options are stage, group, mesh, passes, "
                           f"compiler, regional, machine, {', '.join(KNOBS)} (see fxshard.passes.PassContext)")
    bucket = knobs.get("bucket", "auto")  # absent: the stage's default, a valid one
    if not (bucket in BUCKETS or (isinstance(bucket, int) and not isinstance(bucket, bool) and bucket > 0)):
        raise FxShardError(f'bucket must be "layer", "block", "auto" or a positive byte cap, got {bucket!r}')
    if bucket == "block" and not knobs.get("blocks"):
        raise FxShardError('bucket="block" needs blocks=[module names or module classes], e.g. blocks=[Block]')
    for name in ("prefetch", "max_inflight_gathers"):
        value = knobs.get(name, 0 if name == "prefetch" else 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "prefetch" else 1):
            raise FxShardError(f"{name} must be an int >= {0 if name == 'prefetch' else 1}, got {value!r}")
    for name in ("param_dtype", "reduce_dtype"):
        value = knobs.get(name)
        if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
            raise FxShardError(f"{name} must be a floating torch.dtype (e.g. torch.bfloat16) or None, got {value!r}")
    reshard = knobs.get("reshard_after_forward", True)
    if not isinstance(reshard, int) or (not isinstance(reshard, bool) and reshard < 1):
        raise FxShardError("reshard_after_forward must be True, False or an int k >= 1 dividing the shard group "
                           f"(re-gather in backward within groups of k ranks), got {reshard!r}")
    for name, schemes in (("quantize_weights", SCHEMES), ("quantize_grads", GRAD_SCHEMES)):
        value = knobs.get(name)
        if value is not None and value != "auto" and value not in schemes:
            raise FxShardError(f'{name} must be None, "auto" (the backend chooses, lossy allowed) or one of '
                               f"{schemes}, got {value!r}")
    if knobs.get("quantize_weights") == "fp8" and not hasattr(torch, "float8_e4m3fn"):
        raise FxShardError('quantize_weights="fp8" needs torch.float8_e4m3fn, which this torch lacks: use "int8" (the '
                           'same bytes on the wire)')
    block = knobs.get("quantize_block", 1)
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        raise FxShardError(f"quantize_block must be a positive int (elements per scale), got {block!r}")
    schedule = knobs.get("schedule")
    if schedule is not None and not callable(schedule):
        raise FxShardError(f"schedule must be a function schedule(gm, ctx) -> gm, got {schedule!r}")
    step_bucket = knobs.get("step_bucket_bytes", 1)
    if isinstance(step_bucket, bool) or not isinstance(step_bucket, int) or step_bucket <= 0:
        raise FxShardError(f"step_bucket_bytes must be a positive int (bytes), got {step_bucket!r}")
    timeout = knobs.get("collective_timeout_s", 1)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise FxShardError(f"collective_timeout_s must be a positive number of seconds, got {timeout!r}")
    budget = knobs.get("memory_budget")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0):
        raise FxShardError(f"memory_budget must be a positive number of bytes per rank, got {budget!r}")
    if "blocks" in knobs:
        knobs = {**knobs, "blocks": tuple(knobs["blocks"])}
    return knobs


MESH_DIMS = ("replicate", "shard")  # the dimension names of a hybrid-sharding mesh


def check_mesh(mesh, group) -> None:
    from torch.distributed.device_mesh import DeviceMesh

    if group is not None:
        raise FxShardError("give the backend a group or a mesh, not both (a 1-D mesh is its group)")
    if not isinstance(mesh, DeviceMesh):
        raise FxShardError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim == 2 and set(mesh.mesh_dim_names or ()) != set(MESH_DIMS):
        raise FxShardError(
            f"a 2-D mesh needs its dimensions named {MESH_DIMS}, got {mesh.mesh_dim_names}: "
            'init_device_mesh(device, (replicas, shards), mesh_dim_names=("replicate", "shard"))'
        )
    if mesh.ndim not in (1, 2):
        raise FxShardError(f"mesh must be 1-D (shard) or 2-D (replicate, shard), got {mesh.ndim} dimensions")


def check_stage_knobs(knobs: dict, stage: int) -> None:
    """FxShardError for a communication option the stage has no collective for."""
    if knobs.get("quantize_weights") is not None and stage != 3:
        raise FxShardError(f"quantize_weights packs the weights' all-gather, and only stage 3 gathers weights (this "
                           f"backend is stage {stage}): use stage=3 or drop the option")
    if knobs.get("quantize_grads") is not None and stage not in (2, 3):
        raise FxShardError(f"quantize_grads packs the gradients' reduce-scatter in the compiled backward, which "
                           f"stages 2 and 3 run (this backend is stage {stage}): use stage=2 or 3, or drop the option")


def secondary_size(reshard_after_forward: bool | int, stage: int, shard_world: int) -> int | None:
    """The k of ``reshard_after_forward=k`` where it asks for a secondary shard (1 < k < the shard group's size),
    None for True and False and the ks that mean them (the group's size, 1); FxShardError where k cannot apply."""
    if isinstance(reshard_after_forward, bool):
        return None
    k = reshard_after_forward
    if stage != 3:
        raise FxShardError(f"reshard_after_forward={k} re-gathers weights from a secondary shard in backward, and only "
                           f"stage 3 gathers weights (this backend is stage {stage}): use stage=3 or drop the option")
    if shard_world % k:
        raise FxShardError(f"reshard_after_forward={k} must divide the {shard_world} ranks parameters are sharded "
                           f"over (each group of k consecutive ranks holds a secondary shard): use one of "
                           f"{[d for d in range(1, shard_world + 1) if shard_world % d == 0]}")
    return k if 1 < k < shard_world else None


def mesh_groups(mesh, stage: int) -> tuple:
    """(the group parameters are sharded over, the group each shard's gradient is then averaged over, a group of
    every rank of the mesh) for a checked ``mesh``, None where there is none. Stage 0 shards nothing: it all-reduces
    over every rank of the mesh."""
    if mesh.ndim == 1:
        return mesh.get_group(), None, None
    whole = group_over(sorted(mesh.mesh.flatten().tolist()))
    if stage == 0:
        return whole, None, None
    return mesh.get_group("shard"), mesh.get_group("replicate"), whole

