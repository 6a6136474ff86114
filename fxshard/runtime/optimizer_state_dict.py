"""The ``state_dict()`` / ``load_state_dict()`` hooks of the optimizer ``prepare`` returns.

Per-element state of a flat shard (stages 1-3: ``exp_avg`` of a shard) is saved as the DTensor of the parameter's
rows (``layout``), as FSDP2 saves it; loading lays any saved layout out as this rank holds it. Scalars such as
Adam's ``step``, and stage 0's full state, stay as they are.
"""

from __future__ import annotations

from itertools import chain

import torch
from torch.distributed.tensor import DTensor

from fxshard.errors import FxShardError

from .layout import full_from_value, shard_from_value, sharded_value, unsharded_value
from .param import spec_of
from .optimizer_record import replace_updated_state, updating_optimizer
from .sharding import ShardSpec

_MADE_FOR_STATE_DICT = "_fxshard_state_made_for_state_dict"


def updated_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What the optimizer's update writes, in the order of its parameters (stage 1: their master shards)."""
    return [p for group in updating_optimizer(optimizer).param_groups for p in group["params"]]


def is_per_element(value, updated: torch.Tensor) -> bool:
    """Optimizer state laid out like the tensor it belongs to (``exp_avg``), not a scalar (``step``)."""
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == updated.shape


@torch.no_grad()
def _initialise_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter its state, as the first step would, without changing a parameter: one step with zero
    gradients at learning rate 0 (what torch's ``get_state_dict`` does to an optimizer without state). The class's
    step runs, with the hooks prepare put around it, not a compiled ``opt.step`` the user assigned."""
    params = [p for p in updated_tensors(optimizer) if p.requires_grad]
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
    if optimizer.state or any(p.grad is not None for p in (*held, *updated_tensors(optimizer))):
        return
    _initialise_state(optimizer)
    setattr(optimizer, _MADE_FOR_STATE_DICT, True)


def optimizer_state_dict_post_hook(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """Per-element state of a flat shard (stages 1-3) becomes a DTensor of the parameter's full shape (see the
    module's docstring); stage 0's full state (under tensor parallelism: a DTensor over the tp dimension) and
    scalars stay as they are. A collective where a parameter's rows
    cross shard boundaries: every rank calls ``state_dict()``."""
    updated = updated_tensors(optimizer)
    state = {}
    for key, kinds in state_dict["state"].items():
        param = updated[key]
        spec = spec_of(param)
        state[key] = {
            kind: (sharded_value(value, spec) if spec.stage >= 1 else unsharded_value(value, spec))
            if is_per_element(value, param) else value
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
    updated = updated_tensors(optimizer)
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
