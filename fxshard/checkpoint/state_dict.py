"""Model and optimizer state dicts of a prepared model keyed by parameter name, as torch's
``torch.distributed.checkpoint.state_dict`` functions return them for an FSDP2 model.

DCP keys optimizer state by parameter name only through ``get_state_dict``, which finds a parameter's name by
identity in ``model.named_parameters()``: the optimizer ``prepare`` returns holds the model's parameters at every
stage (at stages 1-3 its step steps an inner optimizer over the flat shards:
``fxshard.runtime.optim.FlatShardUpdate``), so torch's ``get_state_dict`` / ``set_state_dict`` work. The functions here take the same arguments and return the same dicts,
and check a state dict against the model and optimizer before anything changes. The values are laid out as
``fxshard.runtime.layout`` says: DTensors of the full shape where a rank holds a shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor

from fxshard.errors import FxShardError
from fxshard.runtime.optimizer_state_dict import updated_tensors
from fxshard.runtime.param import module_record, module_records, spec_of
from fxshard.runtime.prepare import is_prepared
from fxshard.torch_compat import (
    child_modules,
    flatten_optimizer_state_dict,
    is_persistent_buffer,
    own_buffers,
    own_parameters,
    resolve_group,
)


# -- get / set, keyed by parameter name -------------------------------------------------------------------------------
def prepared_module(model: nn.Module) -> nn.Module:
    """The module ``prepare`` returned, also when given its ``torch.compile`` wrapper (whose keys carry
    ``_orig_mod.``)."""
    module = getattr(model, "_orig_mod", model)
    if not is_prepared(module):
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


def is_first_rank(group) -> bool:
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
    pieces = [torch.empty_like(padded) for _ in range(dist.get_world_size(group))] if is_first_rank(group) else None
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
    return full if not to_first_rank_only or is_first_rank(group) else {}


def checkpoint_group(module: nn.Module):
    """Every rank that holds a piece of the model: its shard group, or on a hybrid mesh all of the mesh (each
    replica group writes the same rows; DCP keeps one copy)."""
    spec = next(record.spec for _, laid_out in module_records(module) for record in laid_out.params.values())
    return resolve_group(spec.all_ranks_group_name)


def get_model_state_dict(model: nn.Module, *, options: StateDictOptions | None = None) -> dict:
    """``model.state_dict()`` of a prepared model, keyed by parameter name (no ``_orig_mod.``): sharded tensors as
    DTensors of their full shape. ``StateDictOptions(full_state_dict=True)`` gathers them one at a time (with
    ``cpu_offload=True``: to the first rank only, the others get ``{}``). A collective: every rank calls it."""
    options = _checked_options(options)
    module = prepared_module(model)
    state_dict = module.state_dict()
    if options.ignore_frozen_params:
        frozen = {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
        state_dict = {k: v for k, v in state_dict.items() if k not in frozen}
    return _consolidated(state_dict, options, checkpoint_group(module)) if options.full_state_dict else state_dict


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
    module = prepared_module(model)
    names = [_name_of(p) for p in updated_tensors(optimizer)]
    positional = optimizer.state_dict()
    state_dict = {
        "state": {names[key]: kinds for key, kinds in positional["state"].items()},
        "param_groups": [{**group, "params": [names[key] for key in group["params"]]}
                         for group in positional["param_groups"]],
    }
    if options.full_state_dict:
        state_dict = _consolidated(state_dict, options, checkpoint_group(module))
        if not state_dict:
            return state_dict
    if options.flatten_optimizer_state_dict:
        state_dict = flatten_optimizer_state_dict(state_dict)
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
        records = laid_out.params if (laid_out := module_record(mod)) is not None else {}
        for name, param in own_parameters(mod).items():
            if param is not None:
                entries[prefix + name] = records[name].spec.global_shape if name in records else tuple(param.shape)
        for name, buffer in own_buffers(mod).items():
            if buffer is not None and is_persistent_buffer(mod, name):
                entries[prefix + name] = tuple(buffer.shape)
        for name, child in child_modules(mod).items():
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
    module = prepared_module(model)
    _check_model_state_dict(module, model_state_dict, options.strict)
    return module.load_state_dict(model_state_dict, strict=options.strict)


def _unflattened(optimizer: torch.optim.Optimizer, flat: dict) -> dict:
    """torch's flat optimizer state dict (``state.<name>.<kind>``, ``param_groups.<name>.<hyperparameter>``) nested
    again, for this optimizer's parameter names."""
    names = [_name_of(p) for p in updated_tensors(optimizer)]
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
    prepared_module(model)
    if "state" not in optim_state_dict and "param_groups" not in optim_state_dict:
        optim_state_dict = _unflattened(optimizer, optim_state_dict)
    names = [_name_of(p) for p in updated_tensors(optimizer)]
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
    module = prepared_module(model)
    _check_model_state_dict(module, model_state_dict, options.strict)
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return module.load_state_dict(model_state_dict, strict=options.strict)
