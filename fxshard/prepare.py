"""``prepare``: lay a model's parameters out for a ZeRO stage before the first trace.

| stage | trainable leaf (what ``named_parameters()`` yields) | full value in forward | optimizer runs on |
|---|---|---|---|
| 0 | the full parameter | the leaf itself | full parameters |
| 1 | the full parameter | the leaf itself | flat fp32 shards it owns (master shards) |
| 2 | the flat shard | a resident full copy (a non-persistent buffer) | the shards |
| 3 | the flat shard | gathered from the shards at each use | the shards |

For stages 0, 2 and 3 every module that owned a parameter reads it through an accessor (``module.weight``) that
returns the marker op ``fxshard.unshard``: Dynamo traces it into the graph, and run eagerly it does the real work.
Its backward, ``fxshard.reduce_grad``, all-reduces (stage 0) or reduce-scatters (stages 2, 3) the gradient. Stage 1
needs no marker: gradients stay full and local until ``optimizer.step()``, which reduce-scatters them into the
master shards, updates those, and all-gathers the result into the parameters.

Parameters are sharded by identity, so a tied embedding / LM head is one leaf read through two accessors. Buffers
stay replicated.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .errors import FxShardError
from .ops import reduce_grad, unshard
from .sharding import ShardSpec, shard_of

# Optimizers whose update is elementwise, so running them on flat shards equals running them on full tensors.
ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.RMSprop,
    torch.optim.NAdam,
    torch.optim.RAdam,
)

_SPECS = "_fxshard_specs"  # module attribute: {parameter attribute name: ShardSpec}
_PATH = "_fxshard_path"  # module attribute: the module's qualified name in the prepared model
_RESIDENT = "_fxshard_full_"  # buffer name prefix of a stage-2 parameter's resident full copy
_GRAD_SYNC = "_fxshard_grad_sync"  # module attribute: the model's GradSync


@dataclasses.dataclass
class GradSync:
    """Whether backward reduces gradients now (stage 0), and whether some were kept local since the last step."""

    enabled: bool = True
    local_grads_pending: bool = False


def grad_sync_of(model: nn.Module) -> GradSync:
    for module in model.modules():
        if hasattr(module, _GRAD_SYNC):
            return getattr(module, _GRAD_SYNC)
    raise FxShardError("this model was not prepared; call backend.prepare(model, optimizer) first")

_SPEC_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()  # trainable leaf (or stage-1 master shard) -> ShardSpec
_RESIDENT_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()  # stage-2 shard leaf -> its resident full copy


def spec_of(param: torch.Tensor) -> ShardSpec | None:
    """The ShardSpec of a leaf laid out by ``prepare``, or None for any other tensor."""
    return _SPEC_OF.get(param)


def is_prepared(model: nn.Module) -> bool:
    return any(hasattr(m, _SPECS) for m in model.modules())


def _read_unsharded(module: nn.Module, name: str) -> torch.Tensor:
    local = module._parameters[name]
    spec = getattr(module, _SPECS)[name]
    # Under torch.compile the backend makes this check (on the graph's inputs): Dynamo cannot trace a raise.
    if not torch.compiler.is_compiling() and (local is None or tuple(local.shape) != spec.local_shape):
        raise FxShardError(
            f"{spec.name} was replaced after prepare (it now has shape "
            f"{None if local is None else list(local.shape)}, prepare left {list(spec.local_shape)}); "
            "change the model before backend.prepare(model, optimizer), or prepare the changed model anew"
        )
    fqn = f"{getattr(module, _PATH)}.{name}" if getattr(module, _PATH) else name
    resident = module._buffers.get(_RESIDENT + name)
    grad_reduction = spec.grad_reduction
    if spec.stage == 0 and not getattr(module, _GRAD_SYNC).enabled:  # Dynamo guards on it: one graph per setting
        grad_reduction = "none"
    return unshard(local, resident, list(spec.full_shape), spec.world_size, spec.group_name, fqn, grad_reduction)


@functools.cache
def _accessor_class(cls: type, names: tuple[str, ...]) -> type:
    accessors = {name: property(functools.partial(_read_unsharded, name=name)) for name in names}
    return type(f"FxShard{cls.__name__}", (cls,), {**accessors, "__module__": cls.__module__})


def _state_dict_full(module, state_dict, prefix, local_metadata):
    # Stage 3 gathers here: a collective, so every rank must call state_dict() (as with FSDP's full state dict).
    with torch.no_grad():
        for name in getattr(module, _SPECS):
            if prefix + name in state_dict:
                state_dict[prefix + name] = _read_unsharded(module, name).detach()


def _load_state_dict_shard(module, state_dict, prefix, *args):
    for name, spec in getattr(module, _SPECS).items():
        key = prefix + name
        if key in state_dict:
            resident = module._buffers.get(_RESIDENT + name)
            if resident is not None:
                with torch.no_grad():
                    resident.copy_(state_dict[key])
            state_dict[key] = shard_of(state_dict[key], spec)


def _resolve_group(group):
    if not dist.is_available() or not dist.is_initialized():
        raise FxShardError(
            "no process group is initialized; call torch.distributed.init_process_group(...) "
            "(or launch with torchrun) before backend.prepare(model, optimizer)"
        )
    return group if group is not None else dist.group.WORLD


def _leaf_for(param: nn.Parameter, spec: ShardSpec) -> nn.Parameter:
    if not spec.trains_shard:
        return param
    return nn.Parameter(shard_of(param, spec), requires_grad=param.requires_grad)


def shard_parameters(model: nn.Module, stage: int, group=None) -> tuple[dict[int, nn.Parameter], GradSync]:
    """Lay out every parameter of ``model`` for ``stage``, in place; returns {id(original param): trainable leaf}
    and the model's GradSync."""
    if is_prepared(model) or any(spec_of(p) is not None for p in model.parameters()):
        raise FxShardError("this model is already prepared; call backend.prepare once per model")
    grad_sync = GradSync()
    model.__dict__[_GRAD_SYNC] = grad_sync
    group = _resolve_group(group)
    world_size, rank, group_name = dist.get_world_size(group), dist.get_rank(group), group.group_name
    leaves: dict[int, nn.Parameter] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        owned = {n: p for n, p in module._parameters.items() if p is not None}
        if not owned or hasattr(module, _SPECS):
            continue
        specs = {}
        for name, param in owned.items():
            if id(param) not in leaves:
                spec = ShardSpec(f"{path}.{name}" if path else name, tuple(param.shape), world_size, rank, group_name,
                                 stage)
                leaf = leaves[id(param)] = _leaf_for(param, spec)
                _SPEC_OF[leaf] = spec
                if stage == 2:  # the full storage stays on as the resident copy
                    _RESIDENT_OF[leaf] = param.detach()
            leaf = leaves[id(param)]
            specs[name] = _SPEC_OF[leaf]
            if stage == 1:
                continue
            module._parameters[name] = leaf
            if stage == 2:
                module.register_buffer(_RESIDENT + name, _RESIDENT_OF[leaf], persistent=False)
        if stage == 1:
            continue
        setattr(module, _SPECS, specs)
        setattr(module, _PATH, path)
        module.__dict__[_GRAD_SYNC] = grad_sync
        module.__class__ = _accessor_class(type(module), tuple(owned))
        module.register_state_dict_post_hook(_state_dict_full)
        module.register_load_state_dict_pre_hook(_load_state_dict_shard)
    return leaves, grad_sync


