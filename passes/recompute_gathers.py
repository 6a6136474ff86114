"""recompute_gathers: make stage 3 gather weights again in backward instead of keeping them from forward.

Assumes: the AOT joint graph (``ctx.graph == "joint"``), with ``fxshard.unshard`` markers whose inputs are shard
placeholders.
Guarantees: with ``reshard_after_forward``, every ``unshard`` marker that gathers shards (stage 3), and every
view of its output, is tagged ``MUST_RECOMPUTE``, so the min-cut partitioner saves the (small) shard for backward and
re-runs the marker there, never the full weight. Untagged, the partitioner saves the full weight: ZeRO-3 silently
lost. Markers that read a full tensor (stages 0 and 2) and other graphs are left unchanged.
"""

from __future__ import annotations

from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from fxshard.runtime.ops import UNSHARD

from .context import PassContext
from .fx_utils import is_view
from .lower_collectives import gathers_shards


def recompute_gathers_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.graph != "joint" or not ctx.reshard_after_forward:
        return gm
    for node in gm.graph.find_nodes(op="call_function", target=UNSHARD):
        if not gathers_shards(node):
            continue
        pending = [node]
        while pending:
            tagged = pending.pop()
            tagged.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            tagged.meta.setdefault("fxshard", {})["recompute"] = "regather in backward"
            pending.extend(user for user in tagged.users if is_view(user))
    return gm
