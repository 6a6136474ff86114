"""How one parameter is split over the ranks of a process group.

fxshard shards every parameter FLAT and ROW-ALIGNED: the parameter is flattened and zero-padded at the end to
``world_size * chunk`` elements, where ``chunk`` is ``ceil(rows / world_size)`` whole rows (dim 0; a 0-d parameter
is one row of one element), and rank r keeps elements ``[r * chunk, (r + 1) * chunk)``. So:

- every parameter of a unit concatenates into one flat buffer with no per-shape bookkeeping, so a unit's (or a
  bucket's) all-gather and reduce-scatter are a single collective on a contiguous buffer;
- the elements a rank holds before its padding are exactly its rows under FSDP2's ``Shard(0)`` (``torch.chunk``'s
  split): a state dict's DTensor is a view of the shard, built without communication
  (``fxshard/runtime/layout.py``);
- padding is whole rows at the end, at most ``world_size - 1`` of them (a ``(3, 5)`` weight on 2 ranks pads one row
  of 5), as FSDP2 pads.

The cost: a flat shard's update runs on elements, not on a matrix, so optimizers that look at a parameter's shape
(Adafactor's factored moments, Muon's orthogonalisation) cannot run on it; ``prepare`` refuses them.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import torch

from fxshard.errors import FxShardError

from .tensor_parallel import TensorParallel

ROOT_UNIT = "root"  # the unit of a parameter the model itself owns


class MarkerLayout(str, enum.Enum):
    """How a marker (``fxshard.unshard`` / ``fxshard.reduce_grad``) finds a parameter's full value and returns its
    gradient: the one value the marker ops, the passes and the ledger read, through the properties below. A marker
    carries it as its ``layout`` argument, as the plain string (``.value``)."""

    GATHER = "gather"  # ``local`` is this rank's flat shard; each use all-gathers it (stage 3)
    RESIDENT = "resident"  # a full copy kept between steps is read (stage 2); ``local`` is the flat shard
    REPLICATED = "replicated"  # ``local`` is the full parameter; its gradient is all-reduced (stage 0)
    KEPT_LOCAL = "kept_local"  # ``local`` is the full parameter; its gradient stays on this rank (``no_sync``)

    @property
    def gathers(self) -> bool:
        """Whether the full value is all-gathered from the shards where it is used."""
        return self is MarkerLayout.GATHER

    @property
    def reads_resident(self) -> bool:
        return self is MarkerLayout.RESIDENT

    @property
    def gradient_collective(self) -> str | None:
        """The collective that averages the gradient: ``"reduce_scatter"`` into the shard, ``"all_reduce"`` of all
        of it, or None (it stays local)."""
        return {MarkerLayout.GATHER: "reduce_scatter", MarkerLayout.RESIDENT: "reduce_scatter",
                MarkerLayout.REPLICATED: "all_reduce"}.get(self)


def layout_stage(model_stage: int, shape) -> int:
    """The stage a parameter of ``shape`` is laid out at in a model prepared at ``model_stage``: the model's, except
    that a 0-d parameter in a stage-2/3 model is laid out as at stage 0 (every rank holds it whole and all-reduces its
    gradient). It has no rows to split: as a shard it would be one element on the first rank and padding on the
    rest, so neither its leaf (a DTensor of shape ``()`` cannot be ``Shard(0)``) nor its state dict value could be
    local. FSDP2 refuses such parameters; they are common (CLIP's ``logit_scale``), and one element all-reduced costs
    what a gather of it would."""
    return 0 if model_stage >= 2 and not len(shape) else model_stage


def unit_of(fqn: str) -> str:
    """The module that uses a parameter: ``"blocks.0.attn.qkv.weight"`` -> ``"blocks.0.attn.qkv"``; a parameter of
    the model itself (``"scale"``) belongs to the unit ``"root"``."""
    return fqn.rpartition(".")[0] or ROOT_UNIT


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """How one parameter is laid out on this rank: everything the marker ops and the optimizer need, all static."""

    name: str  # fully qualified name of the parameter (first owner, for tied parameters)
    full_shape: tuple[int, ...]
    world_size: int
    rank: int
    group_name: str
    stage: int
    param_dtype: torch.dtype | None = None  # mixed precision: the dtype forward and backward compute in
    reduce_dtype: torch.dtype | None = None  # mixed precision: the dtype gradients are averaged in
    # hybrid sharding (a 2-D mesh): the group of the ranks that hold this same shard, one per shard group, over
    # which the shard's gradient is averaged after the reduce-scatter; "" and 1 on a flat group
    replicate_group_name: str = ""
    replicate_size: int = 1
    mesh_group_name: str = ""  # hybrid sharding: a group of every rank of the mesh (checkpoints are written over it)
    # tensor parallelism: the parameter is a DTensor over a tp mesh dimension, and full_shape is its LOCAL tensor's
    # shape, the tensor fxshard shards and gathers (fxshard/runtime/tensor_parallel.py)
    tensor_parallel: TensorParallel | None = None

    @property
    def global_shape(self) -> tuple[int, ...]:
        """The parameter's shape as the model declares it (and state dicts hold it): under tensor parallelism its
        DTensor's shape, else ``full_shape``."""
        return self.full_shape if self.tensor_parallel is None else tuple(self.tensor_parallel.shape)

    @property
    def all_ranks_group_name(self) -> str:
        """The group of every rank that holds a piece of the parameter: the mesh's on a hybrid mesh, else the shard
        group."""
        return self.mesh_group_name or self.group_name

    @property
    def trains_shard(self) -> bool:
        """Stages 2 and 3 train this rank's shard; stages 0 and 1 train the full parameter."""
        return self.stage >= 2

    @property
    def leaf_shape(self) -> tuple[int, ...]:
        """The shape the trainable leaf the model holds reports: at stages 2 and 3 the parameter's own (a DTensor of
        this rank's rows, ``fxshard/runtime/layout.py``), else the full parameter's (under tensor parallelism, at
        stages 0 and 1, its local piece's)."""
        return self.global_shape if self.trains_shard else self.full_shape

    def marker_arguments(self, fqn: str, layout: MarkerLayout | None = None) -> tuple:
        """The ``fxshard.unshard`` arguments after its tensors, for a use of the parameter at ``fqn`` (``layout``:
        the spec's own unless given)."""
        return (list(self.full_shape), self.world_size, self.group_name, fqn, (layout or self.marker_layout).value,
                self.param_dtype, self.reduce_dtype, self.replicate_size, self.replicate_group_name)

    @property
    def marker_layout(self) -> MarkerLayout:
        """The layout its markers carry: gathered per use (stage 3), resident (stage 2), the full parameter with
        its gradient all-reduced (stages 0, 1; stage 1 reads its parameters without markers)."""
        return {3: MarkerLayout.GATHER, 2: MarkerLayout.RESIDENT}.get(self.stage, MarkerLayout.REPLICATED)

    @property
    def numel(self) -> int:
        return math.prod(self.full_shape)

    @property
    def chunk(self) -> int:
        return chunk_size(self.full_shape, self.world_size)

    @property
    def padding(self) -> int:
        return self.chunk * self.world_size - self.numel

    @property
    def rows(self) -> tuple[int, int]:
        """The dim-0 rows ``[start, stop)`` of the full parameter this rank holds (``torch.chunk``'s split)."""
        rows = self.full_shape[0] if self.full_shape else 1
        per_rank = -(-rows // self.world_size)
        return min(self.rank * per_rank, rows), min((self.rank + 1) * per_rank, rows)


def row_size(shape) -> int:
    """Elements of one dim-0 row of a tensor of ``shape`` (a 0-d tensor: one row of one element)."""
    return math.prod(shape[1:])


def chunk_size(shape, world_size: int) -> int:
    """Elements each rank keeps of a parameter of ``shape``: ``ceil(rows / world_size)`` whole rows (the last ranks
    hold the padding)."""
    rows = shape[0] if len(shape) else 1
    return -(-rows // world_size) * row_size(shape)


def shard_of(full: torch.Tensor, spec: ShardSpec, out: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's flat, padded shard of ``full`` (a new tensor, or written into ``out``; ``full`` is not kept
    alive)."""
    if tuple(full.shape) != spec.full_shape:
        raise FxShardError(
            f"{spec.name}: expected a tensor of shape {list(spec.full_shape)}, got {list(full.shape)}; "
            "load a state dict saved from the same model"
        )
    flat = full.detach().reshape(-1)
    start = spec.rank * spec.chunk
    shard = flat.new_zeros(spec.chunk) if out is None else out
    mine = flat[start : min(start + spec.chunk, spec.numel)]
    shard[: mine.numel()] = mine
    shard[mine.numel() :] = 0
    return shard


def unpad(gathered: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """The full-shape parameter from the concatenation of all ranks' shards."""
    return gathered[: spec.numel].view(spec.full_shape)


def pack_greedily(sizes: list[int], cap: int, kinds: list | None = None) -> list[list[int]]:
    """Indices of ``sizes`` in consecutive buckets: a bucket takes the next item while its total stays within
    ``cap`` and (with ``kinds``) the item is of the bucket's kind; an item larger than ``cap`` is a bucket alone."""
    buckets: list[list[int]] = []
    filled = 0
    for index, size in enumerate(sizes):
        same_kind = kinds is None or (buckets and kinds[buckets[-1][0]] == kinds[index])
        if not buckets or filled + size > cap or not same_kind:
            buckets.append([])
            filled = 0
        buckets[-1].append(index)
        filled += size
    return buckets
