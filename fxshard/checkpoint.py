"""Checkpoints of a prepared model and optimizer that ``torch.distributed.checkpoint`` (DCP) saves rank by rank and
reshards on load, in FSDP2's layout; the consolidated (full) dicts on request; crash-safe saves.

The layout. fxshard keeps every parameter as a FLAT shard (``fxshard/sharding.py``): a flat range of the parameter,
which is not a rectangular block of it, so DCP cannot describe it. A state dict therefore holds what FSDP2's holds:
every tensor that lives sharded (a parameter of stages 2 and 3, a stage-1 fp32 master under mixed precision, a
per-element optimizer state such as ``exp_avg`` in stages 1-3) becomes a ``DTensor`` of the parameter's FULL shape,
``Shard(0)`` on a 1-D ``DeviceMesh`` over the group fxshard communicates on: rank ``r`` holds rows
``[r * R, (r + 1) * R)`` with ``R = ceil(rows / world size)`` (``torch.chunk``'s split: the last ranks may hold fewer
rows, or none). Tensors that every rank holds in full (stage 0, stage 1's parameters, scalars such as Adam's
``step``) stay plain tensors, which DCP treats as replicated and writes once.

Where a parameter's rows split evenly over the ranks, or it has a single dimension, each rank's rows ARE the
elements of its flat shard: the DTensor's local tensor is a view of the shard (no copy, no communication), and
``dcp.load`` writes straight into it. Otherwise the rows cross shard boundaries, and that one parameter is gathered
(one all-gather), its rows copied out and the gathered tensor dropped before the next parameter: building a state
dict never holds more than one full parameter. Loading does the reverse (rows that cross shard boundaries: that
parameter's ``full_tensor()``, cut down to this rank's flat shard).

DCP keys optimizer state by parameter name only through ``get_state_dict``, which finds a parameter's name by
identity in ``model.named_parameters()``: the optimizer ``prepare`` returns holds the model's parameters at every
stage (stage 1's steps an inner optimizer over the masters: ``fxshard.optim.MasterStep``), so torch's
``get_state_dict`` / ``set_state_dict`` work. The functions here take the same arguments and return the same dicts,
and check a state dict against the model and optimizer before anything changes.

``save`` / ``load`` / ``latest`` add what a training loop needs: ``save`` writes into ``<path>.partial`` and renames it
to ``<path>`` once every rank finished, so a process killed in the middle of a save leaves the previous checkpoint
the newest complete one; ``load`` checks a checkpoint against the model before anything changes (another model's
checkpoint, a missing or truncated shard file: ``FxShardError``).
"""

from __future__ import annotations

import math
import os
import pathlib
import re
from itertools import chain

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor, Shard

from .errors import FxShardError
from .prepare import _SPECS, gather_full, replace_updated_state, spec_of, updating_optimizer
from .sharding import ShardSpec, shard_of

__all__ = [
    "StateDictOptions", "get_model_state_dict", "get_optimizer_state_dict", "get_state_dict", "latest", "load",
    "save", "set_model_state_dict", "set_optimizer_state_dict", "set_state_dict",
]

# -- one parameter: flat shard <-> DTensor of its rows ---------------------------------------------------------------
_MESHES: dict[tuple[str, str], tuple[object, DeviceMesh]] = {}  # (group name, device type) -> (group, its mesh)


def mesh_of(spec: ShardSpec, device_type: str) -> DeviceMesh:
    """The 1-D DeviceMesh over the group ``spec``'s collectives run on (the one ``prepare`` recorded, not the world
    group). Made once per group; a group destroyed and re-made under the same name gets a new mesh."""
    group = _resolve_process_group(spec.group_name)
    cached = _MESHES.get((spec.group_name, device_type))
    if cached is None or cached[0] is not group:
        cached = (group, DeviceMesh.from_group(group, device_type))
        _MESHES[(spec.group_name, device_type)] = cached
    return cached[1]


