"""``fxshard.simulate``: an alpha-beta timeline of the scheduled graphs, to predict step time at any world size.

Two streams, as the rewritten graphs run them: a compute stream that runs every node in graph order, and a
communication stream that runs the collectives one after another. A collective is issued when the compute stream
reaches it (its input is ready then) and the communication stream is free; ``wait_tensor`` holds the compute stream
until its collective is done. So the order the scheduling passes chose (prefetch: gathers issued early, waits late)
decides how much communication hides behind compute.

Costs:
- compute node: ``flops / flops_per_s`` for ops torch's flop counter knows (matmuls, attention), else
  ``bytes written / memory_bandwidth``, plus ``op_overhead`` seconds per node (the Python and dispatcher cost of
  one node of an eager-compiled graph);
- ring collective on N ranks with a full buffer of B bytes: all-gather and reduce-scatter take
  ``collective_overhead + (N-1)·latency + (N-1)/N·B/bandwidth``, all-reduce two such ring passes (one overhead);
- hybrid mesh (R replica groups of S shard ranks): the all-reduce of each gradient shard across the replicas
  (meta ``across == "replicate"``; stage 1's in the optimizer step) runs on R ranks and the inter-group network
  (``replicate_latency``, ``replicate_bandwidth``), every other collective on the ``world`` ranks simulated (S);
- ``step_overhead`` seconds per step on the compute stream, after the graphs: what a step runs outside them (the
  autograd engine, the compiled function's wrappers and guards, the optimizer's update, ``zero_grad``);
- data parallelism with a fixed batch per rank (weak scaling): compute and the full buffers do not change with N,
  so one compiled graph predicts every N; padding is ignored.
The optimizer step's own collectives (stages 1, 2) run eagerly after backward and are added unhidden.

:func:`calibrate` measures these constants; with a backend and a step it fits ``op_overhead``,
``collective_overhead`` and ``step_overhead`` to that backend's graphs and step (its docstring says how).
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from torch import fx

from .errors import FxShardError
from .ledger import N
from .passes.cost_model import node_flops, tensor_bytes
from .passes.fx_utils import COLLECTIVE_ROLES, replica_ranks

_WAIT = torch.ops._c10d_functional.wait_tensor.default


@dataclasses.dataclass(frozen=True)
class Machine:
    """What one rank and the network can do. Defaults are round numbers for a CPU host on a fast LAN."""

    flops_per_s: float = 5e10
    """FLOP/s of an op that torch's flop counter knows (matmuls, attention)."""
    memory_bandwidth: float = 1e10
    """Bytes/s written by an op without a flop formula."""
    bandwidth: float = 1e10
    """Bytes/s per rank on the ring."""
    latency: float = 2e-5
    """Seconds per ring hop of one collective."""
    collective_overhead: float = 0.0
    """Seconds per collective at any world size: issuing it, handing it to the backend's thread, waking the rank
    that waits for it."""
    op_overhead: float = 0.0
    """Seconds per compute node of a graph, on top of its work: Python and dispatch of the compiled graph."""
    step_overhead: float = 0.0
    """Seconds per step outside the graphs: autograd engine, compiled-function wrappers, optimizer update,
    zero_grad."""
    replicate_bandwidth: float | None = None
    """Bytes/s per rank on the ring across the replica groups of a hybrid mesh (often a slower inter-node network);
    None: ``bandwidth``."""
    replicate_latency: float | None = None
    """Seconds per ring hop across the replica groups of a hybrid mesh; None: ``latency``."""

    def across_replicas(self) -> Machine:
        """This machine with the inter-group network as its ring: what a collective across the replicas of a hybrid
        mesh runs on (the per-collective overhead is the host's, the same on either network)."""
        return dataclasses.replace(
            self, bandwidth=self.bandwidth if self.replicate_bandwidth is None else self.replicate_bandwidth,
            latency=self.latency if self.replicate_latency is None else self.replicate_latency)


GLOO_ON_CPU = Machine(flops_per_s=8.5e10, memory_bandwidth=3.9e10, bandwidth=6e8, latency=0.0,
                      collective_overhead=9.5e-4, op_overhead=7.7e-6)
"""gloo between processes of one host, one CPU thread per rank: ``calibrate`` on a 2-core x86 VM, 2 ranks
(docs/simulate.md, 2026-12-03). What sets it apart is the per-collective overhead (about 1 ms)."""

NCCL_ON_GPU = Machine(flops_per_s=5e13, memory_bandwidth=2e12, bandwidth=5e10, latency=5e-6,
                      collective_overhead=2e-5)
