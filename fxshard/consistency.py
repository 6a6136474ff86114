"""The compile-time check that every rank compiled the same collective schedule.

Ranks that compile different graphs (a forward that branches on the rank, a model attribute or an input shape that
differs between ranks) issue different collectives: on gloo a rank then dies in ``std::terminate`` ("Received data
size doesn't match expected size") when a peer's message is larger than its buffer, both ranks wait forever when
the counts differ, and where two mismatched collectives happen to move the same number of bytes each rank silently
receives the other's unrelated tensor. Neither DDP nor FSDP2 compares anything at compile time.

So at each compile of a graph that runs (forward, backward, inference), the backend calls ``check_same_schedule``:

1. ``collective_schedule(gm)``, a pure function of the lowered graph, lists its collectives in graph order: kind,
   unit, the parameters it carries, dtype, element count, process group;
2. every rank contributes a fixed-size record (a marker, the graph's kind, the schedule's length, a 64-bit hash of
   the schedule) to one all-gather of ``4 * world_size`` int64s;
3. only where the records differ do the ranks exchange their whole schedules (``all_gather_object``), and every rank
   raises ``FxShardError`` naming the first position at which they differ and what each rank has there.

The Dynamo-level graph of a compiled ``optimizer.step`` is not checked itself: its collectives are lowered into the
inference graph AOT autograd makes of it, and that graph is checked.

Which group the check runs on: a gloo group of its own over the ranks of the group the graph's collectives name
(``check_group``, made by every rank in ``backend.prepare``). The ranks matter: they are exactly the peers whose
graphs must agree. The communicator must not be the graphs' own, because of the one case the check cannot cover:
a compile that happens on one rank only (a Dynamo guard that fails on that rank alone, e.g. its batch has a new
shape while its peers' does not). That rank enters the check while its peers run their compiled graphs. On the
graphs' group the check's small all-gather would be matched with a peer's first all-gather or reduce-scatter: gloo
aborts the rank whose buffer is the smaller one, or, at equal byte counts, hands each rank the other's data. On a
group of its own nothing is matched wrongly: the peers' graph collectives wait for the compiling rank, which waits
in the check: after the backend's ``collective_timeout_s`` every rank fails with an FxShardError, the peers with
fxshard's error about a peer that stopped running the same step, the compiling rank with one saying its peers did
not compile this graph (at once if a failed peer's process exits first: its connection closes). The check waits
for its peers as long as any of fxshard's collectives does (``collective_timeout_s``): ranks that compile the same
graph reach it within that time, and where one compiles much longer (Inductor on a cold cache beside a warm one)
the timeout is the knob to raise, as it would be for the graph's first collective without the check. A gloo group
works whatever backend the graphs use (NCCL too): the records are small CPU tensors.

Nothing is checked where there is nothing to compare: a world of one rank, and the single-process ``fake`` group of
``fxshard.testing.fake_process_group`` (its collectives return garbage).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib

import torch
import torch.distributed as dist
from torch import fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .errors import FxShardError
from .passes.fx_utils import COLLECTIVE_ROLES, marker_args, replica_ranks

# A record that does not start with this did not come from check_same_schedule ("fxshard" in ASCII).
RECORD_MARKER = int.from_bytes(b"fxshard", "big")
GRAPH_KINDS = ("forward", "backward", "inference")

# the graphs' group name -> (that group, the gloo group the check runs on); a group of the same name made after a
# destroy_process_group is another group, and gets its own
_CHECK_GROUPS: dict[str, tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


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
    if node.op != "call_function":
        return False
    if node.meta.get("fxshard", {}).get("role") in COLLECTIVE_ROLES:
        return True
    target = node.target  # a collective the user's own code put in the graph must match across ranks too
    return (isinstance(target, torch._ops.OpOverload) and target.namespace == "_c10d_functional"
            and target._opname != "wait_tensor")


def _group_of(node: fx.Node, meta: dict) -> str:
    """fxshard's collectives by the mesh dimension they run over ("shard": the group parameters are sharded over,
    a flat group too; "replicate"): the groups of one dimension have other names on other ranks of a hybrid mesh.
    Any other collective by its group's name."""
    if meta.get("role") in COLLECTIVE_ROLES:
        return "shard" if replica_ranks(node) is None else "replicate"
    return str(marker_args(node).get("group_name", ""))


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
            kind=meta.get("role") or node.target._opname,
            unit=meta.get("unit", "-"),
            params=tuple(meta.get("params", ())),
            dtype=str(buffer.dtype).removeprefix("torch.") if isinstance(buffer, torch.Tensor) else "?",
            numel=shown,
            group_name=_group_of(node, meta),
        ))
    return schedule


def schedule_hash(kind: str, schedule: list[ScheduledCollective]) -> int:
    """A signed 64-bit hash of a graph's kind and collective schedule, equal on every rank for equal schedules
    (``hash()`` of a str is salted per process, so it is not used)."""
    text = repr((kind, [dataclasses.astuple(entry) for entry in schedule]))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big", signed=True)


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
    return "their schedules are equal but their records differed (a record was corrupted on the way)"


