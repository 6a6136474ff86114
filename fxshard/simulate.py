"""``fxshard.simulate``: an alpha-beta timeline of the scheduled graphs, to predict step time at any world size.

Two streams, as the rewritten graphs run them: a compute stream that runs every node in graph order, and a
communication stream that runs the collectives one after another. A collective is issued when the compute stream
reaches it (its input is ready then) and the communication stream is free; ``wait_tensor`` holds the compute stream
until its collective is done. So the order the scheduling passes chose (prefetch: gathers issued early, waits late)
decides how much communication hides behind compute.

Costs:
- compute node: ``flops / flops_per_s`` for ops torch's flop counter knows (matmuls, attention), else
  ``bytes written / memory_bandwidth``, plus ``op_overhead`` seconds per node (the eager interpreter's dispatch);
- ring collective on N ranks with a full buffer of B bytes: all-gather and reduce-scatter take
  ``(N-1)·latency + (N-1)/N·B/bandwidth``, all-reduce twice that;
- data parallelism with a fixed batch per rank (weak scaling): compute and the full buffers do not change with N,
  so one compiled graph predicts every N; padding is ignored.
The optimizer step's own collectives (stages 1, 2) run eagerly after backward and are added unhidden.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from .budget import N
from .errors import FxShardError
from .passes.cost_model import node_flops, tensor_bytes
from .passes.fx_utils import COLLECTIVE_ROLES


@dataclasses.dataclass(frozen=True)
class Machine:
    """What one rank and the network can do. Defaults are round numbers for a CPU host on a fast LAN."""

    flops_per_s: float = 5e10
    memory_bandwidth: float = 1e10  # bytes/s, for ops without a flop formula
    bandwidth: float = 1e10  # bytes/s per rank on the ring
    latency: float = 2e-5  # seconds per ring hop
    op_overhead: float = 0.0  # seconds per graph node


@dataclasses.dataclass
class Event:
    graph: str
    node: str
    stream: str  # "compute" or "comm"
    start: float
    end: float


@dataclasses.dataclass
class Timeline:
    """The predicted step: total time, time the compute stream spends computing, communication time, and the
    part of it the compute stream waited for (exposed)."""

    world: int
    step_time: float
    compute_time: float
    comm_time: float
    exposed_comm: float
    events: list[Event]

    @property
    def hidden_fraction(self) -> float:
        """Share of the communication that overlapped compute (1.0: all hidden)."""
        return 1.0 if self.comm_time == 0 else 1.0 - self.exposed_comm / self.comm_time


def compute_seconds(node: fx.Node, machine: Machine) -> float:
    flops = node_flops(node)
    work = flops / machine.flops_per_s if flops else tensor_bytes(node.meta.get("val")) / machine.memory_bandwidth
    return work + machine.op_overhead


def collective_seconds(kind: str, full_bytes: float, world: int, machine: Machine) -> float:
    """Ring alpha-beta time of one collective whose full (unsharded) buffer has ``full_bytes``."""
    if world <= 1:
        return 0.0
    one_pass = (world - 1) * machine.latency + (world - 1) / world * full_bytes / machine.bandwidth
    return 2 * one_pass if kind == "all_reduce" else one_pass


def _full_bytes(node: fx.Node, kind: str) -> float:
    if kind == "all_gather":
        return tensor_bytes(node.meta.get("val"))  # the gathered output
    return tensor_bytes(node.args[0].meta.get("val"))  # what is reduced


def simulate_graph(gm: fx.GraphModule, name: str, world: int, machine: Machine, start: float = 0.0):
    """Run one graph's nodes on the two streams; returns (end time, busy compute, busy comm, events)."""
    compute_at = comm_at = start
    busy_compute = busy_comm = 0.0
    done: dict[fx.Node, float] = {}
    events = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        role = node.meta.get("fxshard", {}).get("role")
        if role in COLLECTIVE_ROLES:
            begin = max(compute_at, comm_at)
            seconds = collective_seconds(role, _full_bytes(node, role), world, machine)
            comm_at = done[node] = begin + seconds
            busy_comm += seconds
            events.append(Event(name, node.name, "comm", begin, comm_at))
        elif node.target is torch.ops._c10d_functional.wait_tensor.default:
            issued = node.args[0]
            compute_at = max(compute_at, done.get(issued, compute_at))
        else:
            seconds = compute_seconds(node, machine)
            events.append(Event(name, node.name, "compute", compute_at, compute_at + seconds))
            compute_at += seconds
            busy_compute += seconds
    return max(compute_at, comm_at), busy_compute, busy_comm, events


