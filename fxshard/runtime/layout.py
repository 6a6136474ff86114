"""A flat shard as the value a stage-2/3 leaf and a state dict hold: a DTensor of the parameter's full shape holding
this rank's rows.

fxshard keeps every parameter as a FLAT, row-aligned shard (``fxshard/runtime/sharding.py``). DCP cannot describe a
flat range; a state dict therefore holds what FSDP2's holds:
every tensor that lives sharded (a parameter of stages 2 and 3, a stage-1 fp32 master under mixed precision, a
per-element optimizer state such as ``exp_avg`` in stages 1-3) becomes a ``DTensor`` of the parameter's FULL shape,
``Shard(0)`` on a 1-D ``DeviceMesh`` over the group fxshard communicates on: rank ``r`` holds rows
``[r * R, (r + 1) * R)`` with ``R = ceil(rows / world size)`` (``torch.chunk``'s split: the last ranks may hold fewer
rows, or none). Tensors that every rank holds in full (stage 0, stage 1's parameters, scalars such as Adam's
``step``) stay plain tensors, which DCP treats as replicated and writes once.

Shards are row-aligned, so each rank's rows ARE the elements of its flat shard before its padding: the DTensor's
local tensor is a view of the shard (no copy, no communication: a state dict is local, as FSDP2's is), and
``dcp.load`` writes straight into it. A 0-d parameter has no rows: in a stage-2/3 model every rank holds it whole
(``sharding.layout_stage``); a stage-1 fp32 master of one (mixed precision) is gathered, one element.

Under tensor parallelism (``fxshard/runtime/tensor_parallel.py``) fxshard shards each tp rank's local tensor, so
the rows above are rows of that local tensor, and the DTensor has the parameter's global shape over two mesh
dimensions (fxshard's shard dimension, then the tp one); a tensor held in full is a DTensor over the tp dimension.

The leaves of stages 2 and 3 (``as_leaf_value``), the module state dicts (``prepare``'s hooks) and the optimizer's
(``optimizer_state_dict``) build on this.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from fxshard.errors import FxShardError
from fxshard.torch_compat import resolve_group

from .ops import unshard
from .sharding import MarkerLayout, ShardSpec, row_size, shard_of
from .tensor_parallel import as_tensor_parallel, global_value, local_value


def gather_full(shard: torch.Tensor, spec: ShardSpec, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The full-shape value of a shard (flat, or the DTensor of this rank's rows; a collective: every rank of the
    group must call it), in ``dtype`` (cast before the gather, so it moves ``dtype`` bytes) or the shard's own."""
    return unshard(flat_shard(shard, spec).detach(), None, list(spec.full_shape), spec.world_size, spec.group_name,
                   spec.name, MarkerLayout.GATHER.value, dtype)


_MESHES: dict[tuple[str, str], tuple[object, DeviceMesh]] = {}  # (group name, device type) -> (group, its mesh)


def mesh_of(spec: ShardSpec, device_type: str) -> DeviceMesh:
    """The 1-D DeviceMesh over the group ``spec``'s collectives run on (the one ``prepare`` recorded, not the world
    group). Made once per group; a group destroyed and re-made under the same name gets a new mesh."""
    group = resolve_group(spec.group_name)
    cached = _MESHES.get((spec.group_name, device_type))
    if cached is None or cached[0] is not group:
        cached = (group, DeviceMesh.from_group(group, device_type))
        _MESHES[(spec.group_name, device_type)] = cached
    return cached[1]


def _as_dtensor(local: torch.Tensor, spec: ShardSpec) -> DTensor:
    """This rank's rows as a DTensor of the parameter's global shape: ``Shard(0)`` over fxshard's group, or under
    tensor parallelism over fxshard's shard dimension and the tp one (``TensorParallel.sharded_placements``)."""
    tp = spec.tensor_parallel
    if tp is not None:
        return DTensor.from_local(local, tp.sharded_mesh, tp.sharded_placements, run_check=False, shape=tp.shape,
                                  stride=tp.stride)
    # A model that stays on the meta device (fxshard.predict) gets a CPU mesh, as FSDP2 puts meta local tensors on
    # a mesh of a real device: from torch 2.15 DTensor's sharding propagation asks a meta mesh for its device count.
    device_type = "cpu" if local.device.type == "meta" else local.device.type
    return DTensor.from_local(local, mesh_of(spec, device_type), [Shard(0)], run_check=False,
                              shape=torch.Size(spec.full_shape), stride=_contiguous_strides(spec.full_shape))