"""NCCL between GPUs of one node: stated (a ring of ~50 GB/s per rank, ~20 µs to launch a collective), not
calibrated; ``calibrate`` on your own cluster for figures to trust."""


def default_machine(device_type: str) -> Machine:
    """The machine the backend predicts on when given none: ``NCCL_ON_GPU`` for graphs on ``cuda``, else
    ``GLOO_ON_CPU``."""
    return NCCL_ON_GPU if device_type == "cuda" else GLOO_ON_CPU


@dataclasses.dataclass
class Event:
    graph: str
    node: str
    stream: str  # "compute" or "comm"
    start: float
    end: float
    unit: str = ""  # the unit a collective moves, or the module a compute node belongs to, where known


@dataclasses.dataclass
class Timeline:
    """The predicted step: total time, time the compute stream is busy (graph nodes and the per-step overhead),
    communication time, the part of it the compute stream waited for (exposed), and the per-step overhead alone."""

    world: int
    step_time: float
    compute_time: float
    comm_time: float
    exposed_comm: float
    overhead_time: float
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
    """Ring alpha-beta time of one collective whose full (unsharded) buffer has ``full_bytes``, plus the machine's
    per-collective overhead; an all-reduce is two ring passes (reduce-scatter, then all-gather)."""
    if world <= 1:
        return 0.0
    one_pass = (world - 1) * machine.latency + (world - 1) / world * full_bytes / machine.bandwidth
    return machine.collective_overhead + (2 if kind == "all_reduce" else 1) * one_pass


def _role(node: fx.Node) -> str | None:
    return node.meta.get("fxshard", {}).get("role")


def _ring(replicas: int | None, world: int, machine: Machine) -> tuple[int, Machine]:
    """(ranks, machine) a collective is timed on: ``replicas`` ranks on the inter-group network when it runs across
    the replicas of a hybrid mesh, else the ``world`` ranks simulated on the ring's own figures."""
    return (world, machine) if replicas is None else (replicas, machine.across_replicas())


def _unit(node: fx.Node) -> str:
    """The fxshard unit of a node the passes made, else the innermost module Dynamo traced it in."""
    unit = node.meta.get("fxshard", {}).get("unit")
    if unit:
        return unit
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    path = next(reversed(stack.values()), ("",))[0] if stack else ""
    return path.removeprefix("L['self'].").replace("._modules['", ".").replace("']", "")


def _full_bytes(node: fx.Node, kind: str) -> float:
    if kind == "all_gather":
        return tensor_bytes(node.meta.get("val"))  # the gathered output
    return tensor_bytes(node.args[0].meta.get("val"))  # what is reduced (across replicas: the gradient shard)


def compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes the compute stream runs and charges ``op_overhead`` for: every call but collectives and waits."""
    return [node for node in gm.graph.nodes if node.op == "call_function" and _role(node) not in COLLECTIVE_ROLES
            and node.target is not _WAIT]


def simulate_graph(gm: fx.GraphModule, name: str, world: int, machine: Machine, start: float = 0.0):
    """Run one graph's nodes on the two streams; returns (end time, busy compute, busy comm, events)."""
    compute_at = comm_at = start
    busy_compute = busy_comm = 0.0
    done: dict[fx.Node, float] = {}
    events = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        role = _role(node)
        if role in COLLECTIVE_ROLES:
            begin = max(compute_at, comm_at)
            seconds = collective_seconds(role, _full_bytes(node, role), *_ring(replica_ranks(node), world, machine))
            comm_at = done[node] = begin + seconds
            busy_comm += seconds
            events.append(Event(name, node.name, "comm", begin, comm_at, _unit(node)))
        elif node.target is _WAIT:
            issued = node.args[0]
            compute_at = max(compute_at, done.get(issued, compute_at))
        else:
            seconds = compute_seconds(node, machine)
            events.append(Event(name, node.name, "compute", compute_at, compute_at + seconds, _unit(node)))
            compute_at += seconds
            busy_compute += seconds
    return max(compute_at, comm_at), busy_compute, busy_comm, events


def _graphs_of(source) -> tuple[list[tuple[str, fx.GraphModule]], list[tuple[str, float, int | None]]]:
    """(name, graph) pairs of one step in execution order, and the optimizer step's collectives (kind, full bytes,
    replicas: the ranks of one across the replicas of a hybrid mesh, else None)."""
    from .budget import R, Ledger, ledger as ledger_of

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
                step.append((term.item, full, ledger.at(R) if term.ranks == R else None))
    return order, step


