"""prefetch: reorder a lowered graph so that communication runs while the previous unit computes.

``lower_collectives_pass`` leaves every collective where its parameters were first used: gather, wait and compute
in a row, so nothing overlaps. This pass moves nodes (it never adds, removes or changes one):

- the all-gather of the k-th gathered unit (with its copy-in: ``cat`` of shards, casts) is issued before the
  compute of unit k-1 (``prefetch=1``; unit k-d for ``prefetch=d``), in the order units are first used, which is
  "unit i+1 before unit i" in forward and "unit i-1 before unit i" in the backward graph;
- each wait and its copy-out (``split``, views to each parameter) sits right before the first node that uses it, and
  (forward and backward graphs) before the gathers issued there: the collective it waits for was issued earlier, and
  on one link (fxshard's one gloo worker thread, an NCCL stream) a gather issued before the wait would not start
  sooner, while gloo's staging copy of the gather in flight is freed before the next gather allocates its own;
- a reduce-scatter or all-reduce (with its copy-in) is issued as soon as its gradients exist, and its wait is
  delayed until its result is used, the next reduction is issued, or the next gather is issued (at most one
  reduction in flight: its full gradient buffer, and gloo's copy of it, stay alive until the wait). A gather that
  would be issued while a reduction is in flight goes after that reduction's wait, at the point that splits the
  compute between the reduction's issue and the gather's first use in proportion to their estimated times (one
  link runs them one after the other);
- at no point are more than ``max_inflight_gathers`` gathered buffers alive (issued and not yet past their last use
  by compute, views of the buffer included); a gather that would exceed that is issued after the compute that frees
  an earlier one, and never later than where the lowering put it. A buffer read again after the new gather's last
  reader (the root unit's, gathered for the embedding and read again by the LM head) is alive wherever the new
  gather goes and does not count: as FSDP2 keeps its root unsharded and prefetches the blocks beside it. Buffers
  kept for backward (``reshard_after_forward=False``) are the memory ledger's business, not this cap's;
- ``prefetch`` is the most units ahead a gather goes: the cost model (``cost_model.py`` on ``ctx.machine``, what
  the simulator predicts with) estimates each gather's time and the compute of the units in between, and the
  gather goes only as far ahead as it needs to be hidden (less memory).
  (Under ``memory_budget`` the backend tries less eager ``prefetch`` / ``max_inflight_gathers`` pairs too and keeps
  the fastest that fits: ``fxshard.simulate.autotune``; this pass schedules the pair it is given.)
- in forward and backward graphs, a gather goes ahead only where it keeps the graph's estimated peak where it is
  with that gather issued right before its first use: the pass estimates the bytes alive at each node from
  ``meta["val"]`` (a tensor from the node that makes it to its last reader, a graph input to its last reader as
  Inductor frees it; a gathered buffer to its last reader, and while the gather is in flight its input and a staging
  copy as large as the gathered buffer, as gloo makes), and issues each gather no earlier than the first point from
  which it raises no point of that estimate above the peak. (The example GPT's backward peaks in the LM head's
  backward, where the first gathers would otherwise be in flight.)

The compute nodes keep their order. The new order is a list schedule: each node gets a wanted position (a key)
from the rules above, and a topological sort that always takes the ready node with the smallest key produces the
order, so it is topologically valid by construction even where the keys disagree with the data dependencies.

Assumes: a ``forward``, ``backward`` or ``inference`` graph after ``lower_collectives_pass``; every collective
carries ``meta["fxshard"]`` with ``role`` (``all_gather``, ``reduce_scatter``, ``all_reduce``) and ``unit``; its
copy-in nodes are its ancestors with the same unit and a role, its wait and copy-out its descendants with the same
unit and a role. The exact node patterns do not matter (casts or other roles may appear).
Guarantees: the same nodes with the same arguments, in a topologically valid order, placeholders first and the
output last; each collective's ``meta["fxshard"]["schedule"]`` records ``issued_before`` (the compute node it is
issued in front of), ``lookahead`` (units ahead, gathers only), ``comm_s``, ``overlap_s`` and ``exposed_s``
(estimates); a gather's also ``held_back_for_peak`` (the memory rule issued it later) and, where it waited for a
reduction in flight, ``after_wait_of`` (that reduction's node). ``prefetch=0`` returns the graph unchanged. When
``ctx.schedule`` is set, that function runs instead, and its result must be a pure reorder too (else FxShardError).
The joint and optimizer graphs are unchanged.
"""

from __future__ import annotations

