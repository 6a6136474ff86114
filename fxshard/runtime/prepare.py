"""``prepare``: lay a model's parameters out for a ZeRO stage before the first trace.

| stage | trainable leaf (what ``named_parameters()`` yields) | full value in forward | optimizer runs on |
|---|---|---|---|
| 0 | the full parameter | the leaf itself | full parameters |
| 1 | the full parameter | the leaf itself | flat fp32 shards it owns (master shards) |
| 2 | a DTensor of the parameter's shape: this rank's rows | a resident full copy (a non-persistent buffer) | the leaves |
| 3 | the same | gathered from the flat shards at each use | the leaves |

At stages 2 and 3 the leaf's local tensor is a view of the parameter's flat shard (``fxshard/runtime/sharding.py``),
a Parameter of its own kept in the owning module's ``__dict__``: the accessor hands it to the marker, so the graphs
read and the collectives move the flat shard, and a hook hands the gradient autograd gives it to the leaf
(``docs/architecture.md``: why the graphs do not read the DTensor).

For stages 0, 2 and 3 every module that owned a parameter reads it through an accessor (``module.weight``) that
returns the marker op ``fxshard.unshard``: Dynamo traces it into the graph, and run eagerly it does the real work.
Its backward, ``fxshard.reduce_grad``, all-reduces (stage 0) or reduce-scatters (stages 2, 3) the gradient. Stage 1
needs no marker: gradients stay full and local until ``optimizer.step()``, which reduce-scatters them into the
master shards, updates those, and all-gathers the result into the parameters.

A parameter that is a DTensor over a tensor-parallel mesh dimension is laid out by its local tensor, and its accessor
(at every stage, stage 1 included) returns the DTensor made of the full local value
(``fxshard.runtime.tensor_parallel``).

Parameters are sharded by identity, so a tied embedding / LM head is one leaf read through two accessors. Buffers
stay replicated.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fxshard.errors import FxShardError
from fxshard.torch_compat import intercept_conversions, own_buffers, own_parameters, tree_map

from .groups import COLLECTIVE_TIMEOUT_S, collective_group, group_over, peer_failures_explained
from .layout import (
    as_leaf_value,
    full_from_value,
    gather_full,
    rows_of_full,
    shard_from_value,
    sharded_value,
    unsharded_value,
)
from .materialise import InitFn, born_on_meta, default_device, materialise_unit_by_unit, share_random_state
from .ops import UNSHARD
from .param import (
    RESIDENT_BUFFER,
    GradSync,
    ModuleRecord,
    PreparedParam,
    attach,
    module_record,
    module_records,
    prepared_param,
    register,
    register_replaced,
    spec_of,
)
from .sharding import ShardSpec, layout_stage, shard_of
from .step_clock import StepClock
from .tensor_parallel import (
    TensorParallel,
    as_tensor_parallel,
    every_rank,
    local_parameter,
    local_tensor,
    local_value,
    tensor_parallel_layouts,
)

_UNITS = "_fxshard_units"  # the prepared model's attribute, born on meta: {unit: parameter elements materialised}


def grad_sync_of(model: nn.Module) -> GradSync:
    for _, record in module_records(model):
        return record.grad_sync
    raise FxShardError("this model was not prepared; call backend.prepare(model, optimizer) first")

def tensor_parallel_of(model: nn.Module) -> list[TensorParallel]:
    """The tensor-parallel layouts of ``model``'s prepared parameters ([]: none is a DTensor)."""
    return [s.tensor_parallel for p in model.parameters()
            if (s := spec_of(p)) is not None and s.tensor_parallel is not None]


def sharded_world_size(model: nn.Module) -> int | None:
    """The ranks ``model``'s parameters are sharded over (a hybrid mesh's shard dimension), or None unprepared."""
    return next((spec.world_size for p in model.parameters() if (spec := spec_of(p)) is not None), None)


def materialised_units(model: nn.Module) -> dict[str, int]:
    """{unit: parameter elements it held real at once} for a model prepare materialised from the meta device, one
    unit at a time; {} for a model that came to prepare built whole."""
    return dict(getattr(model, _UNITS, {}))


def is_prepared(model: nn.Module) -> bool:
    return next(module_records(model), None) is not None