def _row_numel(spec: ShardSpec) -> int:
    return math.prod(spec.full_shape[1:])


def _rows_of(spec: ShardSpec, rank: int) -> tuple[int, int]:
    """The dim-0 rows ``[start, stop)`` rank ``rank`` holds under ``Shard(0)`` (torch.chunk's split)."""
    rows = spec.full_shape[0]
    per_rank = -(-rows // spec.world_size)
    return min(rank * per_rank, rows), min((rank + 1) * per_rank, rows)


def rows_are_shard(spec: ShardSpec) -> bool:
    """Whether every rank's dim-0 rows are exactly the (unpadded) elements of its flat shard: true when the rows split
    evenly over the ranks, and for every 1-D parameter."""
    return spec.chunk == -(-spec.full_shape[0] // spec.world_size) * _row_numel(spec)


def _as_dtensor(local: torch.Tensor, spec: ShardSpec) -> DTensor:
    return DTensor.from_local(local, mesh_of(spec, local.device.type), [Shard(0)], run_check=False,
                              shape=torch.Size(spec.full_shape), stride=_contiguous_strides(spec.full_shape))


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


@torch.no_grad()
def sharded_value(shard: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """What a state dict holds for a flat shard of ``spec``'s parameter (a parameter, a master, an optimizer state
    of the parameter's layout): a DTensor of the full shape holding this rank's rows. A view of the shard where the
    rows are the shard; else this parameter is gathered, so every rank must call it. A 0-d parameter has no rows to
    split: every rank gets it whole (a plain tensor, gathered: one element)."""
    shard = shard.detach()
    if not spec.full_shape:
        return gather_full(shard, spec)
    start, stop = _rows_of(spec, spec.rank)
    if rows_are_shard(spec):
        local = shard[: (stop - start) * _row_numel(spec)].view(stop - start, *spec.full_shape[1:])
    else:
        local = gather_full(shard, spec)[start:stop].clone()  # the gathered parameter is dropped on return
    return _as_dtensor(local, spec)


def rows_of_full(full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """The state-dict value of a parameter whose full value this rank holds anyway (stage 2's resident copy): a
    DTensor whose local tensor is a view of this rank's rows. No communication."""
    if not spec.full_shape:
        return full.detach()
    start, stop = _rows_of(spec, spec.rank)
    return _as_dtensor(full.detach()[start:stop], spec)


def _check_shape(value, spec: ShardSpec, what: str) -> None:
    if not torch.is_tensor(value) or tuple(value.shape) != spec.full_shape:
        got = list(value.shape) if torch.is_tensor(value) else type(value).__name__
        raise FxShardError(
            f"{what}: the state dict holds {got}, the parameter {spec.name} has shape {list(spec.full_shape)}; "
            "load a state dict (or checkpoint) saved from the same model"
        )


def _in_our_layout(value: DTensor, spec: ShardSpec) -> bool:
    """Whether ``value`` is split as this module splits ``spec``'s parameter: Shard(0) over the same ranks. The same
    answer on every rank, so every rank takes the same (collective or not) path."""
    if tuple(value.placements) != (Shard(0),) or value.device_mesh.ndim != 1:
        return False
    ours = mesh_of(spec, value.device_mesh.device_type)
    return value.device_mesh.mesh.tolist() == ours.mesh.tolist()


@torch.no_grad()
def shard_from_value(value, spec: ShardSpec, dtype: torch.dtype, what: str) -> torch.Tensor:
    """This rank's flat, zero-padded shard (a new tensor in ``dtype``) of a state-dict value of ``spec``'s
    parameter: a full-shape tensor, or a DTensor of any layout (one of another layout, or whose rows cross shard
    boundaries, is gathered: a collective, every rank calls it). Anything else raises FxShardError."""
    _check_shape(value, spec, what)
    if isinstance(value, DTensor):
        if spec.full_shape and _in_our_layout(value, spec) and rows_are_shard(spec):
            local = value.to_local().reshape(-1)
            shard = torch.zeros(spec.chunk, dtype=dtype, device=local.device)
            shard[: local.numel()] = local
            return shard
        value = value.full_tensor()
    return shard_of(value.to(dtype), spec)


def full_from_value(value, spec: ShardSpec, what: str) -> torch.Tensor:
    """The full tensor of a state-dict value for a parameter this rank holds in full (stages 0, 1): a DTensor is
    gathered (every rank calls it)."""
    _check_shape(value, spec, what)
    return value.full_tensor() if isinstance(value, DTensor) else value


# -- the optimizer's state_dict() / load_state_dict() ---------------------------------------------------------------
_MADE_FOR_STATE_DICT = "_fxshard_state_made_for_state_dict"


def _updated(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What the optimizer's update writes, in the order of its parameters (stage 1: their master shards)."""
    return [p for group in updating_optimizer(optimizer).param_groups for p in group["params"]]


def _is_per_element(value, updated: torch.Tensor) -> bool:
    """Optimizer state laid out like the tensor it belongs to (``exp_avg``), not a scalar (``step``)."""
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == updated.shape


@torch.no_grad()
def _initialise_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter its state, as the first step would, without changing a parameter: one step with zero
    gradients at learning rate 0 (what torch's ``get_state_dict`` does to an optimizer without state). The class's
    step runs, with the hooks prepare put around it, not a compiled ``opt.step`` the user assigned."""
    params = [p for p in _updated(optimizer) if p.requires_grad]
    learning_rates = [group["lr"] for group in optimizer.param_groups]
    for param in params:
        param.grad = torch.zeros_like(param)
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(0.0) if torch.is_tensor(group["lr"]) else 0.0
    try:
        type(optimizer).step(optimizer)
    finally:
        for group, lr in zip(optimizer.param_groups, learning_rates):
            group["lr"] = lr
        for param in params:
            param.grad = None


def optimizer_state_dict_pre_hook(optimizer: torch.optim.Optimizer) -> None:
    """A prepared optimizer without state (nothing stepped yet) names every state a checkpoint holds all the same:
    a template taken from it (``dcp.load(opt.state_dict())``) would otherwise ask the checkpoint for nothing and
    load nothing. The state is made for this one state dict and removed again by the post hook, so asking for a
    state dict never changes how training continues. With gradients pending it stays as it is (as torch's
    ``get_state_dict`` leaves it)."""
    held = [p for group in optimizer.param_groups for p in group["params"]]  # stage 1: the parameters, not masters
    if optimizer.state or any(p.grad is not None for p in (*held, *_updated(optimizer))):
        return
    _initialise_state(optimizer)
    setattr(optimizer, _MADE_FOR_STATE_DICT, True)


def optimizer_state_dict_post_hook(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """Per-element state of a flat shard (stages 1-3) becomes a DTensor of the parameter's full shape (see the
    module's docstring); stage 0's full state and scalars stay as they are. A collective where a parameter's rows
    cross shard boundaries: every rank calls ``state_dict()``."""
    updated = _updated(optimizer)
    state = {}
    for key, kinds in state_dict["state"].items():
        param = updated[key]
        spec = spec_of(param)
        state[key] = {
            kind: sharded_value(value, spec) if spec.stage >= 1 and _is_per_element(value, param) else value
            for kind, value in kinds.items()
        }
    if getattr(optimizer, _MADE_FOR_STATE_DICT, False):
        replace_updated_state(optimizer, {})
        delattr(optimizer, _MADE_FOR_STATE_DICT)
    return {**state_dict, "state": state}


def _laid_out_for(value, updated: torch.Tensor, spec: ShardSpec, what: str):
    """A saved optimizer state laid out the way ``updated`` (what this rank's optimizer updates) holds it."""
    if not (torch.is_tensor(value) and value.dim() > 0):
        return value
    if spec.stage == 0:
        return full_from_value(value, spec, what)
    if not isinstance(value, DTensor) and tuple(value.shape) == tuple(updated.shape) != spec.full_shape:
        return value  # a per-rank shard saved by this rank's optimizer at this world size (fxshard before DTensors)
    return shard_from_value(value, spec, updated.dtype, what)


def optimizer_load_state_dict_pre_hook(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """Checks a state dict against this optimizer and lays every saved state out as this rank holds it (DTensors and
    full tensors become flat shards in stages 1-3, full tensors in stage 0), before torch's ``load_state_dict``
    changes anything. Keys may be positions (``opt.state_dict()``) or parameter names (``get_state_dict``)."""
    groups = optimizer.param_groups
    saved_groups = state_dict.get("param_groups", [])
    if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in groups]:
        raise FxShardError(
            f"the optimizer state dict has {len(saved_groups)} parameter group(s) of "
            f"{[len(g['params']) for g in saved_groups]} parameters, this optimizer "
            f"{[len(g['params']) for g in groups]}; load a state dict of the same model's optimizer, with its "
            "parameters grouped alike"
        )
    saved_keys = list(chain.from_iterable(g["params"] for g in saved_groups))
    updated = _updated(optimizer)
    names = [spec_of(p).name for p in updated]
    misnamed = [(k, n) for k, n in zip(saved_keys, names) if isinstance(k, str) and k != n]
    unknown = sorted(map(str, set(state_dict["state"]) - set(saved_keys)))
    if misnamed or unknown:
        raise FxShardError(
            f"the optimizer state dict is not this model's: it names {misnamed[:3] or unknown[:3]} where this "
            f"optimizer updates {names[:3]}...; load a state dict saved from the same model"
        )
    state = {}
    for key, param, name in zip(saved_keys, updated, names):
        if key in state_dict["state"]:
            state[key] = {kind: _laid_out_for(value, param, spec_of(param), f"optimizer state {name}.{kind}")
                          for kind, value in state_dict["state"][key].items()}
    return {**state_dict, "state": state}


# -- get / set, keyed by parameter name -------------------------------------------------------------------------------
def _unwrapped(model: nn.Module) -> nn.Module:
    """The module ``prepare`` returned, also when given its ``torch.compile`` wrapper (whose keys carry
    ``_orig_mod.``)."""
    module = getattr(model, "_orig_mod", model)
    if not any(hasattr(m, _SPECS) for m in module.modules()):
        raise FxShardError("this model was not prepared; call backend.prepare(model, optimizer) first")
    return module


def _checked_options(options: StateDictOptions | None) -> StateDictOptions:
    options = options or StateDictOptions()
    if options.broadcast_from_rank0:
        raise FxShardError(
            "StateDictOptions(broadcast_from_rank0=True) is not supported by fxshard.checkpoint: load the full "
            "state dict on every rank (each keeps its own shard of it), or save and load a sharded checkpoint"
        )
    return options


def _first_rank(group) -> bool:
    return dist.get_rank(group) == 0


@torch.no_grad()
def _gathered(value, to_first_rank_only: bool, first_rank: int):
    """A DTensor's full tensor (every rank, or only the rank ``first_rank`` of the world: ``None`` elsewhere), one
    tensor at a time. On a hybrid mesh only the shard group of ``first_rank`` gathers: each holds the same rows."""
    if not isinstance(value, DTensor):
        return value.clone() if torch.is_tensor(value) else value
    if not to_first_rank_only:
        return value.full_tensor()
    group = value.device_mesh.get_group()
    if first_rank not in dist.get_process_group_ranks(group):
        return None
    local = value.to_local()
    rows = value.shape[0]
    per_rank = -(-rows // dist.get_world_size(group))
    padded = local.new_zeros(per_rank, *value.shape[1:])
    padded[: local.shape[0]] = local
    pieces = [torch.empty_like(padded) for _ in range(dist.get_world_size(group))] if _first_rank(group) else None
    dist.gather(padded, pieces, group_dst=0, group=group)
    return torch.cat(pieces)[:rows].cpu() if pieces is not None else None


def _consolidated(state_dict: dict, options: StateDictOptions, group) -> dict:
    """The full state dict: every DTensor gathered one at a time; with ``cpu_offload`` to the first rank only (the
    other ranks get ``{}``), as FSDP2's ``full_state_dict`` options do."""
    to_first_rank_only = options.cpu_offload

    def walk(value):
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return _gathered(value, to_first_rank_only, dist.get_global_rank(group, 0))

    full = walk(state_dict)
    return full if not to_first_rank_only or _first_rank(group) else {}


def _group_of(module: nn.Module):
    """Every rank that holds a piece of the model: its shard group, or on a hybrid mesh all of the mesh (each
    replica group writes the same rows; DCP keeps one copy)."""
    spec = next(iter(getattr(next(m for m in module.modules() if hasattr(m, _SPECS)), _SPECS).values()))
    return _resolve_process_group(spec.all_ranks_group_name)


def get_model_state_dict(model: nn.Module, *, options: StateDictOptions | None = None) -> dict:
    """``model.state_dict()`` of a prepared model, keyed by parameter name (no ``_orig_mod.``): sharded tensors as
    DTensors of their full shape. ``StateDictOptions(full_state_dict=True)`` gathers them one at a time (with
    ``cpu_offload=True``: to the first rank only, the others get ``{}``). A collective: every rank calls it."""
    options = _checked_options(options)
    module = _unwrapped(model)
    state_dict = module.state_dict()
    if options.ignore_frozen_params:
        frozen = {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
        state_dict = {k: v for k, v in state_dict.items() if k not in frozen}
    return _consolidated(state_dict, options, _group_of(module)) if options.full_state_dict else state_dict


def get_optimizer_state_dict(model: nn.Module, optimizers: torch.optim.Optimizer, *,
                             options: StateDictOptions | None = None) -> dict:
    """The prepared optimizer's state keyed by parameter name, as torch's ``get_optimizer_state_dict`` keys it:
    ``{"state": {name: {kind: value}}, "param_groups": [{hyperparameters..., "params": [names]}]}`` (with
    ``flatten_optimizer_state_dict``, torch's flat form). A collective."""
    options = _checked_options(options)
    optimizer = optimizers
    if not isinstance(optimizer, torch.optim.Optimizer):
        optimizer, *others = list(optimizers)
        if others:
            raise FxShardError("fxshard prepares one optimizer per model; pass the optimizer backend.prepare returned")
    module = _unwrapped(model)
    names = [_name_of(p) for p in _updated(optimizer)]
    positional = optimizer.state_dict()
    state_dict = {
        "state": {names[key]: kinds for key, kinds in positional["state"].items()},
        "param_groups": [{**group, "params": [names[key] for key in group["params"]]}
                         for group in positional["param_groups"]],
    }
    if options.full_state_dict:
        state_dict = _consolidated(state_dict, options, _group_of(module))
        if not state_dict:
            return state_dict
    if options.flatten_optimizer_state_dict:
        from torch.distributed.checkpoint.state_dict import _flatten_optim_state_dict

        state_dict = _flatten_optim_state_dict(state_dict)
    return state_dict


def _name_of(updated: torch.Tensor) -> str:
    spec = spec_of(updated)
    if spec is None:
        raise FxShardError("this optimizer updates a tensor prepare did not lay out; pass the optimizer "
                           "backend.prepare returned")
    return spec.name


def get_state_dict(model: nn.Module, optimizers: torch.optim.Optimizer, *,
                   options: StateDictOptions | None = None) -> tuple[dict, dict]:
    """``(get_model_state_dict(model), get_optimizer_state_dict(model, optimizer))``: what torch's
    ``get_state_dict`` returns for an FSDP2 model, for a prepared model at any stage."""
    return (get_model_state_dict(model, options=options),
            get_optimizer_state_dict(model, optimizers, options=options))


def _expected_model_entries(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every key ``module.state_dict()`` has and the shape it holds, without building it (no communication)."""
    entries: dict[str, tuple[int, ...]] = {}

    def visit(mod: nn.Module, prefix: str) -> None:
        specs = getattr(mod, _SPECS, {})
        for name, param in mod._parameters.items():
            if param is not None:
                entries[prefix + name] = specs[name].full_shape if name in specs else tuple(param.shape)
        for name, buffer in mod._buffers.items():
            if buffer is not None and name not in mod._non_persistent_buffers_set:
                entries[prefix + name] = tuple(buffer.shape)
        for name, child in mod._modules.items():
            if child is not None:
                visit(child, f"{prefix}{name}.")

    visit(module, "")
    return entries


def _check_model_state_dict(module: nn.Module, state_dict: dict, strict: bool) -> None:
    expected = _expected_model_entries(module)
    missing = sorted(set(expected) - set(state_dict)) if strict else []
    unexpected = sorted(set(state_dict) - set(expected)) if strict else []
    mismatched = [(k, list(v.shape), list(expected[k])) for k, v in state_dict.items()
                  if k in expected and torch.is_tensor(v) and tuple(v.shape) != expected[k]]
    if missing or unexpected or mismatched:
        raise FxShardError(
            "the model state dict is not this model's: "
            + "; ".join(part for part in (
                f"missing {missing[:4]}" if missing else "",
                f"unexpected {unexpected[:4]}" if unexpected else "",
                "shapes " + ", ".join(f"{k} {got} (the model: {want})" for k, got, want in mismatched[:4])
                if mismatched else "",
            ) if part)
            + "; load a state dict (or checkpoint) saved from the same model"
        )


def set_model_state_dict(model: nn.Module, model_state_dict: dict, *, options: StateDictOptions | None = None):
    """Load a model state dict (parameter names as keys; sharded values as DTensors of any layout, or full tensors)
    into a prepared model, each rank keeping its shard. Checked first: another model's keys or shapes raise
    FxShardError before anything changes. Returns torch's ``(missing_keys, unexpected_keys)``."""
    options = _checked_options(options)
    module = _unwrapped(model)
    _check_model_state_dict(module, model_state_dict, options.strict)
    return module.load_state_dict(model_state_dict, strict=options.strict)


def _unflattened(optimizer: torch.optim.Optimizer, flat: dict) -> dict:
    """torch's flat optimizer state dict (``state.<name>.<kind>``, ``param_groups.<name>.<hyperparameter>``) nested
    again, for this optimizer's parameter names."""
    names = [_name_of(p) for p in _updated(optimizer)]
    state, groups = {}, []
    for name in names:
        prefix = f"state.{name}."
        kinds = {key[len(prefix):]: value for key, value in flat.items() if key.startswith(prefix)}
        if kinds:
            state[name] = kinds
    for group in optimizer.param_groups:
        group_names = [_name_of(p) for p in group["params"]]
        prefix = f"param_groups.{group_names[0]}." if group_names else None
        hyper = {key[len(prefix):]: value for key, value in flat.items() if prefix and key.startswith(prefix)}
        groups.append({**hyper, "params": group_names})
    return {"state": state, "param_groups": groups}


def set_optimizer_state_dict(model: nn.Module, optimizers: torch.optim.Optimizer, optim_state_dict: dict, *,
                             options: StateDictOptions | None = None) -> None:
    """Load an optimizer state dict keyed by parameter name (``get_optimizer_state_dict``'s, torch's or FSDP2's, flat
    or nested, from any world size and stage) into the prepared optimizer. Parameters are matched by name, groups'
    hyperparameters by the group of each parameter; another model's state raises FxShardError before anything
    changes."""
    options = _checked_options(options)
    optimizer = optimizers if isinstance(optimizers, torch.optim.Optimizer) else next(iter(optimizers))
    _unwrapped(model)
    if "state" not in optim_state_dict and "param_groups" not in optim_state_dict:
        optim_state_dict = _unflattened(optimizer, optim_state_dict)
    names = [_name_of(p) for p in _updated(optimizer)]
    group_of_name = {name: group for group in optim_state_dict["param_groups"] for name in group["params"]}
    missing = [name for name in names if name not in group_of_name]
    unknown = sorted(set(optim_state_dict["state"]) - set(names)) + sorted(set(group_of_name) - set(names))
    if (missing and options.strict) or unknown:
        raise FxShardError(
            f"the optimizer state dict is not this model's: {f'no group names {missing[:4]}' if missing else ''}"
            f"{' ' if missing and unknown else ''}{f'it names {unknown[:4]}, which this model has not' if unknown else ''}"
            "; load a state dict (or checkpoint) saved from the same model"
        )
    positions = {name: position for position, name in enumerate(names)}
    groups = []
    for group in optimizer.param_groups:
        group_names = [_name_of(p) for p in group["params"]]
        saved = group_of_name.get(group_names[0], {}) if group_names else {}
        groups.append({**{k: v for k, v in (saved or group).items() if k != "params"},
                       "params": [positions[name] for name in group_names]})
    state = {positions[name]: kinds for name, kinds in optim_state_dict["state"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def set_state_dict(model: nn.Module, optimizers: torch.optim.Optimizer, *, model_state_dict: dict,
                   optim_state_dict: dict, options: StateDictOptions | None = None):
    """Load both halves, as torch's ``set_state_dict`` does; both are checked before either changes anything."""
    options = _checked_options(options)
    module = _unwrapped(model)
    _check_model_state_dict(module, model_state_dict, options.strict)
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return module.load_state_dict(model_state_dict, strict=options.strict)


# -- save / load / latest: a checkpoint directory per save -----------------------------------------------------------
_PARTIAL = ".partial"


def _validated_extra(extra_state: dict | None) -> dict:
    extra_state = dict(extra_state or {})
    for key, value in extra_state.items():
        if not isinstance(key, str) or "." in key or not (torch.is_tensor(value) or isinstance(value, (int, float, str, bytes))):
            raise FxShardError(
                f"extra_state[{key!r}] = {type(value).__name__}: extra_state takes names without dots mapped to "
                "tensors, ints, floats, strings or bytes (the same on every rank), e.g. {'step': 100}"
            )
    return extra_state


def save(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | os.PathLike, *,
         extra_state: dict | None = None) -> pathlib.Path:
    """Write a sharded checkpoint of ``model``, ``optimizer`` and ``extra_state`` (step counters, data-loader
    state: the same on every rank) into the directory ``path``, each rank writing its shards. Every rank calls it.

    Crash safety: the files go to ``<path>.partial``, which the first rank renames to ``path`` after every rank
    finished writing, so ``path`` exists only complete, and a process killed during the save leaves the previous
    checkpoint the newest complete one (``latest``). A ``<path>.partial`` left by a killed save is written over.
    """
    path = pathlib.Path(path)
    module = _unwrapped(model)
    group = _group_of(module)
    extra = _validated_extra(extra_state)
    if path.exists():
        raise FxShardError(f"{path} exists; save each checkpoint into a new directory (e.g. one per step)")
    partial = path.with_name(path.name + _PARTIAL)
    model_state, optim_state = get_state_dict(module, optimizer)
    dcp.save({"model": model_state, "optim": optim_state, "extra": extra}, checkpoint_id=partial,
             process_group=group)
    dist.barrier(group=group)  # every rank's files and the metadata are written
    if _first_rank(group):
        os.replace(partial, path)
    dist.barrier(group=group)
    return path


_STEP = re.compile(r"^(.*?)(\d+)$")


def latest(directory: str | os.PathLike) -> pathlib.Path | None:
    """The newest complete checkpoint in ``directory`` (the subdirectory with the highest number at the end of its
    name that ``save`` finished: not ``*.partial``), or None."""
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        return None
    complete = [p for p in directory.iterdir()
                if p.is_dir() and not p.name.endswith(_PARTIAL) and _STEP.match(p.name) and (p / ".metadata").exists()]
    return max(complete, key=lambda p: int(_STEP.match(p.name).group(2)), default=None)


def _flat_keys(state_dict: dict) -> dict[str, object]:
    """DCP's flat keys (``model.fc1.weight``, ``optim.state.fc1.weight.exp_avg``) and the values under them."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state_dict)
    return flat


def _check_checkpoint(path: pathlib.Path, template: dict):
    """The checkpoint's metadata, after checking that it holds every key of ``template`` at the same shape, that its
    chunks cover each tensor and that every file a chunk lives in is there, long enough. FxShardError otherwise, on
    every rank alike (they read the same files)."""
    from torch.distributed.checkpoint import FileSystemReader

    if not (path / ".metadata").is_file():
        raise FxShardError(f"{path} is not a complete checkpoint (no .metadata); load one that save() finished, "
                           "e.g. fxshard.checkpoint.latest(directory)")
    metadata = FileSystemReader(path).read_metadata()
    saved = metadata.state_dict_metadata
    wanted = {k: v for k, v in _flat_keys(template).items() if not k.startswith("extra.")}
    missing = sorted(set(wanted) - set(saved))
    mismatched = [(k, list(saved[k].size), list(v.shape)) for k, v in wanted.items()
                  if k in saved and torch.is_tensor(v) and isinstance(saved[k], TensorStorageMetadata)
                  and tuple(saved[k].size) != tuple(v.shape)]
    if missing or mismatched:
        raise FxShardError(
            f"{path} is not a checkpoint of this model and optimizer: "
            + (f"it lacks {missing[:4]}{' ...' if len(missing) > 4 else ''}" if missing else "")
            + ("; " if missing and mismatched else "")
            + ("; ".join(f"{k} has shape {got} there, {want} here" for k, got, want in mismatched[:4]))
            + "; load a checkpoint saved from the same model (any world size and stage)"
        )
    for key, entry in saved.items():
        if isinstance(entry, TensorStorageMetadata):
            covered = sum(math.prod(chunk.sizes) for chunk in entry.chunks)
            if covered < math.prod(entry.size):
                raise FxShardError(f"{path}: the shards of {key} cover {covered} of its {math.prod(entry.size)} "
                                   "elements; the checkpoint is incomplete, load another one")
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, length in sorted(needed.items()):
        file = path / name
        if not file.is_file() or file.stat().st_size < length:
            state = "missing" if not file.is_file() else f"{file.stat().st_size} bytes, {length} needed"
            raise FxShardError(f"{path}: shard file {name} is {state}; the checkpoint is incomplete or damaged, "
                               "load another one (e.g. an earlier step)")
    return metadata


def load(model: nn.Module, optimizer: torch.optim.Optimizer, path: str | os.PathLike) -> dict:
    """Load a checkpoint ``save`` wrote (at any world size and stage, or one FSDP2 wrote with ``get_state_dict`` under
    the keys ``model`` and ``optim``) into a prepared model and optimizer, also one that has not stepped yet;
    returns its ``extra_state``. Everything is checked before anything changes: a checkpoint of another model, or
    one with a shard file missing, raises FxShardError. Every rank calls it."""
    path = pathlib.Path(path)
    module = _unwrapped(model)
    group = _group_of(module)
    model_state, optim_state = get_state_dict(module, optimizer)
    template = {"model": model_state, "optim": optim_state}
    metadata = _check_checkpoint(path, template)
    extra = {}
    for key, entry in metadata.state_dict_metadata.items():
        if key.startswith("extra."):
            name = key[len("extra."):]
            extra[name] = (torch.empty(entry.size, dtype=entry.properties.dtype)
                           if isinstance(entry, TensorStorageMetadata) else None)
    template["extra"] = extra
    dcp.load(template, checkpoint_id=path, process_group=group)
    set_state_dict(module, optimizer, model_state_dict=template["model"], optim_state_dict=template["optim"])
    return template["extra"]