import dataclasses
import heapq

from torch import fx

from fxshard.errors import FxShardError
from fxshard.runtime.collectives import COLLECTIVE_ROLES
from fxshard.torch_compat import graph_root

from .context import PassContext
from .cost_model import Machine, compute_seconds, node_collective_seconds, tensor_bytes
from .fx_utils import is_view, position, storage_lifetimes

SCHEDULED_GRAPHS = ("forward", "backward", "inference")
# where waits go before the gathers of their node and the memory rule holds gathers back: the training step's
# graphs, whose peak these rules were measured on; an inference graph (a no_grad call, a compiled optimizer step
# publishing updated shards) keeps gathers before the waits of their node and its lookahead
TRAINING_GRAPHS = ("forward", "backward")
_PLACED = ("placeholder", "output")  # never moved: inputs stay first, the output last


@dataclasses.dataclass
class _Collective:
    node: fx.Node
    issue: list[fx.Node]  # the collective and its copy-in, in graph order
    completion: list[fx.Node]  # its wait and copy-out, in graph order
    first_use: int  # position of the first node outside the collective that reads its completion
    last_use: int  # position of the last such node, the output excepted
    nbytes: tuple[int, int] = (0, 0)  # gathers: (gathered buffer, what more is alive while it is in flight)


def _comm_side(node: fx.Node, unit: str) -> bool:
    meta = node.meta.get("fxshard", {})
    return node.op == "call_function" and meta.get("unit") == unit and meta.get("role") not in (None, "resident")


def _through_views(readers: list[fx.Node]) -> list[fx.Node]:
    """``readers`` and, transitively, the users of those that are views: a view (``t`` of a gathered weight) keeps
    the gathered buffer alive until its own last reader."""
    found, pending = list(readers), [r for r in readers if is_view(r)]
    while pending:
        for user in pending.pop().users:
            found.append(user)
            if is_view(user):
                pending.append(user)
    return found


def _collectives(graph: fx.Graph, order: dict[fx.Node, int]) -> list[_Collective]:
    found, claimed = [], set()
    for node in graph.nodes:
        meta = node.meta.get("fxshard", {})
        if meta.get("role") not in COLLECTIVE_ROLES:
            continue
        unit = meta["unit"]
        issue, pending = {node}, [node]
        while pending:  # copy-in: ancestors through nodes of the same unit
            for arg in pending.pop().all_input_nodes:
                if arg not in issue and arg not in claimed and _comm_side(arg, unit) \
                        and arg.meta["fxshard"]["role"] not in COLLECTIVE_ROLES:
                    issue.add(arg)
                    pending.append(arg)
        completion, pending = set(), [node]
        while pending:  # wait and copy-out: descendants through nodes of the same unit
            for user in pending.pop().users:
                if user not in completion and user not in claimed and _comm_side(user, unit) \
                        and user.meta["fxshard"]["role"] not in COLLECTIVE_ROLES:
                    completion.add(user)
                    pending.append(user)
        claimed |= issue | completion
        readers = [u for c in completion for u in c.users if u not in completion]
        uses = [order[u] for u in readers]
        compute_uses = [order[u] for u in _through_views(readers) if u.op != "output"]
        first_use = min(uses, default=order[node])
        found.append(_Collective(
            node, sorted(issue, key=order.__getitem__), sorted(completion, key=order.__getitem__),
            first_use, max(compute_uses, default=first_use),
        ))
    return found


def _live_bytes(graph: fx.Graph, skip: set[fx.Node]) -> list[int]:
    """Per position of the graph (in its order before this pass): the bytes of the tensors alive there
    (``storage_lifetimes``), of every node but ``skip`` (the gathers' nodes, counted apart). An estimate from
    ``meta["val"]``."""
    roots, lifetimes = storage_lifetimes(graph.nodes)
    delta = [0] * (len(roots) + 1)
    for root, (born, last) in lifetimes.items():
        if root not in skip and root.op != "output":
            nbytes = tensor_bytes(root.meta.get("val"))
            delta[born] += nbytes
            delta[last + 1] -= nbytes
    live, total = [], 0
    for step in delta[:-1]:
        total += step
        live.append(total)
    return live


def _footprint(curve: list[int], gather: _Collective, slot: int, sign: int = 1) -> None:
    """Add (``sign`` 1) or remove (-1) a gather issued before position ``slot`` to ``curve``: its gathered buffer
    until its last reader, and while it is in flight (to its wait) its input and, where the machine's backend gathers
    into a buffer of its own (``Machine.gathers_into_staging``), that copy."""
    gathered, in_flight = gather.nbytes
    for position in range(slot, gather.last_use + 1):
        curve[position] += sign * gathered
    for position in range(slot, gather.first_use + 1):
        curve[position] += sign * in_flight