def _graphs_of(source) -> tuple[list[tuple[str, fx.GraphModule]], list[tuple[str, float]]]:
    """(name, graph) pairs of one step in execution order, and the optimizer step's collectives (kind, bytes)."""
    from .budget import Ledger, ledger as ledger_of

    if isinstance(source, fx.GraphModule):
        return [("graph", source)], []
    if isinstance(source, (list, tuple)) and all(isinstance(g, fx.GraphModule) for g in source):
        return [(f"graph {i}", g) for i, g in enumerate(source)], []
    records = getattr(source, "graphs", None)
    if records is None:
        raise FxShardError("simulate takes a backend that ran a step, or rewritten GraphModule(s); got "
                           f"{type(source).__name__}")
    finals = {}
    for record in records:
        if record.final is not None and record.kind in ("forward", "backward"):
            finals[(record.graph_id, record.kind)] = record.final
    if not finals:
        raise FxShardError("the backend has compiled no forward/backward graph yet: run one step through "
                           "torch.compile(model, backend=backend) first")
    ids = sorted({i for i, _ in finals})
    order = [(f"graph {i} forward", finals[(i, "forward")]) for i in ids if (i, "forward") in finals]
    order += [(f"graph {i} backward", finals[(i, "backward")]) for i in reversed(ids) if (i, "backward") in finals]
    step = []
    if getattr(source, "optimizer", None) is not None and getattr(source, "model", None) is not None:
        ledger: Ledger = ledger_of(source)
        for term in ledger.select("comm"):
            if term.source.startswith("optimizer step"):
                full = ledger.at(term.bytes) * (ledger.at(N) if term.item == "all_gather" else 1)
                step.append((term.item, full))
    return order, step


def simulate(source, world: int, *, bandwidth: float | None = None, latency: float | None = None,
             flops: float | None = None, machine: Machine | None = None) -> Timeline:
    """Predict one training step on ``world`` ranks from the rewritten graphs of ``source`` (a backend that ran
    a step, or GraphModules): ``bandwidth`` bytes/s per rank, ``latency`` seconds per ring hop, ``flops`` FLOP/s
    per rank override ``machine``'s (see :class:`Machine`, :func:`calibrate`)."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise FxShardError(f"world must be a positive number of ranks, got {world!r}")
    machine = machine or Machine()
    overrides = {k: v for k, v in (("bandwidth", bandwidth), ("latency", latency), ("flops_per_s", flops))
                 if v is not None}
    for key, value in overrides.items():
        if value < 0 or (key != "latency" and value == 0):
            raise FxShardError(f"{key} must be positive, got {value!r}")
    machine = dataclasses.replace(machine, **overrides)
    graphs, step_collectives = _graphs_of(source)
    clock = compute = comm = 0.0
    events: list[Event] = []
    for name, gm in graphs:
        clock, busy_compute, busy_comm, graph_events = simulate_graph(gm, name, world, machine, clock)
        compute += busy_compute
        comm += busy_comm
        events += graph_events
    for kind, full_bytes in step_collectives:  # eager, one after another, nothing to hide behind
        seconds = collective_seconds(kind, full_bytes, world, machine)
        events.append(Event("optimizer step", kind, "comm", clock, clock + seconds))
        clock += seconds
        comm += seconds
    return Timeline(world, clock, compute, comm, max(0.0, clock - compute), events)


def calibrate(group=None, sizes=(1 << 12, 1 << 20), repeats: int = 5) -> Machine:
    """Measure this machine and process group: matmul FLOP/s, copy bandwidth, a per-op overhead, and the ring's
    latency and bandwidth from all-gathers of two sizes (a collective: every rank must call it)."""
    import torch.distributed as dist

    from .passes.cost_model import best_time

    def best(fn) -> float:
        return best_time(fn, repeats)

    a = torch.randn(256, 256)
    flops = 2 * 256**3 / best(lambda: a @ a)
    big = torch.randn(1 << 20)
    memory = big.numel() * 4 / best(lambda: big.clone())
    small = torch.randn(8)
    overhead = best(lambda: [small.add(1) for _ in range(100)]) / 100
    world = dist.get_world_size(group)
    times = []
    for numel in (s // 4 for s in sizes):
        shard = torch.randn(numel // world)
        out = torch.empty(numel // world * world)
        dist.barrier(group)
        times.append(best(lambda: dist.all_gather_into_tensor(out, shard, group=group)))
    (small_bytes, big_bytes), (t_small, t_big) = sizes, times
    factor = (world - 1) / world
    bandwidth = factor * (big_bytes - small_bytes) / max(t_big - t_small, 1e-9)
    latency = max(0.0, (t_small - factor * small_bytes / bandwidth) / max(world - 1, 1))
    stats = torch.tensor([flops, memory, overhead, bandwidth, latency], dtype=torch.float64)
    dist.all_reduce(stats, group=group)  # every rank predicts with the same machine
    stats /= world
    return Machine(*map(float, (stats[0], stats[1], stats[3], stats[4], stats[2])))