def simulate(source, world: int, *, bandwidth: float | None = None, latency: float | None = None,
             flops: float | None = None, machine: Machine | None = None) -> Timeline:
    """Predict one training step on ``world`` ranks from the rewritten graphs of ``source`` (a backend that ran
    a step, or GraphModules): ``bandwidth`` bytes/s per rank, ``latency`` seconds per ring hop, ``flops`` FLOP/s
    per rank override ``machine``'s (see :class:`Machine`, :func:`calibrate`). The step is the graphs in order,
    then the optimizer step's collectives, then ``machine.step_overhead``. On a hybrid mesh ``world`` is the shard
    group's size; the all-reduces across the replicas run over the mesh's replicas, on
    ``machine.replicate_bandwidth`` and ``replicate_latency`` (where None, the ring's, overrides included)."""
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
    for kind, full_bytes, replicas in step_collectives:  # eager, one after another, nothing to hide behind
        seconds = collective_seconds(kind, full_bytes, *_ring(replicas, world, machine))
        events.append(Event("optimizer step", kind, "comm", clock, clock + seconds))
        clock += seconds
        comm += seconds
    events.append(Event("step", "overhead", "compute", clock, clock + machine.step_overhead))
    clock += machine.step_overhead
    compute += machine.step_overhead
    return Timeline(world, clock, compute, comm, max(0.0, clock - compute), machine.step_overhead, events)


# -- calibration: fits (pure, testable on synthetic timings) ---------------------------------------------------

def fit_ring(full_bytes, gather_seconds, all_reduce_seconds, world: int) -> tuple[float, float, float]:
    """(collective_overhead, latency per hop, bandwidth) fitted by least squares to all-gathers and all-reduces of
    full buffers of ``full_bytes`` that took ``gather_seconds`` and ``all_reduce_seconds``, under
    :func:`collective_seconds`: an all-gather takes ``c + (N-1)·latency + x/bandwidth`` and an all-reduce
    ``c + 2·(N-1)·latency + 2·x/bandwidth``, x = (N-1)/N·B. Their difference separates the per-hop latency from
    the per-collective ``c``. A constant the noise drives negative is held at 0 and the others refitted. Needs
    ``world`` >= 2, two or more distinct sizes and times that grow with size."""
    full_bytes = [float(b) for b in full_bytes]
    seconds = [float(t) for t in gather_seconds] + [float(t) for t in all_reduce_seconds]
    if world < 2:
        raise FxShardError(f"fitting the ring needs a world of 2 or more ranks, got {world}")
    if len(set(full_bytes)) < 2 or len(seconds) != 2 * len(full_bytes):
        raise FxShardError(f"fitting the ring needs all-gather and all-reduce timings at each of two or more distinct "
                           f"sizes, got sizes {full_bytes}, {len(gather_seconds)} all-gather and "
                           f"{len(all_reduce_seconds)} all-reduce timing(s): pass sizes=(small, ..., large)")
    if min(seconds) <= 0:
        raise FxShardError(f"collective timings must be positive seconds, got {seconds}")
    sent = [(world - 1) / world * b for b in full_bytes]
    rows = [[1.0, passes * (world - 1), passes * x] for passes in (1, 2) for x in sent]
    free = [0, 1, 2]  # columns still fitted: overhead, latency, 1/bandwidth
    while True:
        design = torch.tensor([[row[i] for i in free] for row in rows], dtype=torch.float64)
        solution = torch.linalg.lstsq(design, torch.tensor(seconds, dtype=torch.float64)[:, None]).solution
        constants = dict(zip(free, solution[:, 0].tolist()))
        negative = [i for i in free[:-1] if constants[i] < 0]  # overhead or latency
        if not negative:
            break
        free.remove(negative[0])
    if constants[2] <= 0:
        timings = dict(zip(full_bytes, gather_seconds))
        raise FxShardError(f"collective time does not grow with size (all-gathers, bytes: seconds {timings}): the "
                           "measurement is noise-dominated; calibrate with more repeats or a larger largest size")
    return constants.get(0, 0.0), constants.get(1, 0.0), 1.0 / constants[2]


def fit_op_overhead(graphs, seconds: float, machine: Machine) -> float:
    """Seconds per compute node such that ``graphs`` (GraphModules) run without their collectives take
    ``seconds``: what the time left after the nodes' modelled work (FLOPs, bytes) costs per node; 0 when the
    work alone already takes that long."""
    graphs = list(graphs)
    nodes = [node for gm in graphs for node in compute_nodes(gm)]
    if not nodes:
        raise FxShardError("fitting op_overhead needs graphs with compute nodes; got none")
    bare = dataclasses.replace(machine, op_overhead=0.0)
    work = sum(compute_seconds(node, bare) for node in nodes)
    return max(0.0, (seconds - work) / len(nodes))