def _without_raising_peak(curve: list[int], gather: _Collective, slot: int) -> int:
    """The earliest position from ``slot`` on where issuing ``gather`` keeps the graph's estimated peak (``curve``
    holds the other gathers) where it is with the gather issued right before its first use."""
    natural = gather.first_use
    _footprint(curve, gather, natural)
    peak = max(curve)
    _footprint(curve, gather, natural, -1)
    earliest = slot
    for position in range(slot, natural):
        if curve[position] + sum(gather.nbytes) > peak:
            earliest = position + 1
    return earliest


def _gather_slots(gathers: list[_Collective], ctx: PassContext, work_before: list[float],
                  comm_s: dict[fx.Node, float], in_flight: list[tuple[_Collective, int, int]], curve: list[int],
                  ) -> tuple[dict[fx.Node, tuple[int, int, dict]], dict[fx.Node, int]]:
    """Per gather (in order of first use): the position it is issued before, how many units ahead that is, and what
    else decided it (for its record); and per reduction whose wait must come before a gather's issue: that
    position.

    ``in_flight`` holds each reduction with the position of the compute node it is issued after and the position
    before which it is waited for at the latest; ``curve`` the estimated bytes alive per position without the
    gathers."""
    for gather in gathers:  # until it is placed, each gather counts where the lowering put it
        _footprint(curve, gather, gather.first_use)
    slots: dict[fx.Node, tuple[int, int, dict]] = {}
    waits_before: dict[fx.Node, int] = {}
    previous = 0
    for k, gather in enumerate(gathers):
        natural = gather.first_use
        lookahead = 0
        for lookahead in range(1, ctx.prefetch + 1):
            start = gathers[k - lookahead].first_use if k - lookahead >= 0 else 0
            if work_before[natural] - work_before[start] >= comm_s[gather.node]:
                break  # this much compute already hides it: going further ahead only costs memory
        slot = max(gathers[k - lookahead].first_use if k - lookahead >= 0 else 0, previous)
        while True:  # the in-flight cap: wait for the compute that frees the oldest live buffer
            # a buffer read again after this one is done with (the root's: embedding in, LM head out) is held
            # however early this gather goes: it does not count
            alive = sorted(g.last_use for g in gathers[:k] if slot <= g.last_use <= gather.last_use)
            if len(alive) < ctx.max_inflight_gathers:
                break
            slot = alive[len(alive) - ctx.max_inflight_gathers] + 1
        slot = min(slot, natural)
        _footprint(curve, gather, natural, -1)
        if ctx.graph in TRAINING_GRAPHS:
            wanted, slot = slot, _without_raising_peak(curve, gather, slot)
        else:
            wanted = slot
        notes = {"held_back_for_peak": slot > wanted}
        waited = []
        while True:  # (under hybrid sharding the reduce-scatter's all-reduce across the replicas follows it)
            flying = [(r, after) for r, after, before in in_flight
                      if after < slot < before and r.node not in waits_before]
            if not flying:
                break
            slot = _after_reduction(slot, natural, min(after for _, after in flying) + 1, work_before,
                                    sum(comm_s[r.node] for r, _ in flying), comm_s[gather.node])
            for reduction, _ in flying:
                waits_before[reduction.node] = slot
                waited.append(reduction.node.name)
        if waited:
            notes["after_wait_of"] = ", ".join(waited)
        _footprint(curve, gather, slot)
        previous = slot
        slots[gather.node] = (slot, lookahead, notes)
    return slots, waits_before


def _after_reduction(slot: int, natural: int, start: int, work_before: list[float], reduction_s: float,
                     gather_s: float) -> int:
    """Where a gather goes that would be issued at ``slot`` while a reduction issued before position ``start`` is in
    flight: the reduction is waited for there and the gather issued after it, so that the reduction's buffers (its
    full gradient input, and the staging copies a backend such as gloo keeps until the wait) are freed before the
    gather's are allocated. The compute from ``start`` to the gather's first use (``natural``) is split between the
    two in proportion to their estimated times: they run one after the other on one link (and on gloo, fxshard's
    one worker thread), so the gather cannot finish before the reduction anyway. Never earlier than ``slot``."""
    total = work_before[natural] - work_before[start]
    wanted = work_before[start] + total * reduction_s / max(reduction_s + gather_s, 1e-12)
    position = slot
    while position < natural and work_before[position] < wanted:
        position += 1
    return position