def _check_optimizer(optimizer: torch.optim.Optimizer, leaves: dict[int, nn.Parameter]) -> None:
    if type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
        supported = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
        raise FxShardError(
            f"{type(optimizer).__name__} is not supported: fxshard runs the optimizer on flat parameter shards, "
            f"which is exact only for elementwise optimizers ({supported}); use one of those"
        )
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in leaves]
        if missing:
            raise FxShardError(
                f"the optimizer holds {len(missing)} tensor(s) that are not parameters of the prepared model "
                f"(shapes {[list(p.shape) for p in missing][:3]}); build the optimizer over model.parameters()"
            )


def _master_shard(param: nn.Parameter) -> nn.Parameter:
    """Stage 1: the fp32 flat shard of a full parameter that the optimizer updates."""
    spec = spec_of(param)
    master = nn.Parameter(shard_of(param, spec), requires_grad=param.requires_grad)
    _SPEC_OF[master] = spec
    return master


def _gather_into(full: torch.Tensor, shard: torch.Tensor, spec: ShardSpec) -> None:
    gathered = unshard(shard.detach(), None, list(spec.full_shape), spec.world_size, spec.group_name, spec.name,
                       "reduce_scatter")
    full.detach().copy_(gathered)


def shard_optimizer_over(
    optimizer: torch.optim.Optimizer, leaves: dict[int, nn.Parameter], grad_sync: GradSync
) -> torch.optim.Optimizer:
    """A new optimizer of the same class and hyperparameters over what this rank updates (shard leaves, master
    shards for stage 1, full parameters for stage 0), existing state laid out the same way.

    Optimizers carry step hooks where a stage needs them: stage 0 all-reduces gradients that ``no_sync`` kept
    local; stage 1 reduce-scatters the full gradients into the master shards
    before the update (the parameters' ``.grad`` is then None) and all-gathers the masters into the parameters
    after it; stage 2 all-gathers the updated shards into the resident full copies.
    """
    _check_optimizer(optimizer, leaves)
    stage = spec_of(next(iter(leaves.values()))).stage if leaves else 3
    updated = {key: _master_shard(leaf) if stage == 1 else leaf for key, leaf in leaves.items()}
    groups = [{**group, "params": [updated[id(p)] for p in group["params"]]} for group in optimizer.param_groups]
    # Every group carries all its hyperparameters; defaults go to the constructor as far as it names them.
    accepted = inspect.signature(type(optimizer)).parameters
    sharded = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
    for param, state in optimizer.state.items():
        target = updated[id(param)]
        spec = spec_of(target)
        sharded.state[target] = {
            key: shard_of(value, spec)
            if stage >= 1 and torch.is_tensor(value) and tuple(value.shape) == spec.full_shape else value
            for key, value in state.items()
        }
    if stage == 0:
        sharded.register_step_pre_hook(functools.partial(_all_reduce_local_grads, list(leaves.values()), grad_sync))
    elif stage == 1:
        pairs = [(leaves[key], master) for key, master in updated.items() if master.requires_grad]
        sharded.register_step_pre_hook(functools.partial(_reduce_scatter_grads, pairs))
        sharded.register_step_post_hook(functools.partial(_gather_updated, pairs))
    elif stage == 2:
        residents = [(_RESIDENT_OF[leaf], leaf) for leaf in leaves.values() if leaf.requires_grad]
        sharded.register_step_post_hook(functools.partial(_gather_updated, residents))
    return sharded


@torch.no_grad()
def _all_reduce_local_grads(params, grad_sync: GradSync, optimizer, args, kwargs) -> None:
    # Averaging is idempotent on gradients that were already reduced, so a synced last micro-batch stays exact.
    if not grad_sync.local_grads_pending:
        return
    for param in params:
        if param.grad is not None:
            spec = spec_of(param)
            param.grad = reduce_grad(param.grad, spec.world_size, spec.group_name, spec.name, "all_reduce")
    grad_sync.local_grads_pending = False


@torch.no_grad()
def _reduce_scatter_grads(pairs, optimizer, args, kwargs) -> None:
    for full, master in pairs:
        if full.grad is None:
            master.grad = None
            continue
        spec = spec_of(master)
        master.grad = reduce_grad(full.grad, spec.world_size, spec.group_name, spec.name, "reduce_scatter")
        full.grad = None  # the master shard now carries it; full grads are freed as ZeRO-1 promises


@torch.no_grad()
def _gather_updated(pairs, optimizer, args, kwargs) -> None:
    for full, shard in pairs:
        _gather_into(full, shard, spec_of(shard))