def _read_unsharded(module: nn.Module, name: str) -> torch.Tensor:
    laid_out = module_record(module)
    read = laid_out.reads[name]
    local = own_parameters(module)[name]
    if local is not read.leaf:
        if not torch.compiler.is_compiling():
            spec = laid_out.params[name].spec
            raise FxShardError(
                f"{spec.name} was replaced after prepare (it now has shape "
                f"{None if local is None else list(local.shape)}, prepare left {list(spec.leaf_shape)}); "
                "change the model before backend.prepare(model, optimizer), or prepare the changed model anew"
            )
        return local  # Dynamo cannot trace a raise: the backend refuses the parameter it did not lay out, by name
    resident = own_buffers(module).get(read.resident)  # (read before the flat shard: the graph's input order)
    if read.shard is None:  # stage 1 reads it directly: an accessor only wraps a tensor-parallel piece
        full = local
    else:
        shard = read.shard
        if shard is not local and not local.requires_grad:  # frozen after prepare: its flat shard gets no gradient
            shard = shard.detach()
        marker = read.marker
        if read.grad_sync is not None and not read.grad_sync.enabled:  # Dynamo guards on it: a graph per setting
            marker = read.kept_local
        full = UNSHARD(shard, resident, *marker)
    return full if read.tensor_parallel is None else as_tensor_parallel(full, read.tensor_parallel)


@functools.cache
def _accessor_class(cls: type, names: tuple[str, ...]) -> type:
    accessors = {name: property(functools.partial(_read_unsharded, name=name)) for name in names}
    return type(f"FxShard{cls.__name__}", (cls,), {**accessors, "__module__": cls.__module__})



def _saved_value(param: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """What ``state_dict()`` holds for a parameter, in the dtype it trains in (the fp32 master under mixed
    precision): the parameter itself where every rank holds it in full (stage 0; stage 1 without mixed precision),
    else a DTensor of its full shape holding this rank's rows (``fxshard.runtime.layout``: the layout DCP and
    FSDP2 reshard)."""
    record = prepared_param(param)
    resident = record.resident
    if resident is not None and resident.dtype == param.dtype:  # stage 2's resident copy holds exactly this
        return rows_of_full(resident, spec)
    if spec.trains_shard:
        return sharded_value(record.flat, spec)
    master = record.master
    if master is not None and master.dtype != param.dtype:  # stage 1 computes in a lower precision than it trains
        return sharded_value(master, spec)
    return unsharded_value(param, spec)


_STATE_DICT_IS_COLLECTIVE = (
    "model.state_dict(), which gathers the fp32 master of every 0-d parameter (it has no rows to split over the ranks; "
    "stage 1 under mixed precision) and "
    "so runs on every rank. A rank-0-only save (`if rank == 0: torch.save(model.state_dict(), path)`) waits for "
    "ranks that never come, and would hold rank 0's rows only: call get_model_state_dict(model, "
    "options=StateDictOptions(full_state_dict=True, cpu_offload=True)) on every rank and torch.save its result on "
    "rank 0, or fxshard.checkpoint.save on every rank (docs/training-scripts.md#saving-the-model)")


def _state_dict_values(module, state_dict, prefix, local_metadata):
    with peer_failures_explained(_STATE_DICT_IS_COLLECTIVE):
        for name, record in module_record(module).params.items():
            if prefix + name in state_dict:
                state_dict[prefix + name] = _saved_value(own_parameters(module)[name], record.spec)


def _load_state_dict_shard(module, state_dict, prefix, *args):
    """Each value (a full tensor, or a DTensor of any layout) becomes what this rank keeps: its shard of the leaf
    (stages 2, 3), the full parameter and its master shard (stage 1), the full parameter (stage 0)."""
    for name, record in module_record(module).params.items():
        spec, key = record.spec, prefix + name
        if key not in state_dict:
            continue
        value, param = state_dict[key], own_parameters(module)[name]
        with torch.no_grad():
            if spec.trains_shard:
                shard = shard_from_value(value, spec, param.dtype, key)
                resident = own_buffers(module).get(RESIDENT_BUFFER + name)
                if resident is not None:  # a full tensor is copied as it is; a DTensor's rows are gathered
                    full = (gather_full(shard, spec, resident.dtype) if isinstance(value, DTensor)
                            else full_from_value(value, spec, key))
                    resident.copy_(full)
                state_dict[key] = as_leaf_value(shard, spec)
                continue
            full = full_from_value(value, spec, key)
            master = prepared_param(param).master
            if master is not None:  # stage 1: the master takes the full precision, the parameter a cast copy
                master.copy_(shard_of(full, spec))
            state_dict[key] = full


def _refuse_conversion(module: nn.Module, fn, recurse: bool = True):
    """``module._apply`` (what ``.to()``, ``.double()``, ``.cuda()`` run) of a module prepared at stages 1-3: each
    parameter lives in more than one tensor prepare registered (stage 1: the full parameter and its master, stage
    2: the shard and the resident buffer, stages 2-3: the leaf's rows and the flat shard the collectives move); a
    conversion makes new tensors the model reads while the step and the collectives keep using the old ones, so it
    is refused before any tensor changes. A conversion that changes no parameter (``.to()`` the dtype and device
    it already has) converts the buffers only: a DTensor leaf cannot be swapped in place (torch's ``_apply`` would
    try)."""
    changed = next((record for m, laid_out in module_records(module) for name, record in laid_out.params.items()
                    if (param := own_parameters(m)[name]) is not None and fn(param) is not param), None)
    if changed is not None:
        spec = changed.spec
        raise FxShardError(
            f"converting a prepared stage-{spec.stage} model ({spec.name} and the rest: .to(), .double(), .cuda() "
            "...) would leave the tensors the optimizer and the collectives write into behind, and training would "
            "silently stop updating what forward reads; convert the model before backend.prepare(model, optimizer)"
        )
    for owner in module.modules() if recurse else [module]:
        for name, buffer in own_buffers(owner).items():
            if buffer is not None:
                own_buffers(owner)[name] = fn(buffer)
    return module


def _casting_inputs_class(cls: type, dtype: torch.dtype) -> type:
    """``cls`` whose forward first casts its floating-point inputs to ``dtype`` (mixed precision: FSDP2's
    ``cast_forward_inputs``), so a float input meets weights of its own dtype. In forward, not in a forward
    pre-hook: ``torch.compile(model)`` of a model class of one's own runs hooks outside Dynamo, which would compile
    the cast as a graph of its own, and a compiled function that calls the model (``fullgraph=True``) must trace
    it inline."""

    def forward(self, *args, **kwargs):
        def cast(value):
            return value.to(dtype) if torch.is_tensor(value) and value.is_floating_point() else value

        args, kwargs = tree_map(cast, (args, kwargs))
        return super(casting, self).forward(*args, **kwargs)

    casting = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})
    return casting