def _keys(gm: fx.GraphModule, ctx: PassContext, machine: Machine) -> tuple[dict, list[_Collective], dict]:
    """The wanted position of every movable node: (slot, phase, group, anchor, original position).

    slot: the position (in the original order) of the compute node this node should precede or follow;
    phase at a slot: 0 waits and copy-outs, 1 gathers issued (-1 in an inference graph), 2 the compute node itself,
    3 reductions issued. In forward and backward graphs waits come before the gathers of their slot: a collective
    waited for there was issued earlier, and on one link (one gloo worker thread, one NCCL stream) the new gather
    would not start before it finished anyway, while its buffers (gloo's staging copy of a gather in flight) are
    freed before the new gather's are allocated.
    """
    graph = gm.graph
    order = position(graph)
    collectives = _collectives(graph, order)
    comm_nodes = {n for c in collectives for n in (*c.issue, *c.completion)}
    work_before = [0.0]
    for node in graph.nodes:
        work_before.append(work_before[-1] + (0.0 if node in comm_nodes else compute_seconds(node, machine)))
    comm_s = {c.node: node_collective_seconds(c.node, ctx.world_size, machine) for c in collectives}
    gathers = sorted((c for c in collectives if c.node.meta["fxshard"]["role"] == "all_gather"),
                     key=lambda c: (c.first_use, order[c.node]))
    reductions = [c for c in collectives if c.node.meta["fxshard"]["role"] != "all_gather"]
    keys: dict[fx.Node, tuple] = {n: (order[n], 2, 0, order[n], order[n]) for n in graph.nodes}
    for reduction in reductions:  # as soon as the gradients exist (graph order: inputs are keyed first)
        for node in reduction.issue:
            ready = max((keys[a][0] for a in node.all_input_nodes if a.op != "placeholder"), default=0)
            keys[node] = (ready, 3, 0, 1, order[node])
    reductions.sort(key=lambda c: (keys[c.node], order[c.node]))
    limit = {r.node: keys[later.node][:3] + (0,) for r, later in zip(reductions, reductions[1:])}
    in_flight = [(r, keys[r.node][0], min(r.first_use, limit[r.node][0] + 1 if r.node in limit else r.first_use))
                 for r in reductions]
    for gather in gathers:
        gathered = tensor_bytes(gather.node.meta.get("val"))
        copied_in = sum(tensor_bytes(a.meta.get("val")) for a in gather.node.all_input_nodes if a in gather.issue)
        gather.nbytes = (gathered, copied_in + (gathered if machine.gathers_into_staging else 0))
    curve = _live_bytes(graph, {n for g in gathers for n in (*g.issue, *g.completion)})
    slots, waits_before = _gather_slots(gathers, ctx, work_before, comm_s, in_flight, curve)
    for reduction, slot in waits_before.items():
        limit[reduction] = min(limit.get(reduction, (slot, 0, 0, 0)), (slot, 0, 0, 0))

    for k, gather in enumerate(gathers):
        for node in gather.issue:
            keys[node] = (slots[gather.node][0], 1 if ctx.graph in TRAINING_GRAPHS else -1, k, 0, order[node])
    for collective in collectives:  # waits and copy-outs: right before their first reader, in reverse order
        for node in reversed(collective.completion):
            readers = [keys[u][:4] for u in node.users]
            wanted = min(readers, default=keys[node][:4])
            if wanted[1] == 2:  # before a compute node (or the output): with the waits of its slot
                wanted = (wanted[0], 0, 0, 0)
            wanted = min(wanted, limit.get(collective.node, wanted))
            keys[node] = (*wanted, order[node])
    return keys, collectives, {"slots": slots, "comm_s": comm_s, "gathers": gathers}


def _list_schedule(graph: fx.Graph, keys: dict[fx.Node, tuple]) -> list[fx.Node]:
    """A topological order that always takes the ready node with the smallest key."""
    nodes = [n for n in graph.nodes if n.op not in _PLACED]
    waiting = {n: sum(1 for a in n.all_input_nodes if a.op != "placeholder") for n in nodes}
    ready = [(keys[n], i, n) for i, n in enumerate(nodes) if waiting[n] == 0]
    heapq.heapify(ready)
    scheduled = []
    index = {n: i for i, n in enumerate(nodes)}
    while ready:
        _, _, node = heapq.heappop(ready)
        scheduled.append(node)
        for user in node.users:
            if user.op in _PLACED:
                continue
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, (keys[user], index[user], user))
    return scheduled


