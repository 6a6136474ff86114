"""budget_pass: the memory ledger of one lowered graph, recorded on it, and the ``memory_budget`` knob enforced.

The one pass that lives with the ledger rather than in ``fxshard.passes``: it reads the ledger, and the ledger reads
what the passes leave on a graph.

Assumes: a lowered ``forward`` / ``backward`` / ``inference`` graph whose nodes carry ``meta["val"]`` (collectives
and their buffers carry ``meta["fxshard"]`` roles, as ``lower_collectives_pass`` leaves them). Run it last: it
measures the schedule the passes before it chose.
Guarantees: the graph is unchanged. ``gm.meta["fxshard_ledger"]`` gets ``{"inputs": bytes of the parameter and
batch tensors the graph takes, "peak": bytes the graph holds at its worst node (saved activations, gathered and
reduce buffers, gradients, intermediates), "peak_at": that node's name, "total": their sum, "terms": [(item, node,
bytes)]}``, and each node held at the peak gets ``meta["fxshard"]["ledger_bytes"]``. With ``ctx.memory_budget``
set, a graph whose total exceeds it fails compilation with FxShardError listing those terms.

The optimizer is not part of the model's graphs: what it keeps (state, stage-1 master shards) comes in as
``ctx.optimizer_bytes`` and is added to the total. What one graph still cannot see: in backward, resident
parameters it does not read. So this check is a lower bound that fails early, at compile time;
``fxshard.budget.ledger(backend)`` / ``backend.report()`` evaluate the whole step.
"""

from __future__ import annotations

from tabulate import tabulate
from torch import fx

from fxshard.errors import FxShardError
from fxshard.passes import PassContext

from .step_ledger import graph_ledger


def budget_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.graph not in ("forward", "backward", "inference"):
        return gm
    ledger = graph_ledger(gm, ctx.graph, ctx.world_size, ctx.optimizer_bytes)
    gm.meta["fxshard_ledger"] = ledger
    by_name = {node.name: node for node in gm.graph.nodes}
    for item, name, nbytes in ledger["terms"]:
        if name in by_name and item not in ("input", "optimizer"):
            by_name[name].meta.setdefault("fxshard", {})["ledger_bytes"] = nbytes
    if ctx.memory_budget is not None and ledger["total"] > ctx.memory_budget:
        table = tabulate(sorted(ledger["terms"], key=lambda t: -t[2])[:20], headers=["what", "node", "bytes"])
        raise FxShardError(
            f"the {ctx.graph} graph needs {ledger['total']:,} bytes per rank (inputs {ledger['inputs']:,} + "
            f"{ledger['peak']:,} held at {ledger['peak_at']} + the optimizer's {ledger['optimizer']:,}), over "
            f"memory_budget={ctx.memory_budget:,}. Raise the budget, use a higher stage (3 shards the parameters), a "
            "smaller batch, or fewer gathers in flight (prefetch=0, max_inflight_gathers=1, a smaller bucket).\n"
            + table
        )
    return gm