def fit_collective_overhead(graphs, world: int, seconds: float, machine: Machine) -> float:
    """Seconds per collective such that ``graphs`` (GraphModules, run one after another with their collectives)
    take ``seconds`` on ``world`` ranks, the other constants held at ``machine``'s: what a collective costs inside
    a step, where it contends with compute for the cores. Bisection on the timeline, which grows with it; 0 when
    the graphs take ``seconds`` without it. Needs graphs with collectives."""
    graphs = list(graphs)
    if not any(_role(node) in COLLECTIVE_ROLES for gm in graphs for node in gm.graph.nodes):
        raise FxShardError("fitting the per-collective overhead needs graphs with collectives; calibrate on a stage "
                           "whose graphs communicate (0, 2 or 3), or keep the ring benchmark's")

    def step_time(overhead: float) -> float:
        return simulate(graphs, world, machine=dataclasses.replace(machine, collective_overhead=overhead,
                                                                   step_overhead=0.0)).step_time

    low, high = 0.0, max(seconds, 1e-9)  # each collective costs at least the overhead, so `seconds` is too much
    if step_time(low) >= seconds:
        return 0.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if step_time(middle) < seconds else (low, middle)
    return (low + high) / 2


def fit_step_overhead(source, world: int, seconds: float, machine: Machine) -> float:
    """Seconds per step outside the graphs: a measured step of ``source`` (a backend that ran it) minus what
    :func:`simulate` predicts for its graphs and optimizer collectives; 0 when the prediction already exceeds it."""
    if seconds <= 0:
        raise FxShardError(f"a step must take positive seconds, got {seconds!r}")
    modelled = simulate(source, world, machine=dataclasses.replace(machine, step_overhead=0.0)).step_time
    return max(0.0, seconds - modelled)


def fit_step(machine: Machine, backend, world: int, compute_only: float, with_collectives: float,
             step: float) -> Machine:
    """``machine`` with the three overheads fitted to ``backend``'s step on ``world`` ranks, each fit on the one
    before: ``op_overhead`` to its forward and backward graphs taking ``compute_only`` seconds without their
    collectives, ``collective_overhead`` to them taking ``with_collectives`` seconds with them (unchanged when they
    have none), ``step_overhead`` to the whole step taking ``step`` seconds."""
    graphs = [gm for _, gm in _graphs_of(backend)[0]]
    machine = dataclasses.replace(machine, op_overhead=fit_op_overhead(graphs, compute_only, machine))
    if any(_role(node) in COLLECTIVE_ROLES for gm in graphs for node in gm.graph.nodes):
        machine = dataclasses.replace(
            machine, collective_overhead=fit_collective_overhead(graphs, world, with_collectives, machine))
    return dataclasses.replace(machine, step_overhead=fit_step_overhead(backend, world, step, machine))


# -- calibration: measurements ---------------------------------------------------------------------------------

def _zeros_for_placeholders(gm: fx.GraphModule) -> list[torch.Tensor]:
    """A zero tensor of each placeholder's traced shape and dtype (zeros are valid indices and labels too)."""
    values = []
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise FxShardError(f"cannot replay graph input {node.name}: it has no traced tensor value (got "
                               f"{type(val).__name__}); calibrate without backend= to skip the replay")
        shape = [getattr(size.node, "hint", size) if isinstance(size, torch.SymInt) else size for size in val.shape]
        values.append(torch.zeros([int(size) for size in shape], dtype=val.dtype))
    return values


