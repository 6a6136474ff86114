"""recompute_gathers: make stage 3 gather weights again in backward instead of keeping them from forward.

Assumes: the AOT joint graph (``ctx.graph == "joint"``), with ``fxshard.unshard`` markers whose inputs are shard
placeholders; backward nodes are those that depend on a ``tangents`` input (the partitioner's own rule).
Guarantees: with ``reshard_after_forward=True``, every ``unshard`` marker that gathers shards (stage 3), and every
view of its output, is tagged ``MUST_RECOMPUTE``, so the min-cut partitioner saves the (small) shard for backward and
re-runs the marker there, never the full weight. Untagged, the partitioner saves the full weight: ZeRO-3 silently
lost.

With ``reshard_after_forward=k`` (``ctx.secondary_group_name`` set), backward re-gathers from a secondary shard
instead: after each gathering marker, its flat output padded to the gather's length is cut into k equal pieces and
piece ``ctx.secondary_rank`` is kept (``clone``, tagged ``MUST_SAVE``, recorded ``role="secondary"``); a second
``unshard`` marker gathers the pieces over the k ranks of ``ctx.secondary_group_name`` (tagged ``MUST_RECOMPUTE``,
recorded ``regather=k``), and every backward use of the weight or of a view of it reads that marker (through copies
of the views, also ``MUST_RECOMPUTE``). Forward keeps its own gather; the values are the same bits.

A weight forward reads inside activation checkpointing is the exception: the partitioner recomputes that read in
backward from the weight itself, so it is tagged as under ``True`` (re-gathered from the primary shards).

Markers that read a full tensor (stages 0 and 2) and other graphs are left unchanged.
"""

from __future__ import annotations

import math

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from fxshard.runtime.ops import UNSHARD
from fxshard.runtime.sharding import MarkerLayout

from .context import PassContext
from .fx_utils import computed_value, fxshard_meta, is_view, marker_args, marker_layout

aten = torch.ops.aten


def _views_of(node: fx.Node) -> list[fx.Node]:
    """``node`` and every view of it, transitively, in graph order of discovery (inputs before users)."""
    found, pending = [], [node]
    while pending:
        view = pending.pop(0)
        found.append(view)
        pending.extend(user for user in view.users if is_view(user) and user not in found)
    return found


def _tag_recompute(node: fx.Node, why: str) -> None:
    node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    fxshard_meta(node)["recompute"] = why


def _backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The nodes that depend on an incoming gradient (a ``tangents`` placeholder): what runs in backward."""
    backward: set[fx.Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and "tangents" in node.target) or any(i in backward for i in node.all_input_nodes):
            backward.add(node)
    return backward


def _emit_after(graph: fx.Graph, anchor: fx.Node, target, *args, name: str | None = None) -> fx.Node:
    """``target(*args)`` inserted after ``anchor``, its ``meta["val"]`` computed from its inputs' fake values."""
    with graph.inserting_after(anchor):
        node = graph.create_node("call_function", target, args, name=name)
    node.meta["val"] = computed_value(target, args)
    return node


def _secondary_shard(graph: fx.Graph, marker: fx.Node, k: int, rank: int) -> fx.Node:
    """This rank's 1/k piece of the marker's gathered weight, flat and padded as the gather laid it out."""
    args = marker_args(marker)
    numel = math.prod(args["full_shape"])
    gathered = args["world_size"] * args["local"].meta["val"].numel()  # every rank's padded shard
    piece = gathered // k
    flat = _emit_after(graph, marker, aten.view.default, marker, [-1])
    padded = _emit_after(graph, flat, aten.constant_pad_nd.default, flat, [0, gathered - numel]) \
        if gathered != numel else flat
    sliced = _emit_after(graph, padded, aten.slice.Tensor, padded, 0, rank * piece, (rank + 1) * piece)
    secondary = _emit_after(graph, sliced, aten.clone.default, sliced,
                            name=f"{args['fqn']}_secondary".replace(".", "_"))
    secondary.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    fxshard_meta(secondary).update(role="secondary", params=[args["fqn"]], ranks=k)
    return secondary


def _checkpointed_use(views: list[fx.Node], backward: set[fx.Node]) -> bool:
    """Whether forward reads the weight inside activation checkpointing (``ac_graph_id``): the partitioner runs that
    read again in backward, from the weight itself."""
    return any(user.meta.get("ac_graph_id") is not None for view in views for user in view.users
               if user not in backward and user not in views)


def _regather_from_secondary(graph: fx.Graph, marker: fx.Node, backward: set[fx.Node], ctx: PassContext) -> bool:
    """Route every backward use of ``marker``'s weight (and its views) to a re-gather of a secondary shard over
    ``ctx.secondary_group_name``; False where backward reads none of it. A weight read under activation
    checkpointing is re-gathered from the primary shards instead (as ``reshard_after_forward=True``), recorded."""
    views = _views_of(marker)
    crossing = [(view, user) for view in views for user in list(view.users) if user in backward]
    if not crossing:
        return False
    if _checkpointed_use(views, backward):
        for node in views:
            _tag_recompute(node, "regather in backward (read under activation checkpointing: from the primary shards)")
        return False
    k = ctx.reshard_after_forward
    secondary = _secondary_shard(graph, marker, k, ctx.secondary_rank)
    args = marker_args(marker)
    regathered = _emit_after(graph, secondary, UNSHARD, secondary, None, list(args["full_shape"]), k,
                             ctx.secondary_group_name, args["fqn"], MarkerLayout.GATHER.value)
    _tag_recompute(regathered, f"regather in backward from secondary shards over {k} ranks")
    fxshard_meta(regathered)["regather"] = k
    copies = {marker: regathered}
    for view, user in crossing:
        chain = [view]
        while chain[-1] not in copies:
            chain.append(chain[-1].args[0])
        for original in reversed(chain[:-1]):  # copy the views between the weight and this use, outermost last
            copies[original] = _emit_after(graph, copies[original.args[0]], original.target,
                                           *fx.node.map_arg(original.args, lambda n: copies.get(n, n)))
            _tag_recompute(copies[original], "view of a weight re-gathered in backward")
        user.replace_input_with(view, copies[view])
    return True


def recompute_gathers_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.graph != "joint" or not ctx.reshard_after_forward:
        return gm
    markers = [m for m in gm.graph.find_nodes(op="call_function", target=UNSHARD) if marker_layout(m).gathers]
    if ctx.secondary_group_name:
        backward = _backward_nodes(gm.graph)
        if any([_regather_from_secondary(gm.graph, m, backward, ctx) for m in markers]):
            gm.graph.lint()
            gm.recompile()
        return gm
    for marker in markers:
        for node in _views_of(marker):
            _tag_recompute(node, "regather in backward")
    return gm