def unsharded_value(full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """What a state dict holds for a tensor of ``spec``'s parameter that this rank holds in full (stage 0, stage 1's
    parameters, a 0-d parameter): the tensor itself, or under tensor parallelism a DTensor of this tp rank's piece."""
    return full.detach() if spec.tensor_parallel is None else as_tensor_parallel(full.detach(), spec.tensor_parallel)


def global_of(full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """The whole parameter-shaped tensor one process would hold, from a full (gathered over fxshard's group) one: the
    tensor itself, or under tensor parallelism gathered over the tp dimension too (a collective)."""
    return full if spec.tensor_parallel is None else global_value(full, spec.tensor_parallel)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def rows_view(flat: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """This rank's rows of the parameter, a view of the flat shard's elements before its padding."""
    start, stop = spec.rows
    return flat[: (stop - start) * row_size(spec.full_shape)].view(stop - start, *spec.full_shape[1:])


def as_leaf_value(flat: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """What a stage-2/3 leaf holds of the flat shard ``flat``: the DTensor of the parameter's shape whose local
    tensor is a view of this rank's rows in it (so an update of the leaf writes into ``flat``)."""
    return _as_dtensor(rows_view(flat, spec), spec)


def flat_shard(value: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """The flat, zero-padded shard (``spec.chunk`` elements) of a per-element tensor of ``spec``'s layout held as a
    leaf holds it (the DTensor of this rank's rows, ``as_leaf_value``); a flat one is itself."""
    if not isinstance(value, DTensor):
        return value
    rows = value.to_local().reshape(-1)
    padding = spec.chunk - rows.numel()
    return torch.nn.functional.pad(rows, (0, padding)) if padding else rows


@torch.no_grad()
def sharded_value(shard: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """What a state dict holds for a flat shard of ``spec``'s parameter (a parameter, a master, an optimizer state
    of the parameter's layout): a DTensor of the full shape whose local tensor is a view of this rank's rows in the
    shard. A 0-d parameter has no rows to split (a stage-1 master of one): every rank gets it whole (a plain tensor,
    gathered: one element, a collective)."""
    shard = shard.detach()
    if not spec.full_shape:
        return unsharded_value(gather_full(shard, spec), spec)
    return as_leaf_value(shard, spec)


def rows_of_full(full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """The state-dict value of a parameter whose full value this rank holds anyway (stage 2's resident copy): a
    DTensor whose local tensor is a view of this rank's rows. No communication."""
    start, stop = spec.rows
    return _as_dtensor(full.detach()[start:stop], spec)


def _check_shape(value, spec: ShardSpec, what: str) -> None:
    if not torch.is_tensor(value) or tuple(value.shape) != spec.global_shape:
        got = list(value.shape) if torch.is_tensor(value) else type(value).__name__
        raise FxShardError(
            f"{what}: the state dict holds {got}, the parameter {spec.name} has shape {list(spec.global_shape)}; "
            "load a state dict (or checkpoint) saved from the same model"
        )


def _in_our_layout(value: DTensor, spec: ShardSpec) -> bool:
    """Whether ``value`` is split as this module splits ``spec``'s parameter: Shard(0) over the same ranks. The same
    answer on every rank, so every rank takes the same (collective or not) path."""
    tp = spec.tensor_parallel
    if tp is not None:
        return (tuple(value.placements) == tp.sharded_placements
                and value.device_mesh.mesh.tolist() == tp.sharded_mesh.mesh.tolist())
    if tuple(value.placements) != (Shard(0),) or value.device_mesh.ndim != 1:
        return False
    ours = mesh_of(spec, value.device_mesh.device_type)
    return value.device_mesh.mesh.tolist() == ours.mesh.tolist()


@torch.no_grad()
def shard_from_value(value, spec: ShardSpec, dtype: torch.dtype, what: str) -> torch.Tensor:
    """This rank's flat, zero-padded shard (a new tensor in ``dtype``) of a state-dict value of ``spec``'s
    parameter: a full-shape tensor, or a DTensor of any layout (one of another layout is gathered: a collective,
    every rank calls it). Anything else raises FxShardError."""
    _check_shape(value, spec, what)
    if isinstance(value, DTensor) and spec.full_shape and _in_our_layout(value, spec):
        local = value.to_local().reshape(-1)
        shard = torch.zeros(spec.chunk, dtype=dtype, device=local.device)
        shard[: local.numel()] = local
        return shard
    return shard_of(_full_of(value, spec).to(dtype), spec)


def full_from_value(value, spec: ShardSpec, what: str) -> torch.Tensor:
    """The full tensor (under tensor parallelism: this tp rank's piece) of a state-dict value for a parameter this
    rank holds in full (stages 0, 1): a DTensor of another layout is gathered (every rank calls it)."""
    _check_shape(value, spec, what)
    return _full_of(value, spec)


def _full_of(value: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """What fxshard's group shards of a value of the parameter's global shape: the whole value, or under tensor
    parallelism this tp rank's piece of it."""
    if spec.tensor_parallel is not None:
        return local_value(value, spec.tensor_parallel)
    return value.full_tensor() if isinstance(value, DTensor) else value