def _resolve_group(group):
    if not dist.is_available() or not dist.is_initialized():
        raise FxShardError(
            "no process group is initialized; call torch.distributed.init_process_group(...) "
            "(or launch with torchrun) before backend.prepare(model, optimizer)"
        )
    return group if group is not None else dist.group.WORLD


@torch.no_grad()
def _broadcast_from_first_rank(model: nn.Module, groups) -> None:
    """Every rank starts from the first rank's parameters and buffers, as DDP and FSDP's ``sync_module_states`` do:
    ranks that initialised with different seeds would otherwise train a patchwork (stage 3) or drift apart
    (stages 0, 1) without any error. On a 2-D mesh (``groups``: the shard group, then the replicate group) each
    shard group takes its first rank's values, then each replicate group its first rank's: every rank the mesh's
    first rank's."""
    tensors = list({id(t): t for t in [*model.parameters(), *model.buffers()]}.values())
    for group in groups:
        source = dist.get_global_rank(group, 0)
        for tensor in tensors:  # a tensor-parallel parameter: its local piece, over the data-parallel groups
            dist.broadcast(local_tensor(tensor).data, src=source, group=group)


def _hand_gradient_to(leaf_ref: weakref.ref, spec: ShardSpec):
    """The hook that moves each gradient autograd accumulates into a flat shard (what the graphs read and reduce)
    onto the leaf the model holds, as its rows (``as_leaf_value``): set, or added where the leaf has one
    (accumulation over micro-batches). The flat shard keeps none, so ``zero_grad`` of the leaves is all it takes."""
    def hand_over(flat: nn.Parameter) -> None:
        grad, flat.grad = flat.grad, None
        leaf = leaf_ref()
        if leaf is None or grad is None:  # (a compiled graph that reads the shard detached, frozen, gives none)
            return
        value = as_leaf_value(grad, spec)
        if leaf.grad is None:
            leaf.grad = value
        else:
            leaf.grad += value
    return hand_over