def reorder(gm: fx.GraphModule, new_order: list[fx.Node]) -> fx.GraphModule:
    """Put the graph's non-placeholder, non-output nodes in ``new_order`` (which must hold each exactly once)."""
    graph = gm.graph
    anchor = list(graph.find_nodes(op="placeholder"))
    cursor = anchor[-1] if anchor else None
    for node in new_order:
        if cursor is None:
            graph_root(graph).append(node)  # an empty graph without inputs: start at the root sentinel
        else:
            cursor.append(node)
        cursor = node
    graph.lint()
    gm.recompile()
    return gm


def check_pure_reorder(before: list[tuple[str, object, tuple]], gm: fx.GraphModule, who: str) -> None:
    """FxShardError unless ``gm`` holds exactly the nodes described by ``before`` (name, target, args), in a
    topologically valid order."""
    after = _signature(gm)
    if sorted(before, key=repr) != sorted(after, key=repr):
        gone = sorted({b[0] for b in before} - {a[0] for a in after})
        new = sorted({a[0] for a in after} - {b[0] for b in before})
        raise FxShardError(f"{who} must only reorder nodes, but changed the graph (removed {gone[:5]}, added "
                           f"{new[:5]}, or changed arguments); return the same nodes in a new order, or add the "
                           "function as a pass (passes=) if it is meant to rewrite the graph")
    try:
        gm.graph.lint()
    except Exception as error:
        raise FxShardError(f"{who} returned a graph whose order is not valid ({error}); every node must come after "
                           "the nodes it reads (fxshard.passes.prefetch.reorder does that check)") from error


def _signature(gm: fx.GraphModule) -> list[tuple]:
    def describe(arg):
        return fx.node.map_arg(arg, lambda n: f"%{n.name}")

    return [(n.name, str(n.target), repr(describe(n.args)), repr(describe(n.kwargs))) for n in gm.graph.nodes]


def make_prefetch_pass(machine: Machine | None = None):
    """A prefetch pass that places gathers by ``machine``'s figures instead of the backend's (``ctx.machine``); put it
    in place of ``prefetch_pass`` in ``passes=``."""

    def prefetch_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        if ctx.graph not in SCHEDULED_GRAPHS:
            return gm
        if ctx.schedule is not None:
            before = _signature(gm)
            result = ctx.schedule(gm, ctx)
            if not isinstance(result, fx.GraphModule):
                raise FxShardError(f"schedule must return the GraphModule it reordered, got {type(result).__name__}")
            check_pure_reorder(before, result, f"schedule={getattr(ctx.schedule, '__name__', ctx.schedule)!r}")
            result.recompile()
            return result
        return _schedule(gm, ctx, machine or ctx.machine)

    prefetch_pass.__doc__ = __doc__
    return prefetch_pass


def _schedule(gm: fx.GraphModule, ctx: PassContext, machine: Machine) -> fx.GraphModule:
    if ctx.prefetch == 0:
        return gm
    keys, collectives, facts = _keys(gm, ctx, machine)
    if not collectives:
        return gm
    reorder(gm, _list_schedule(gm.graph, keys))
    _record(gm, machine, collectives, facts)
    return gm


def _record(gm: fx.GraphModule, machine: Machine, collectives, facts) -> None:
    order = position(gm.graph)
    nodes = list(gm.graph.nodes)
    comm_nodes = {n for c in collectives for n in (*c.issue, *c.completion)}
    for collective in collectives:
        node = collective.node
        wait = next((n for n in collective.completion if n.meta["fxshard"]["role"] == "wait"), None)
        end = order[wait] if wait is not None else len(nodes) - 1
        between = nodes[order[node] + 1 : end]
        overlap = sum(compute_seconds(n, machine) for n in between if n not in comm_nodes)
        issued_before = next((n.name for n in nodes[order[node] + 1 :] if n not in comm_nodes), "output")
        record = {"issued_before": issued_before, "comm_s": facts["comm_s"][node], "overlap_s": overlap,
                  "exposed_s": max(0.0, facts["comm_s"][node] - overlap)}
        if node in facts["slots"]:
            _, record["lookahead"], notes = facts["slots"][node]
            record.update(notes)
        node.meta["fxshard"] = {**node.meta["fxshard"], "schedule": record}


prefetch_pass = make_prefetch_pass()

__all__ = ["check_pure_reorder", "make_prefetch_pass", "prefetch_pass", "reorder"]
