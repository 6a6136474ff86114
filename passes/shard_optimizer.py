"""shard_optimizer: make a compiled ``optimizer.step`` publish what it updated, inside its own graph.

The optimizer ``prepare`` returns already updates only what this rank owns (flat shards; stage 0: full
parameters), so the update itself needs no rewrite. What stages 1 and 2 need after it is to refresh the full tensors
forward reads: stage 1's full parameters from the master shards, stage 2's resident copies from the shard leaves.
Eagerly, a post-step hook gathers them; in a compiled step this pass appends the gathers to the step's graph, so
they are scheduled, bucketed and lowered like every other collective.

Assumes: ``ctx.graph == "optimizer"``: the Dynamo graph of an ``optimizer.step`` (before AOT autograd, where the
in-place updates of the shards are still visible), whose nodes for updated shards (placeholders, or ``get_attr``
where Dynamo made the optimizer's parameters attributes of the graph) carry
``meta["fxshard"] = {"role": "updated_shard", "fqn", "full_shape", "world_size", "group_name"}`` and, where a full
copy must follow the update, ``"publish_into"``: the name of a buffer of ``gm`` holding that full tensor (the
backend annotates both; the pass reads nothing else).
Guarantees: after every node of the graph, for each shard with ``publish_into``: an ``fxshard.unshard`` marker
that gathers the updated shard, cast to the full tensor's dtype (the compute dtype under mixed precision), and an
in-place ``copy_`` into the buffer; both record ``meta["fxshard"]`` with ``role`` ``"publish"`` and the unit of the
parameter. The update is left as it is; other graphs are returned unchanged.
"""

from __future__ import annotations

import torch
from torch import fx

from fxshard.runtime.ops import UNSHARD
from fxshard.runtime.sharding import MarkerLayout, unit_of

from .context import PassContext
from .fx_utils import fxshard_meta


def _publishing_shards(graph: fx.Graph) -> list[fx.Node]:
    return sorted(
        (node for node in graph.nodes
         if node.meta.get("fxshard", {}).get("role") == "updated_shard" and "publish_into" in node.meta["fxshard"]),
        key=lambda node: node.meta["fxshard"]["fqn"],
    )


def shard_optimizer_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.graph != "optimizer":
        return gm
    graph = gm.graph
    output = next(iter(graph.find_nodes(op="output")))
    for shard in _publishing_shards(graph):
        layout = shard.meta["fxshard"]
        full_value = gm.get_buffer(layout["publish_into"])
        record = {"role": "publish", "unit": unit_of(layout["fqn"]), "params": [layout["fqn"]]}
        with graph.inserting_before(output):
            full = graph.get_attr(layout["publish_into"])
            gathered = graph.call_function(UNSHARD, (
                shard, None, list(layout["full_shape"]), layout["world_size"], layout["group_name"], layout["fqn"],
                MarkerLayout.GATHER.value, full_value.dtype, None,
            ))
            copied = graph.call_function(torch.ops.aten.copy_.default, (full, gathered))
        for node in (full, gathered, copied):
            fxshard_meta(node).update(record)
    graph.lint()
    gm.recompile()
    return gm
