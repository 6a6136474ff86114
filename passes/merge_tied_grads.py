"""merge_tied_grads: reduce a parameter read at several use sites once, not once per use site.

A tied parameter (an embedding shared with the LM head) has one ``unshard`` marker per use site, so autograd
produces one ``reduce_grad`` per site and adds their results. Reduction is linear, so

    add(reduce_grad(a), reduce_grad(b))  ==  reduce_grad(add(a, b))

and the right-hand side needs one collective instead of two, and sums the local gradients first, in the order a
single process (and stage 1, which reduces ``.grad`` once) would: it is what makes every stage agree bit for bit.

Assumes: a ``backward`` graph with ``fxshard.reduce_grad`` markers, each node carrying ``meta["val"]``.
Guarantees: every ``add`` of two markers with the same group and reduction, each used only by that add, becomes one
marker on the sum of their inputs, placed at the add and named after the later site (where the reduction now
happens); ``meta["fxshard"]["merged"]`` lists the use sites. Chains of adds (three or more sites) merge fully.
Other graphs are returned unchanged.
"""

from __future__ import annotations

import torch
from torch import fx

from fxshard.runtime.ops import REDUCE_GRAD

from .context import PassContext
from .fx_utils import fxshard_meta, marker_args, position

aten = torch.ops.aten


def _mergeable(a, b) -> bool:
    if not all(isinstance(n, fx.Node) and n.target is REDUCE_GRAD and len(n.users) == 1 for n in (a, b)):
        return False
    args_a, args_b = marker_args(a), marker_args(b)
    same = ("world_size", "group_name", "layout")
    return all(args_a[k] == args_b[k] for k in same) and a.args[0].meta["val"].shape == b.args[0].meta["val"].shape


def merge_tied_grads_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.graph != "backward":
        return gm
    graph = gm.graph
    for add in list(graph.find_nodes(op="call_function", target=aten.add.Tensor)):
        a, b = add.args[:2]
        if len(add.args) != 2 or add.kwargs or not _mergeable(a, b):
            continue
        order = position(graph)
        first, later = sorted((a, b), key=order.__getitem__)
        sites = fxshard_meta(first).get("merged", [marker_args(first)["fqn"]]) + fxshard_meta(later).get(
            "merged", [marker_args(later)["fqn"]])
        with graph.inserting_before(add):
            summed = graph.call_function(aten.add.Tensor, (first.args[0], later.args[0]))
            summed.meta["val"] = first.args[0].meta["val"]
            merged = graph.call_function(REDUCE_GRAD, (summed, *later.args[1:]))
            merged.meta["val"] = later.meta["val"]
        fxshard_meta(merged)["merged"] = sites
        add.replace_all_uses_with(merged)
        for node in (add, first, later):
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm
