"""bucket: decide which parameters share one collective (one flat buffer), before the markers are lowered.

``lower_collectives_pass`` turns the markers of one unit and dtype into one collective on one flat buffer, with the
copy-in (``cat`` of shards or padded gradients) and copy-out (``split`` and views back to each parameter) as graph
nodes. Its unit is ``meta["fxshard"]["bucket"]`` when set, else the layer (the module that uses the parameter). This
pass sets that key, so bucketing is a naming decision here and a rewrite there:

- ``bucket="layer"``: one collective per module that owns parameters (the layer's name);
- ``bucket="block"``: one per entry of ``blocks`` (module names: the backend resolves the classes a user names,
  ``fxshard.compiler.blocks.block_prefixes``), like FSDP2's per-block ``fully_shard``; a parameter under no block keeps its
  layer's unit, and a parameter under nested blocks belongs to the innermost one;
- ``bucket="auto"``: the same, over the blocks the backend found in the model (``fxshard.compiler.blocks.repeated_blocks``:
  its repeated blocks and the model itself; none found, ``blocks`` is empty and every parameter keeps its layer);
- ``bucket=<int>``: greedy in graph order over whole layers: consecutive layers share a bucket while its full
  buffer stays within the byte cap (a layer larger than the cap is a bucket of its own); buckets are named
  ``bucket0``, ``bucket1``... per graph and per collective kind (gathers and gradient reductions are numbered apart).

Mixed dtypes: the lowering splits a bucket by dtype (one collective per dtype in the bucket), so a bucket never
reinterprets bytes; the byte cap counts every dtype's bytes together.

Assumes: a ``forward``, ``backward`` or ``inference`` graph that still holds ``fxshard.unshard`` /
``fxshard.reduce_grad`` markers, each with ``meta["val"]``; placed right before ``lower_collectives_pass`` (after
``merge_tied_grads_pass``, whose new markers would not carry the key).
Guarantees: every marker that the lowering turns into a collective (a gathering ``unshard``; a ``reduce_grad`` that
all-reduces or reduce-scatters) gets ``meta["fxshard"]["bucket"]`` (and ``"bucket_policy"``); markers that read a
full tensor or keep a gradient local are left alone. No node is added, removed or moved; names are deterministic.
The joint and optimizer graphs are returned unchanged.

Why not ``torch._inductor.fx_passes.bucketing``: it merges already-lowered collectives (adjacent ones only, by a MB
cap) by tracing a merge function into the graph, so the nodes it creates lose ``meta["fxshard"]`` (unit, role,
parameters) that the prefetch pass, the report and the budget read; and it knows no layers or blocks. Its greedy
rule (fill a bucket in graph order until the cap, never bucket a collective that depends on the bucket) is the one
used here for ``bucket=<int>``, on layers instead of single collectives; ``tests/test_bucket.py`` pins what its
merge does to our metadata, so a torch release that keeps it is noticed.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import fx

from fxshard.errors import FxShardError
from fxshard.runtime.ops import REDUCE_GRAD, UNSHARD
from fxshard.runtime.sharding import ROOT_UNIT, pack_greedily, unit_of

from .context import PassContext
from .fx_utils import marker_args, marker_layout, position

def _lowered(marker: fx.Node) -> bool:
    """Whether lowering makes a collective of the marker: a gather, or a gradient that leaves this rank."""
    layout = marker_layout(marker)
    return layout.gathers if marker.target is UNSHARD else layout.gradient_collective is not None


def _block_of(fqn: str, prefixes: Sequence[str]) -> str:
    """The innermost block holding the parameter ``fqn``; the model itself (``""``, FSDP2's ``fully_shard(model)``)
    holds whatever no inner block does, as the unit ``root``; no block at all: the parameter's own layer."""
    inside = [p for p in prefixes if p == "" or fqn.startswith(p + ".")]
    if not inside:
        return unit_of(fqn)
    return max(inside, key=len) or ROOT_UNIT


def _buffer_bytes(marker: fx.Node, world_size: int) -> int:
    """Bytes of the full (padded) buffer this marker adds to its collective."""
    value = marker.args[0].meta["val"]  # the shard (gather) or the full gradient (reduction)
    return value.numel() * value.element_size() * (world_size if marker.target is UNSHARD else 1)


def _greedy_by_bytes(markers: list[fx.Node], cap: int, world_size: int) -> dict[fx.Node, str]:
    """Consecutive layers (in order of their first marker) share a bucket while its bytes stay within ``cap``."""
    layers: dict[str, list[fx.Node]] = {}
    for marker in markers:  # graph order
        layers.setdefault(unit_of(marker_args(marker)["fqn"]), []).append(marker)
    groups = list(layers.values())
    sizes = [sum(_buffer_bytes(m, world_size) for m in group) for group in groups]
    return {marker: f"bucket{index}" for index, members in enumerate(pack_greedily(sizes, cap))
            for member in members for marker in groups[member]}


def bucket_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.graph not in ("forward", "backward", "inference"):
        return gm
    if any(not isinstance(b, str) for b in ctx.blocks):
        raise FxShardError("bucket_pass got module classes in blocks; the backend resolves them with "
                           "fxshard.compiler.blocks.block_prefixes(model, blocks): call backend.prepare(model) first")
    order = position(gm.graph)
    markers = sorted(
        (m for target in (UNSHARD, REDUCE_GRAD) for m in gm.graph.find_nodes(op="call_function", target=target)
         if _lowered(m)),
        key=order.__getitem__,
    )
    if ctx.bucket == "layer":
        decided = {m: unit_of(marker_args(m)["fqn"]) for m in markers}
    elif ctx.bucket in ("block", "auto"):
        decided = {m: _block_of(marker_args(m)["fqn"], ctx.blocks) for m in markers}
    else:
        decided = {}
        # gathers and each kind of reduction form their own sequences: one bucket never mixes collective kinds
        kinds: dict[tuple, list[fx.Node]] = {}
        for marker in markers:
            kinds.setdefault((marker.target, marker_layout(marker).gradient_collective), []).append(marker)
        for kind_markers in kinds.values():
            decided.update(_greedy_by_bytes(kind_markers, ctx.bucket, ctx.world_size))
    policy = ctx.bucket if isinstance(ctx.bucket, str) else f"<= {ctx.bucket} bytes"
    for marker, bucket in decided.items():
        marker.meta["fxshard"] = {**marker.meta.get("fxshard", {}), "bucket": bucket, "bucket_policy": policy}
    return gm
