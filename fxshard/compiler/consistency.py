"""The compile-time check that every rank compiled the same collective schedule.

Ranks that compile different graphs (a forward that branches on the rank, a model attribute or an input shape that
differs between ranks) issue different collectives: on gloo a rank then dies in ``std::terminate`` ("Received data
size doesn't match expected size") when a peer's message is larger than its buffer, both ranks wait forever when
the counts differ, and where two mismatched collectives happen to move the same number of bytes each rank silently
receives the other's unrelated tensor. Neither DDP nor FSDP2 compares anything at compile time.

So at each compile of a graph that runs (forward, backward, inference), the backend calls ``check_same_schedule``:

1. ``collective_schedule(gm)``, a pure function of the lowered graph, lists its collectives in graph order: kind,
   unit, the parameters it carries, dtype, element count, process group;
2. every rank writes its graph's kind and schedule under a key of its own in the process group's store (the
   TCPStore every rank already talks to), waits for its peers' keys and reads them;
3. where they differ, every rank raises ``FxShardError`` naming the first position at which they differ and what
   each rank has there.

The Dynamo-level graph of a compiled ``optimizer.step`` is not checked itself: its collectives are lowered into the
inference graph AOT autograd makes of it, and that graph is checked.

Why the store and not a collective: the check runs inside compilation, where torch's Python dispatcher holds the
GIL across a c10d call. torch 2.13's ``ProcessGroupGloo`` destroys a finished work (and the tensors it holds) in its
worker thread while holding the group's work mutex, and releasing a tensor that Python knows takes the GIL: a
second collective issued from here then waits for that mutex with the GIL held, and the process hangs for good
(no timeout fires; seen with the two all-gathers of ``all_gather_object``, gdb: the worker in
``~AsyncAllgatherWork`` -> ``decref_pyobject`` -> ``take_gil``, the main thread in ``ProcessGroupGloo::enqueue``).
A store is also no communicator of the graphs: a compile that happens on one rank only (a Dynamo guard that fails
on that rank alone, e.g. its batch has a new shape while its peers' does not) cannot match the check's exchange
with a peer's graph collective. That rank waits for keys its peers never write, while the peers' graph
collectives wait for it: after the backend's ``collective_timeout_s`` every rank fails with an FxShardError, the
peers with fxshard's error about a peer that stopped running the same step, the compiling rank with one saying
its peers did not compile this graph. The check waits for its peers as long as any of fxshard's collectives does
(``collective_timeout_s``): ranks that compile the same graph reach it within that time, and where one compiles
much longer (Inductor on a cold cache beside a warm one) the timeout is the knob to raise, as it would be for the
graph's first collective without the check. The keys name the group, the rank and the how-manieth check of the
group this is on that rank (``_CheckedGroup.checks``): ranks that compiled different numbers of graphs wait for
keys that never come, and fail the same way.

Nothing is checked where there is nothing to compare: a world of one rank, and the single-process ``fake`` group of
``fxshard.testing.fake_process_group`` (its collectives return garbage).
"""

from __future__ import annotations

import dataclasses
import datetime
import pickle

import torch
import torch.distributed as dist
from torch import fx

from fxshard.errors import FxShardError
from fxshard.passes.fx_utils import replica_ranks
from fxshard.runtime.collectives import COLLECTIVE_ROLES, group_name_of, is_any_collective, kind_of
from fxshard.runtime.groups import compares_peers
from fxshard.torch_compat import default_store, resolve_group

GRAPH_KINDS = ("forward", "backward", "inference")
KEY_PREFIX = "fxshard/schedule"  # keys in the process group's store: <prefix>/<group>/<check index>/<rank>


@dataclasses.dataclass
class _CheckedGroup:
    """A group whose graphs are checked: the group itself (a group of the same name made after a
    destroy_process_group is another one), how long a rank waits for its peers, and how many checks ran."""

    group: dist.ProcessGroup
    timeout_s: float
    checks: int = 0


_CHECKED: dict[str, _CheckedGroup] = {}  # the graphs' group name -> its record


@dataclasses.dataclass(frozen=True)
class ScheduledCollective:
    """One collective of a graph, as the consistency check compares it."""

    kind: str  # "all_gather", "reduce_scatter", "all_reduce", or the op's name for a collective fxshard did not make
    unit: str
    params: tuple[str, ...]
    dtype: str
    numel: str  # the input buffer's element count; for a symbolic size, its expression
    group_name: str

    def describe(self, with_group: bool = False) -> str:
        carried = f" ({', '.join(self.params)})" if self.params else ""
        group = f" on group {self.group_name!r}" if with_group else ""
        return f"{self.kind} of unit {self.unit!r}{carried}, {self.numel} {self.dtype} elements{group}"


def _is_collective(node: fx.Node) -> bool:
    # a collective the user's own code put in the graph must match across ranks too
    return node.op == "call_function" and (node.meta.get("fxshard", {}).get("role") in COLLECTIVE_ROLES
                                           or is_any_collective(node.target))


def _group_of(node: fx.Node, meta: dict) -> str:
    """fxshard's collectives by the mesh dimension they run over ("shard": the group parameters are sharded over,
    a flat group too; "replicate"): the groups of one dimension have other names on other ranks of a hybrid mesh.
    Any other collective (the user's, DTensor's) by the shape of its group, for the same reason: the groups of one
    mesh dimension, e.g. ranks (0, 1) and (2, 3), are each "ranks (0, 1) + offset"."""
    if meta.get("role") in COLLECTIVE_ROLES:
        return "shard" if replica_ranks(node) is None else "replicate"
    name = str(group_name_of(node))
    try:
        ranks = dist.get_process_group_ranks(resolve_group(name))
    except (RuntimeError, ValueError):  # not a live group: compare the names
        return name
    return f"ranks {tuple(r - ranks[0] for r in ranks)} + offset"