def _needs_check(group: dist.ProcessGroup) -> bool:
    return dist.get_world_size(group) > 1 and dist.get_backend(group) != "fake"


def prepare_check_group(group_name: str, timeout_s: float) -> None:
    """Make the gloo group the check runs on for graphs whose collectives name ``group_name``, waiting ``timeout_s``
    for peers: every rank of that group must call this at the same point (``backend.prepare`` does). Nothing for one
    rank or the fake group."""
    if not group_name or _check_group_of(group_name) is not None:
        return
    group = dist.distributed_c10d._resolve_process_group(group_name)
    if not _needs_check(group):
        return
    _CHECK_GROUPS[group_name] = (group, dist.new_group(
        ranks=dist.get_process_group_ranks(group), backend="gloo",
        timeout=datetime.timedelta(seconds=timeout_s), use_local_synchronization=True,
    ))


def _check_group_of(group_name: str) -> dist.ProcessGroup | None:
    source, check_group = _CHECK_GROUPS.get(group_name, (None, None))
    if check_group is None or not dist.is_initialized():
        return None
    try:
        current = dist.distributed_c10d._resolve_process_group(group_name)
    except (RuntimeError, ValueError):  # destroyed since
        return None
    return check_group if current is source else None


def _records(check_group: dist.ProcessGroup, record: list[int]) -> list[list[int]]:
    with unset_fake_temporarily():  # the compilers may run inside AOT autograd's fake mode: this must be real
        mine = torch.tensor(record, dtype=torch.int64)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(check_group))]
        dist.all_gather(gathered, mine, group=check_group)
    return [t.tolist() for t in gathered]


def check_same_schedule(gm: fx.GraphModule, kind: str, graph_id: int, group_name: str) -> None:
    """Raise FxShardError on every rank unless every rank of the group compiled a ``kind`` graph with this collective
    schedule. A collective on the check's own group; does nothing where ``prepare_check_group`` made none."""
    check_group = _check_group_of(group_name)
    if check_group is None or kind not in GRAPH_KINDS:
        return
    schedule = collective_schedule(gm)
    rank, ranks = dist.get_rank(), dist.get_process_group_ranks(check_group)
    record = [RECORD_MARKER, GRAPH_KINDS.index(kind), len(schedule), schedule_hash(kind, schedule)]
    try:
        records = _records(check_group, record)
    except RuntimeError as error:
        raise FxShardError(
            f"rank {rank} compiled its {kind} graph {graph_id} and waited for the other ranks to compare collective "
            f"schedules, but they did not take part ({str(error).strip().splitlines()[0]}). A peer failed (look for "
            "its own error), or it did not compile this graph: a compile on one rank only comes from a Dynamo guard "
            "that fails on that rank alone (an input shape, a Python value or a model attribute that differs "
            "between ranks): give every rank the same shapes and code path. A rank waits collective_timeout_s for "
            "its peers (a backend option: raise it if one rank compiles much longer than the others)"
        ) from error
    strangers = [r for r, other in zip(ranks, records) if other[0] != RECORD_MARKER]
    if strangers:  # the group is fxshard's alone, so this is not expected: say so rather than compare garbage
        raise FxShardError(f"rank {rank}: ranks {strangers} sent something else than a schedule record in "
                           f"fxshard's consistency check of its {kind} graph {graph_id}; do not use fxshard's "
                           "groups for collectives of your own")
    if all(other == record for other in records):
        return
    shared: list = [None] * len(records)
    try:
        with unset_fake_temporarily():
            dist.all_gather_object(shared, (kind, schedule), group=check_group)
    except RuntimeError as error:
        raise FxShardError(
            f"rank {rank}: the ranks compiled different collective schedules for their {kind} graph {graph_id} "
            f"(their records differ), and a peer did not take part in exchanging the schedules to name the "
            f"difference ({str(error).strip().splitlines()[0]}); look for the peer's own error. Every rank must "
            "compile the same graph: no control flow on the rank, the same model attributes and input shapes"
        ) from error
    kinds = [k for k, _ in shared]
    schedules = [s for _, s in shared]
    raise FxShardError(
        f"rank {rank}: the ranks compiled different collective schedules for their {kind} graph {graph_id}; run as "
        f"they are, they would deadlock or silently exchange the wrong tensors. {first_difference(kinds, schedules, ranks)}. "
        "Every rank must compile the same graph: no control flow on the rank (if dist.get_rank() == ...), the same "
        "model attributes and parameters used on every rank, and the same input shapes (or shapes that vary the "
        "same way on every rank)"
    )


__all__ = ["ScheduledCollective", "check_same_schedule", "collective_schedule",
           "first_difference", "prepare_check_group", "schedule_hash"]