def _lay_out(param: nn.Parameter, spec: ShardSpec, grad_sync: GradSync,
             shard: torch.Tensor | None = None) -> PreparedParam:
    """The record of ``param`` laid out under ``spec``: its trainable leaf and the tensors around it by stage,
    registered (the caller keeps the record alive: its modules will own it); ``shard``: where a flat shard's values
    go (default: a new tensor)."""
    kept = {}
    leaf = param
    if spec.trains_shard:
        flat = nn.Parameter(shard_of(param, spec, out=shard), requires_grad=param.requires_grad)
        leaf = nn.Parameter(as_leaf_value(flat.detach(), spec), requires_grad=param.requires_grad)
        if flat.requires_grad:
            flat.register_post_accumulate_grad_hook(_hand_gradient_to(weakref.ref(leaf), spec))
        kept["flat"] = flat
    if spec.stage == 1:  # the optimizer updates a flat shard in the parameter's own precision
        kept["master"] = nn.Parameter(shard_of(param, spec), requires_grad=param.requires_grad)
        if spec.param_dtype is not None:
            param.data = param.data.to(spec.param_dtype)
    elif spec.stage == 2:  # the full storage stays on as the resident copy, in the compute dtype
        kept["resident"] = param.detach().to(spec.param_dtype or param.dtype)
    record = register(PreparedParam(spec, leaf, grad_sync, **kept))
    if leaf is not param:
        register_replaced(param, leaf)
    return record


