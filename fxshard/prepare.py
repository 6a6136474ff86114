"""``prepare``: split a model's parameters into this rank's shards before the first trace.

After ``prepare`` every module that owned a parameter keeps the flat shard as the trainable leaf under the
parameter's own name (``named_parameters()`` lists shards with clean names), and reading the attribute
(``module.weight``) returns ``fxshard.unshard(shard)``: a marker op that Dynamo traces into the graph and that
gathers the full weight when run eagerly. Parameters are sharded by identity, so a tied embedding / LM head is one
shard read through two accessors. Buffers stay replicated.
"""

from __future__ import annotations

import functools
import inspect
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .errors import FxShardError
from .ops import unshard
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


def spec_of(param: torch.Tensor) -> ShardSpec | None:
    """The ShardSpec of a shard leaf made by ``prepare``, or None for any other tensor."""
    return _SHARD_SPECS.get(param)


_SHARD_SPECS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # shard leaf -> ShardSpec


def is_prepared(model: nn.Module) -> bool:
    return any(hasattr(m, _SPECS) for m in model.modules())


def _read_unsharded(module: nn.Module, name: str) -> torch.Tensor:
    shard = module._parameters[name]
    spec = getattr(module, _SPECS)[name]
    # Under torch.compile the backend makes this check (on the graph's inputs): Dynamo cannot trace a raise.
    if not torch.compiler.is_compiling() and (shard is None or tuple(shard.shape) != spec.shard_shape):
        raise FxShardError(
            f"{spec.name} was replaced after prepare (it now has shape "
            f"{None if shard is None else list(shard.shape)}, its shard has {list(spec.shard_shape)}); "
            "change the model before backend.prepare(model, optimizer), or prepare the changed model anew"
        )
    fqn = f"{getattr(module, _PATH)}.{name}" if getattr(module, _PATH) else name
    return unshard(shard, list(spec.full_shape), spec.world_size, spec.group_name, fqn)


@functools.cache
def _sharded_class(cls: type, names: tuple[str, ...]) -> type:
    accessors = {name: property(functools.partial(_read_unsharded, name=name)) for name in names}
    return type(f"FxShard{cls.__name__}", (cls,), {**accessors, "__module__": cls.__module__})


def _state_dict_full(module, state_dict, prefix, local_metadata):
    # Gathers the full weights: a collective, so every rank must call state_dict() (as with FSDP's full state dict).
    with torch.no_grad():
        for name in getattr(module, _SPECS):
            key = prefix + name
            if key in state_dict:
                state_dict[key] = _read_unsharded(module, name).detach()


def _load_state_dict_shard(module, state_dict, prefix, *args):
    for name, spec in getattr(module, _SPECS).items():
        key = prefix + name
        if key in state_dict:
            state_dict[key] = shard_of(state_dict[key], spec)


def _resolve_group(group):
    if not dist.is_available() or not dist.is_initialized():
        raise FxShardError(
            "no process group is initialized; call torch.distributed.init_process_group(...) "
            "(or launch with torchrun) before backend.prepare(model, optimizer)"
        )
    return group if group is not None else dist.group.WORLD


def shard_parameters(model: nn.Module, group=None) -> dict[int, nn.Parameter]:
    """Replace every parameter of ``model`` by this rank's shard, in place; returns {id(old param): shard}."""
    if is_prepared(model):
        raise FxShardError("this model is already prepared; call backend.prepare once per model")
    group = _resolve_group(group)
    world_size, rank, group_name = dist.get_world_size(group), dist.get_rank(group), group.group_name
    shards: dict[int, nn.Parameter] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        owned = {n: p for n, p in module._parameters.items() if p is not None}
        if not owned or hasattr(module, _SPECS):
            continue
        specs = {}
        for name, param in owned.items():
            if id(param) not in shards:
                spec = ShardSpec(f"{path}.{name}" if path else name, tuple(param.shape), world_size, rank, group_name)
                shard = nn.Parameter(shard_of(param, spec), requires_grad=param.requires_grad)
                _SHARD_SPECS[shard] = spec
                shards[id(param)] = shard
            specs[name] = _SHARD_SPECS[shards[id(param)]]
            module._parameters[name] = shards[id(param)]
        setattr(module, _SPECS, specs)
        setattr(module, _PATH, path)
        module.__class__ = _sharded_class(type(module), tuple(owned))
        module.register_state_dict_post_hook(_state_dict_full)
        module.register_load_state_dict_pre_hook(_load_state_dict_shard)
    return shards


def shard_optimizer_over(optimizer: torch.optim.Optimizer, shards: dict[int, nn.Parameter]) -> torch.optim.Optimizer:
    """A new optimizer of the same class and hyperparameters over the shard leaves, its state (if any) sharded."""
    if type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
        supported = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
        raise FxShardError(
            f"{type(optimizer).__name__} is not supported: fxshard runs the optimizer on flat parameter shards, "
            f"which is exact only for elementwise optimizers ({supported}); use one of those"
        )
    groups = []
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in shards]
        if missing:
            raise FxShardError(
                f"the optimizer holds {len(missing)} tensor(s) that are not parameters of the prepared model "
                f"(shapes {[list(p.shape) for p in missing][:3]}); build the optimizer over model.parameters()"
            )
        groups.append({**group, "params": [shards[id(p)] for p in group["params"]]})
    # Every group carries all its hyperparameters; defaults go to the constructor as far as it names them.
    accepted = inspect.signature(type(optimizer)).parameters
    sharded = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
    for param, state in optimizer.state.items():
        shard = shards[id(param)]
        spec = _SHARD_SPECS[shard]
        sharded.state[shard] = {
            key: shard_of(value, spec) if torch.is_tensor(value) and tuple(value.shape) == spec.full_shape else value
            for key, value in state.items()
        }
    return sharded
