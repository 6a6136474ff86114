"""What every pass is told about the graph it rewrites, and every knob a user can set on the backend."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Literal

import torch

from fxshard.runtime.groups import COLLECTIVE_TIMEOUT_S

from .cost_model import GLOO_ON_CPU, Machine
from .quantize import DEFAULT_QUANTIZE_BLOCK

GraphKind = Literal["joint", "forward", "backward", "inference", "optimizer"]


DDP_BUCKET_BYTES = 25 << 20  # DistributedDataParallel's default bucket_cap_mb


def default_bucket(stage: int) -> str | int:
    """The backend's ``bucket`` when none is given: stage 0 all-reduces whole buckets as DDP does (nothing to
    gather per layer, and on every backend each collective has a fixed latency); stages 1-3 group by the model's
    repeated blocks as FSDP2 users wrap them (``"auto"``: faster than per-layer collectives at stage 3 for a little
    more peak memory, docs/scheduling.md)."""
    return DDP_BUCKET_BYTES if stage == 0 else "auto"


@dataclasses.dataclass(frozen=True)
class PassContext:
    """The knobs and facts a pass may read; passes never read global state.

    Facts about the graph (set by the backend):
    stage: ZeRO stage 0..3.
    graph: which graph is being rewritten: the AOT ``joint`` graph (before partitioning), the partitioned
        ``forward`` / ``backward`` graphs, an ``inference`` graph (a call under ``torch.no_grad``), or an
        ``optimizer`` graph (``opt.step`` compiled with the backend).
    world_size, group_name: the process group the markers name (one group per backend).
    optimizer_bytes: bytes per rank the prepared optimizer keeps outside every graph (state, stage-1 masters).
    reduce_scatter_by_all_to_all: lower a reduce-scatter to an all-to-all and a local sum (the group is gloo's,
        whose own reduce-scatter all-reduces the whole buffer: ``fxshard.runtime.groups.scatters_by_all_to_all``).
    group_twins: (group, twin) pairs: collectives the graph holds over ``group`` that are not fxshard's (DTensor's,
        under tensor parallelism) run on ``twin`` instead, fxshard's one-worker gloo twin of the same ranks.
    secondary_group_name, secondary_rank: with ``reshard_after_forward=k`` (1 < k < world_size), the group of the k
        consecutive ranks of the shard group this rank re-gathers from in backward, and this rank's place in it.
    machine: what the ranks and their links can do (``cost_model.Machine``): the one estimator of time the prefetch
        pass places gathers by and autotune and the simulator predict with (the backend's ``machine=``, else its
        device's default; the same on every rank).

    Knobs (``fxshard.backend(stage, **knobs)``; every field below is one):
    reshard_after_forward: stage 3 only: free gathered weights after forward and gather again in backward (True,
        ZeRO-3) or keep them from forward to backward (False: 2Ψ instead of 3Ψ per step, more memory), or an int k
        dividing the shard group (FSDP2's meaning, ZeRO++'s hpZ): keep a secondary shard (1/k of each weight) over
        the group of k consecutive ranks from forward to backward, and re-gather from it inside that group (one
        node's ranks), so backward's gathers never cross nodes. k = world size is True, k = 1 is False.
    bucket: how collectives are grouped: ``"layer"`` (one per module that owns parameters), ``"block"`` (one per
        entry of ``blocks``), ``"auto"`` (one per repeated block the backend finds in the model, and one for the
        rest: ``fxshard.compiler.blocks``; the backend compiles per layer instead where the simulator predicts it faster, or
        where only that fits ``memory_budget``: ``fxshard.simulate.autotune``), or an int byte cap (greedy, in graph order).
        The backend's default depends on the stage: stage 0 packs its all-reduces into ``DDP_BUCKET_BYTES`` (DDP's
        25 MiB ``bucket_cap_mb``), the sharded stages communicate per block (``"auto"``; per layer in a model
        without repeated blocks).
    blocks: for ``bucket="block"``: module names (``"blocks.0"``) or module classes whose parameters share one
        collective, like FSDP2's per-block ``fully_shard``; the model itself (its class, or ``""``) takes what no
        inner block holds. With ``bucket="auto"`` the backend sets it (passes always see module names).
    prefetch: how many units ahead an all-gather is issued (0: each gather right before its unit's compute).
    max_inflight_gathers: the most gathered buffers alive at once under prefetch.
    schedule: a researcher's ordering function ``schedule(gm, ctx) -> gm`` run in place of the prefetch pass.
    memory_budget: bytes per rank the rewritten graphs may need: the backend keeps the fastest predicted schedule
        (up to ``prefetch`` and ``max_inflight_gathers``; per block or per layer under ``bucket="auto"``) that fits
        (``fxshard.simulate.autotune``); where none does, ``budget_pass`` fails compilation with the ledger.
    param_dtype: mixed precision: the dtype forward and backward compute in (parameters are cast from the fp32
        master before they are gathered); None computes in the parameters' own dtype.
    reduce_dtype: mixed precision: the dtype gradients are reduced in; None reduces in ``param_dtype``.
    quantize_weights: stage 3: the shards travel to the all-gather packed as ``"bf16"``, ``"int8"`` or ``"fp8"``
        (float8_e4m3fn; both blockwise, an fp32 scale per ``quantize_block`` elements) and are unpacked into the
        compute dtype after it (ZeRO++'s qwZ): 1/4 of fp32's bytes plus the scales. Lossy: forward and backward
        compute with the unpacked weights; the fp32 masters, gradients and optimizer state stay exact. None (the
        default): the shards travel as they are (in ``param_dtype`` under mixed precision).
    quantize_grads: stages 2 and 3: gradients are averaged by an all-to-all of ``"bf16"`` or blockwise ``"int8"``
        packed rows and a sum here in fp32 (ZeRO++'s qgZ, in one hop): lossy, the error of each rank's part is at
        most half a step of its block's grid. None (the default): exact, in ``reduce_dtype``.
        ``"auto"`` on either: the backend chooses per graph between None and ``"int8"`` by the simulator's
        predicted time (``fxshard.simulate.autotune``; the weights once per step, by the forward graph, so forward
        and backward compute with the same weights); the passes see the choice, never ``"auto"``.
    quantize_block: elements per scale of the blockwise schemes (``passes.quantize.DEFAULT_QUANTIZE_BLOCK``).
    step_bucket_bytes: the eager ``optimizer.step()``'s collectives (stage 1's reduce-scatter of the gradients,
        stages 1 and 2's all-gathers that publish the updated shards, stage 0's all-reduce of gradients ``no_sync``
        kept local) are packed in parameter order into buckets of up to this many bytes of full buffer (DDP's
        25 MiB by default); a compiled step follows ``bucket``. Nothing overlaps them, so fewer and larger is
        faster, at a transient cost of one bucket.
    collective_timeout_s: seconds a rank waits in one of fxshard's collectives for its peers before it fails with
        FxShardError (a peer died, raised, or stopped calling the model). On gloo it is the timeout of the group
        fxshard communicates on; raise it if ranks do long work of their own between steps (evaluation on rank 0,
        a slow save). Compilation is not counted: ranks compile the same graphs at the same time.
    """

    stage: int
    graph: GraphKind
    world_size: int
    group_name: str
    optimizer_bytes: int = 0
    reduce_scatter_by_all_to_all: bool = False
    group_twins: tuple[tuple[str, str], ...] = ()
    secondary_group_name: str = ""
    secondary_rank: int = 0
    machine: Machine = GLOO_ON_CPU
    reshard_after_forward: bool | int = True
    bucket: str | int = "layer"
    blocks: Sequence[str | type] = ()
    prefetch: int = 1
    max_inflight_gathers: int = 2
    schedule: Callable | None = None
    memory_budget: int | None = None
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    quantize_weights: str | None = None
    quantize_grads: str | None = None
    quantize_block: int = DEFAULT_QUANTIZE_BLOCK
    step_bucket_bytes: int = DDP_BUCKET_BYTES
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S


FACTS = ("stage", "graph", "world_size", "group_name", "optimizer_bytes", "reduce_scatter_by_all_to_all",
         "group_twins", "secondary_group_name", "secondary_rank", "machine")
KNOBS = tuple(f.name for f in dataclasses.fields(PassContext) if f.name not in FACTS)
