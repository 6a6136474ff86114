"""``twin_groups_pass``: collectives that are not fxshard's run on fxshard's one-worker twin of their group.

Under tensor parallelism the graph holds DTensor's collectives (a Rowwise layer's output all-reduce, sequence
parallelism's all-gathers and reduce-scatters) over the tp dimension's process group. On gloo that group has two
worker threads, and torch 2.13's gloo frees a buffer twice when two collectives of one group finish together
(docs/known-issues.md): fxshard's own collectives run on a one-worker twin of their group for that reason, and this
pass sends DTensor's to the twin of theirs, which ``prepare`` made (``ctx.group_twins``).

Assumes: functional collectives (``fxshard.runtime.collectives``) name their group by their last argument.
Guarantees: every collective over a group of ``ctx.group_twins`` names its twin instead (the same ranks, in the
same order, so the consistency check and the data are unchanged); ``meta["fxshard"]["twin_of"]`` records the group
it named before. Other nodes are untouched; without ``ctx.group_twins`` the graph is returned as it is.
"""

from __future__ import annotations

from torch import fx

from fxshard.runtime.collectives import collective_of, group_name_of

from .context import PassContext


def twin_groups_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    twins = dict(ctx.group_twins)
    if not twins:
        return gm
    for node in gm.graph.nodes:
        if node.op == "call_function" and collective_of(node.target) and group_name_of(node) in twins:
            group = group_name_of(node)
            node.update_arg(len(node.args) - 1, twins[group])
            node.meta.setdefault("fxshard", {})["twin_of"] = group
    gm.recompile()
    return gm
