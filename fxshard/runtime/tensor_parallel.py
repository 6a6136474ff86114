"""Tensor parallelism beside fxshard: parameters that are DTensors over a tensor-parallel mesh dimension.

torch's ``parallelize_module`` leaves each parameter a DTensor over the "tp" dimension of a DeviceMesh: a Colwise
weight ``Shard(0)``, a Rowwise weight ``Shard(1)``, biases and norms ``Replicate()``. fxshard lays out each one's
LOCAL tensor (this tp rank's piece) as it lays out any parameter: ``prepare`` replaces the DTensor by a plain
Parameter of its local tensor and shards that over fxshard's data-parallel group, and the module's accessor returns
``DTensor.from_local(<the local tensor, gathered>, tp mesh, placement)``. The marker ops, the passes and the
optimizer see plain tensors only; DTensor's own ops, with their tp collectives, trace into the same graph. FSDP2
does the same (``_init_sharding_spec_tp`` shards ``param._local_tensor``).

A state dict describes each shard on both dimensions, as FSDP2's does: a DTensor of the global shape over fxshard's
shard dimension and the tp dimension (``concatenate_meshes``), placements ``(Shard(0), tp placement)``, or
``(_StridedShard(0, T), Shard(0))`` where tp splits dim 0 too (data parallelism then splits each tp rank's rows).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from fxshard.errors import FxShardError
from fxshard.torch_compat import concatenate_meshes, own_parameters, strided_shard

from .groups import collective_group

SUPPORTED = ("one tensor-parallel mesh dimension, placement Shard(dim) or Replicate() (parallelize_module's "
             "Colwise, Rowwise and SequenceParallel layouts)")


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """How one parameter is split over the tensor-parallel mesh dimension, and the mesh its shards are described on."""

    mesh: DeviceMesh  # 1-D: the tensor-parallel dimension
    placement: Placement  # Shard(dim) or Replicate() over it
    shape: torch.Size  # the parameter's global shape
    stride: tuple[int, ...]
    sharded_mesh: DeviceMesh  # fxshard's shard dimension, then the tensor-parallel one
    # DTensor's collectives over ``mesh`` name ``dtensor_group_name``; in fxshard's graphs they run on
    # ``group_name``, its one-worker twin on gloo (fxshard/runtime/groups.py), itself on other backends
    dtensor_group_name: str
    group_name: str

    @property
    def degree(self) -> int:
        return self.mesh.size()

    @property
    def splits(self) -> bool:
        """Whether each tp rank holds a different piece (Shard), not the whole parameter (Replicate)."""
        return isinstance(self.placement, Shard)

    @property
    def sharded_placements(self) -> tuple[Placement, Placement]:
        """A flat shard's rows on ``sharded_mesh``: dp splits each tp rank's local tensor by rows."""
        if isinstance(self.placement, Shard) and self.placement.dim == 0:
            return strided_shard(0, self.degree), self.placement
        return Shard(0), self.placement


def as_tensor_parallel(local: torch.Tensor, tp: TensorParallel) -> DTensor:
    """The DTensor the model computes with, from this tp rank's local tensor (differentiable; no communication)."""
    return DTensor.from_local(local, tp.mesh, (tp.placement,), run_check=False, shape=tp.shape, stride=tp.stride)