def _specs_by_parameter(model: nn.Module, spec_for) -> dict[int, tuple[nn.Parameter, ShardSpec]]:
    """{id(parameter): (parameter, spec_for(its name, parameter))}: each parameter once, named after its first owner
    in module order (a tied parameter is one entry)."""
    specs: dict[int, tuple[nn.Parameter, ShardSpec]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for name, param in own_parameters(module).items():
            if param is not None and id(param) not in specs:
                specs[id(param)] = (param, spec_for(f"{path}.{name}" if path else name, param))
    return specs


def shard_parameters(
    model: nn.Module,
    stage: int,
    group=None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
    replicate_group=None,
    mesh_group=None,
    mesh=None,
    *,
    param_init_fn: InitFn | None = None,
    device: torch.device | str | None = None,
    init_units: tuple[str, ...] = (),
) -> tuple[dict[int, nn.Parameter], GradSync]:
    """Lay out every parameter of ``model`` for ``stage``, in place; returns {id(original param): trainable leaf}
    and the model's GradSync. Each ShardSpec names the group fxshard communicates on (``collective_group``), and
    with ``replicate_group`` (hybrid sharding) the group each shard's gradient is then averaged over and
    ``mesh_group``, every rank of the mesh. Parameters that are DTensors over a tensor-parallel mesh dimension
    (``parallelize_module``) are laid out by their local tensors (``fxshard.runtime.tensor_parallel``); their
    mesh and ``mesh``, the backend's, must be slices of one mesh.

    A model built on the meta device is materialised one module at a time on ``device`` (default: the CPU, or the
    current CUDA device on NCCL) and initialised by ``param_init_fn`` or each module's ``reset_parameters()``, a
    block of ``init_units`` (module names) at a time (``fxshard.runtime.materialise``); a built model's parameters
    and buffers are the first rank's (broadcast)."""
    if is_prepared(model) or any(spec_of(p) is not None for p in model.parameters()):
        raise FxShardError("this model is already prepared; call backend.prepare once per model")
    tensor_parallel = tensor_parallel_layouts(model, mesh, collective_timeout_s)
    grad_sync = GradSync()
    group = _resolve_group(group)
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    group_name = collective_group(group, collective_timeout_s).group_name
    replicas = {} if replicate_group is None else {
        "replicate_size": dist.get_world_size(replicate_group),
        "replicate_group_name": collective_group(replicate_group, collective_timeout_s).group_name,
        "mesh_group_name": collective_group(_resolve_group(mesh_group), collective_timeout_s).group_name,
    }
    if tensor_parallel:  # a checkpoint is written, and graphs compared, by every rank of both dimensions
        every = group_over(every_rank(mesh, next(iter(tensor_parallel.values()))))
        replicas["mesh_group_name"] = collective_group(every, collective_timeout_s).group_name
    synced_over = [group] if replicate_group is None else [group, replicate_group]
    specs = _specs_by_parameter(model, lambda name, param: ShardSpec(
        name, tuple(local_tensor(param).shape), world_size, rank, group_name,
        layout_stage(stage, local_tensor(param).shape), param_dtype, reduce_dtype,
        **replicas, tensor_parallel=tensor_parallel.get(id(param))))
    records: dict[int, PreparedParam] = {}  # (kept alive here until the modules that own them take them)
    born = born_on_meta(model)
    if device is not None:
        device = torch.device(device)
    elif born:
        device = default_device(group)
    if born and device.type != "meta":
        # under tensor parallelism every rank initialises each parameter whole and keeps its tp piece: all alike
        share_random_state([every] if tensor_parallel else synced_over, device)
        # Every shard allocated before any module is materialised: a full parameter freed below a shard allocated
        # after it would leave a hole the allocator keeps (glibc), and the prepare peak would exceed the ledger's
        shards = {key: torch.empty(spec.chunk, dtype=param.dtype, device=device)
                  for key, (param, spec) in specs.items() if spec.trains_shard}

        def keep(meta: nn.Parameter, full: torch.Tensor) -> None:
            spec = specs[id(meta)][1]
            if spec.tensor_parallel is not None:  # initialised whole, as one process would: this tp rank's piece
                full = local_value(full, spec.tensor_parallel).clone()  # (a view would keep the whole alive)
            records[id(meta)] = _lay_out(nn.Parameter(full, requires_grad=meta.requires_grad), spec, grad_sync,
                                         shards.pop(id(meta), None))
            register_replaced(meta, records[id(meta)].leaf)

        model.__dict__[_UNITS] = materialise_unit_by_unit(model, param_init_fn, keep, device, init_units)
    else:  # parameters laid out as they are: real ones, or meta ones never materialised (a model only compiled and
        # predicted, fxshard.predict: device="meta")
        if not born:
            if param_init_fn is not None or device is not None:
                raise FxShardError(
                    "param_init_fn= and device= materialise a model built on the meta device; this model's "
                    'parameters are real already. Build it under `with torch.device("meta"):` to have prepare '
                    "initialise it shard by shard, or drop these arguments"
                )
            _broadcast_from_first_rank(model, synced_over)
        for key, (param, spec) in specs.items():
            records[key] = _lay_out(local_parameter(param), spec, grad_sync)
    leaves = {key: record.leaf for key, record in records.items()}
    if leaves:  # its steps are compared over every rank that holds a piece of it, on its tensors' device
        first = next(iter(leaves.values()))
        grad_sync.clock = StepClock(spec_of(first).all_ranks_group_name, local_tensor(first).device)
    for path, module in model.named_modules(remove_duplicate=False):
        owned = {n: p for n, p in own_parameters(module).items() if p is not None}
        if not owned or module_record(module) is not None:
            continue
        attach(module, ModuleRecord(path, {name: records[id(param)] for name, param in owned.items()}, grad_sync))
        if stage >= 1:
            intercept_conversions(module, functools.partial(_refuse_conversion, module))
        module.register_state_dict_post_hook(_state_dict_values)
        module.register_load_state_dict_pre_hook(_load_state_dict_shard)
        for name, param in owned.items():
            own_parameters(module)[name] = leaves[id(param)]  # the parameter itself, unless sharded or born on meta
        if stage == 1 and not any(spec_of(leaves[id(p)]).tensor_parallel for p in owned.values()):
            continue  # no marker: the parameters stay the leaves, read directly
        for name, param in owned.items():
            if stage == 2:
                module.register_buffer(RESIDENT_BUFFER + name, records[id(param)].resident, persistent=False)
        module.__class__ = _accessor_class(type(module), tuple(owned))
    if param_dtype is not None:
        model.__class__ = _casting_inputs_class(type(model), param_dtype)
    for key in tensor_parallel:  # the DTensor parameters (the optimizer holds them) are replaced at every stage
        register_replaced(specs[key][0], leaves[key])
    return leaves, grad_sync