def _without_collectives(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose collectives are empty tensors of their output's shape and whose waits are gone:
    the graph's compute alone, runnable on one rank."""
    with warnings.catch_warnings():  # torch 2.13's pytree warns about its own LeafSpec while copying codegen
        warnings.simplefilter("ignore", FutureWarning)
        graph = copy.deepcopy(gm.graph)
    for node in list(graph.nodes):
        if _role(node) in COLLECTIVE_ROLES:
            val = node.meta["val"]
            with graph.inserting_before(node):
                stand_in = graph.call_function(torch.ops.aten.empty.memory_format, ([int(s) for s in val.shape],),
                                               {"dtype": val.dtype})
            node.replace_all_uses_with(stand_in)
            graph.erase_node(node)
        elif node.op == "call_function" and node.target is _WAIT:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    return fx.GraphModule(gm, graph)


def _median_seconds(fn, repeats: int, before=None) -> float:
    """Median wall time of ``repeats`` calls of ``fn`` after one untimed call; ``before`` runs untimed ahead of
    each (a barrier, so that every rank starts a collective together)."""
    fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _interleaved_medians(calls, rounds: int, before) -> list[float]:
    """Median wall time of each of ``calls`` over ``rounds`` rounds that run every call once, in turn, after one
    untimed round; ``before`` runs untimed ahead of each call. Alternating, so that a change in the machine's load
    (another process on the cores) moves every median alike and their differences stay meaningful."""
    for call in calls:
        call()
    times = [[] for _ in calls]
    for _ in range(rounds):
        for call, record in zip(calls, times):
            before()
            start = time.perf_counter()
            call()
            record.append(time.perf_counter() - start)
    return [statistics.median(record) for record in times]


def _replay(graphs) -> Callable[[], None]:
    """A call that runs ``graphs`` one after another on zero inputs made once, without autograd."""
    inputs = [_zeros_for_placeholders(gm) for gm in graphs]

    @torch.no_grad()
    def run():
        for gm, args in zip(graphs, inputs):
            gm(*args)
    return run


def calibrate(group=None, *, backend=None, step=None, sizes=(1 << 12, 1 << 16, 1 << 20, 1 << 22),
              repeats: int = 20, steps: int = 20) -> Machine:
    """Measure this machine and process group; a collective: every rank calls it with the same arguments. Returns
    the same :class:`Machine` on every rank (times are averaged over the ranks before anything is fitted).

    Always: matmul FLOP/s and copy bandwidth (best of ``repeats``), and the ring (:func:`fit_ring`: per-collective
    overhead, latency per hop, bandwidth) from functional all-gathers and all-reduces of full buffers of ``sizes``
    bytes, each the median of ``repeats`` timed after a barrier.

    With ``backend`` (one that ran a step) and ``step`` (a callable running one whole training step of it: forward,
    backward, optimizer step, zero_grad; called ``steps + 1`` times, so it trains), three fits, each on the one
    before, from the backend's forward and backward graphs replayed on zero inputs and from real steps:
    ``op_overhead`` (:func:`fit_op_overhead`) from the median of ``repeats`` replays without the collectives;
    ``collective_overhead`` (:func:`fit_collective_overhead`) from replays with them, where a collective contends
    with compute for the cores (the ring's value stays when the graphs have none); ``step_overhead``
    (:func:`fit_step_overhead`) from the steps. Replays with collectives and steps alternate over ``steps`` rounds
    (medians), so a change in load moves both alike. The fits assume one machine for every configuration of the
    same model and optimizer: calibrate one configuration and predict the others; another model needs its own."""
    import torch.distributed as dist

    from .passes.cost_model import best_time

    if (backend is None) != (step is None):
        raise FxShardError("calibrate fits a step's overheads from both backend= (that ran a step) and step= (a "
                           "callable running one training step of it); pass both, or neither for the machine alone")
    if repeats < 1 or steps < 1:
        raise FxShardError(f"repeats and steps must be >= 1, got repeats={repeats}, steps={steps}")
    world = dist.get_world_size(group)
    a = torch.randn(256, 256)
    big = torch.randn(1 << 20)
    measured = [2 * 256**3 / best_time(lambda: a @ a, repeats), big.nbytes / best_time(big.clone, repeats)]
    barrier = lambda: dist.barrier(group)  # noqa: E731
    group_name = (group or dist.group.WORLD).group_name
    functional = torch.ops._c10d_functional
    shard_numels = [max(1, int(full_bytes) // 4 // world) for full_bytes in sizes]
    for numel in shard_numels:  # the graphs' own collectives: functional, then wait
        shard, full = torch.randn(numel), torch.randn(numel * world)
        measured += _interleaved_medians(
            [lambda: functional.wait_tensor(functional.all_gather_into_tensor(shard, world, group_name)),
             lambda: functional.wait_tensor(functional.all_reduce(full, "sum", group_name))], repeats, barrier)
    if backend is not None:
        graphs = [gm for _, gm in _graphs_of(backend)[0]]
        measured.append(_median_seconds(_replay([_without_collectives(gm) for gm in graphs]), repeats))
        measured += _interleaved_medians([_replay(graphs), step], steps, barrier)
    averaged = torch.tensor(measured, dtype=torch.float64)
    dist.all_reduce(averaged, group=group)
    flops, memory, *times = (averaged / world).tolist()
    ring_times, step_times = times[:2 * len(sizes)], times[2 * len(sizes):]
    overhead, latency, bandwidth = fit_ring([4 * numel * world for numel in shard_numels], ring_times[0::2],
                                            ring_times[1::2], world)
    machine = Machine(flops_per_s=flops, memory_bandwidth=memory, bandwidth=bandwidth, latency=latency,
                      collective_overhead=overhead)
    return machine if backend is None else fit_step(machine, backend, world, *step_times)