def global_value(local: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The whole parameter from every tp rank's local tensor (a collective over the tp dimension)."""
    return as_tensor_parallel(local, tp).full_tensor()


def local_value(value: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This tp rank's local tensor of ``value``: a DTensor laid out as ``tp`` (no copy), or of any other layout
    (gathered: every rank calls it), or the whole parameter (sliced here)."""
    if isinstance(value, DTensor):
        if tuple(value.placements) == (tp.placement,) and value.device_mesh.mesh.tolist() == tp.mesh.mesh.tolist():
            return value.to_local()
        value = value.full_tensor()
    return distribute_tensor(value, tp.mesh, (tp.placement,), src_data_rank=None).to_local()


def _tensor_parallel_of(name: str, param: DTensor, shard_mesh: DeviceMesh | None, timeout_s: float) -> TensorParallel:
    """The layout of DTensor parameter ``name``, or FxShardError saying why fxshard cannot compose with it."""
    mesh, placements = param.device_mesh, tuple(param.placements)
    described = (f"parameter {name!r} is a DTensor with placements {placements} over mesh dimensions "
                 f"{mesh.mesh_dim_names or tuple(range(mesh.ndim))}")
    if mesh.ndim != 1 or not (type(placements[0]) is Shard or isinstance(placements[0], Replicate)):
        raise FxShardError(f"{described}; fxshard composes with {SUPPORTED}, and does the data-parallel sharding "
                           "itself (no fully_shard before prepare)")
    if shard_mesh is None:
        raise FxShardError(f"{described}; give the backend the mesh dimension(s) to shard over, slices of that same "
                           'mesh: fxshard.backend(stage=3, mesh=mesh["dp"])')
    try:
        sharded_mesh = concatenate_meshes([shard_mesh, mesh])
    except RuntimeError as error:
        raise FxShardError(
            f"{described}, which is not a dimension of the mesh fxshard shards over beside its own "
            f"({shard_mesh.mesh_dim_names}): {error}. Slice both from one mesh, e.g. mesh = init_device_mesh(device, "
            '(dp, tp), mesh_dim_names=("dp", "tp")), parallelize_module(model, mesh["tp"], plan), '
            'fxshard.backend(stage=3, mesh=mesh["dp"])'
        ) from None
    group = mesh.get_group()
    return TensorParallel(mesh, placements[0], param.shape, param.stride(), sharded_mesh, group.group_name,
                          collective_group(group, timeout_s).group_name)


def tensor_parallel_layouts(model: nn.Module, mesh: DeviceMesh | None,
                            timeout_s: float) -> dict[int, TensorParallel]:
    """{id(parameter): its layout} for each DTensor parameter of ``model`` (a tied one once); FxShardError for a
    layout fxshard cannot compose with, or a DTensor buffer. ``mesh``: the backend's (None: it was given none);
    ``timeout_s``: of the twin group DTensor's collectives run on in fxshard's graphs."""
    # a hybrid mesh's shards are described on its "shard" dimension: its replicas hold the same rows
    shard_mesh = None if mesh is None else mesh if mesh.ndim == 1 else mesh["shard"]
    for name, buffer in model.named_buffers():
        if isinstance(buffer, DTensor):
            raise FxShardError(f"buffer {name!r} is a DTensor ({tuple(buffer.placements)}); fxshard composes with "
                               "tensor-parallel parameters, and keeps buffers as plain tensors: make it a plain one")
    layouts: dict[int, TensorParallel] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for name, param in own_parameters(module).items():
            if isinstance(param, DTensor) and id(param) not in layouts:
                layouts[id(param)] = _tensor_parallel_of(f"{path}.{name}" if path else name, param, shard_mesh,
                                                         timeout_s)
    tp_ranks = {tuple(tp.mesh.mesh.tolist()) for tp in layouts.values()}
    if len(tp_ranks) > 1:
        raise FxShardError(f"the model's DTensor parameters lie on {len(tp_ranks)} different tensor-parallel "
                           f"groups of ranks {sorted(tp_ranks)}; fxshard composes with one tensor-parallel dimension")
    return layouts


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """What fxshard lays out of ``tensor``: a DTensor's local tensor (this tp rank's piece), else ``tensor``."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_parameter(param: nn.Parameter) -> nn.Parameter:
    """What fxshard lays out of ``param``: itself, or of a DTensor parameter a Parameter of this tp rank's local
    tensor (sharing its storage)."""
    if not isinstance(param, DTensor):
        return param
    with torch.no_grad():
        return nn.Parameter(param.to_local(), requires_grad=param.requires_grad)


def every_rank(mesh: DeviceMesh, tp: TensorParallel) -> list[int]:
    """The ranks of ``mesh`` (the backend's) and the tensor-parallel dimension together: every rank that holds a
    piece of the model, which one checkpoint is written by."""
    return sorted(concatenate_meshes([mesh, tp.mesh]).mesh.flatten().tolist())