def collective_schedule(gm: fx.GraphModule) -> list[ScheduledCollective]:
    """The collectives of a lowered graph, in the order the graph issues them (pure: reads the graph only)."""
    schedule = []
    for node in gm.graph.nodes:
        if not _is_collective(node):
            continue
        meta = node.meta.get("fxshard", {})
        buffer = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        numel = buffer.numel() if isinstance(buffer, torch.Tensor) else None
        # Read a symbolic size through its expression: int() would add a guard (and a recompile per size).
        shown = str(numel.node.expr) if isinstance(numel, torch.SymInt) else str(numel)
        schedule.append(ScheduledCollective(
            kind=meta.get("role") or kind_of(node.target),
            unit=meta.get("unit", "-"),
            params=tuple(meta.get("params", ())),
            dtype=str(buffer.dtype).removeprefix("torch.") if isinstance(buffer, torch.Tensor) else "?",
            numel=shown,
            group_name=_group_of(node, meta),
        ))
    return schedule


def first_difference(kinds: list[str], schedules: list[list[ScheduledCollective]], ranks: list[int]) -> str:
    """Where the schedules of ``ranks`` (in that order) first differ, and what each rank has there (pure)."""
    if len(set(kinds)) > 1:
        return "they compiled different graphs at the same time: " + ", ".join(
            f"rank {rank} a {kind} graph" for rank, kind in zip(ranks, kinds))
    for position in range(max(len(s) for s in schedules)):
        entries = [s[position] if position < len(s) else None for s in schedules]
        if len(set(entries)) > 1:
            groups_differ = len({e.group_name for e in entries if e is not None}) > 1
            what = "; ".join(
                f"rank {rank}: {'nothing (its schedule ends)' if entry is None else entry.describe(groups_differ)}"
                for rank, entry in zip(ranks, entries))
            lengths = ", ".join(f"rank {rank}: {len(s)}" for rank, s in zip(ranks, schedules))
            return f"collective #{position} differs ({what}); collectives per rank: {lengths}"
    return "their schedules are equal"


def prepare_check_group(group_name: str, timeout_s: float) -> None:
    """Check the graphs whose collectives name ``group_name`` from now on, waiting ``timeout_s`` for peers in each
    check. Nothing for one rank or the fake group. Local: no communication."""
    if not group_name or _checked(group_name) is not None:
        return
    group = resolve_group(group_name)
    if compares_peers(group):
        _CHECKED[group_name] = _CheckedGroup(group, timeout_s)


def _checked(group_name: str) -> _CheckedGroup | None:
    checked = _CHECKED.get(group_name)
    if checked is None or not dist.is_initialized():
        return None
    try:
        current = resolve_group(group_name)
    except (RuntimeError, ValueError):  # destroyed since
        return None
    return checked if current is checked.group else None


def _exchange(checked: _CheckedGroup, ranks: list[int], mine: tuple) -> list[tuple]:
    """Every rank's ``(kind, schedule)`` of this check, in the order of ``ranks``, through the default store."""
    store = default_store()
    prefix = f"{KEY_PREFIX}/{checked.group.group_name}/{checked.checks}"
    checked.checks += 1
    store.set(f"{prefix}/{dist.get_rank()}", pickle.dumps(mine))
    keys = [f"{prefix}/{rank}" for rank in ranks]
    store.wait(keys, datetime.timedelta(seconds=checked.timeout_s))
    return [pickle.loads(store.get(key)) for key in keys]


def check_same_schedule(gm: fx.GraphModule, kind: str, graph_id: int, group_name: str) -> None:
    """Raise FxShardError on every rank unless every rank of the group compiled a ``kind`` graph with this collective
    schedule. Waits for the group's ranks (through the store); does nothing for a group ``prepare_check_group`` did
    not register."""
    checked = _checked(group_name)
    if checked is None or kind not in GRAPH_KINDS:
        return
    schedule = collective_schedule(gm)
    rank, ranks = dist.get_rank(), dist.get_process_group_ranks(checked.group)
    try:
        shared = _exchange(checked, ranks, (kind, schedule))
    except (RuntimeError, dist.DistError) as error:
        raise FxShardError(
            f"rank {rank} compiled its {kind} graph {graph_id} and waited for the other ranks to compare collective "
            f"schedules, but they did not take part ({str(error).strip().splitlines()[0]}). A peer failed (look for "
            "its own error), or it did not compile this graph: a compile on one rank only comes from a Dynamo guard "
            "that fails on that rank alone (an input shape, a Python value or a model attribute that differs "
            "between ranks): give every rank the same shapes and code path. A rank waits collective_timeout_s for "
            "its peers (a backend option: raise it if one rank compiles much longer than the others)"
        ) from error
    if all(other == (kind, schedule) for other in shared):
        return
    kinds = [k for k, _ in shared]
    schedules = [s for _, s in shared]
    raise FxShardError(
        f"rank {rank}: the ranks compiled different collective schedules for their {kind} graph {graph_id}; run as "
        f"they are, they would deadlock or silently exchange the wrong tensors. {first_difference(kinds, schedules, ranks)}. "
        "Every rank must compile the same graph: no control flow on the rank (if dist.get_rank() == ...), the same "
        "model attributes and parameters used on every rank, and the same input shapes (or shapes that vary the "
        "same way on every rank)"
    )


__all__ = ["ScheduledCollective", "check_same_schedule", "collective_schedule", "first_difference",
           "prepare_check_group"]
