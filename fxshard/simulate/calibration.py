"""Calibration: the ``Machine`` constants of the simulator measured on this group, and the fits behind them.

``calibrate`` measures latency and bandwidth; with a backend and a step it fits ``op_overhead``,
``collective_overhead``, ``overlap`` and ``step_overhead`` to that backend's graphs and step (its docstring says
how). The fits are pure functions, testable on synthetic timings.
"""

from __future__ import annotations

import dataclasses
import operator
import statistics
import time
from collections.abc import Callable

import torch
from torch import fx

from fxshard.errors import FxShardError
from fxshard.passes.cost_model import Machine, collective_role, compute_seconds, node_flops
from fxshard.passes.fx_utils import size_hint
from fxshard.passes.trial import copied_graph
from fxshard.runtime.collectives import COLLECTIVE_ROLES, WAIT
from fxshard.runtime.groups import uses_gloo
from fxshard.torch_compat import c10d_functional

from .simulator import compute_nodes, graphs_of, simulate

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


def fit_bandwidth(full_bytes, seconds, world: int) -> float:
    """Bandwidth (bytes/s per rank) of one kind of collective (all-gathers, all-to-alls) of full buffers of
    ``full_bytes`` that took ``seconds``: the slope of the least-squares line through time against the (N-1)/N·B
    bytes each rank sends (its intercept is the per-collective overhead and latency the ring's fit has)."""
    sent = torch.tensor([(world - 1) / world * float(b) for b in full_bytes], dtype=torch.float64)
    times = torch.tensor([float(t) for t in seconds], dtype=torch.float64)
    if len(set(sent.tolist())) < 2 or len(times) != len(sent):
        raise FxShardError(f"fitting a bandwidth needs a timing at each of two or more distinct sizes, got sizes "
                           f"{list(full_bytes)} and {len(times)} timing(s)")
    design = torch.stack([torch.ones_like(sent), sent], dim=1)
    slope = torch.linalg.lstsq(design, times[:, None]).solution[1, 0].item()
    if slope <= 0:
        raise FxShardError(f"collective time does not grow with size (bytes: seconds "
                           f"{dict(zip(full_bytes, seconds))}): calibrate with more repeats or a larger largest size")
    return 1.0 / slope


def fit_flops(graphs, seconds: float, seconds_without_flops: float, machine: Machine) -> float:
    """FLOP/s of the ops of ``graphs`` that torch's flop counter knows (matmuls, attention), at the graphs' own
    shapes: their FLOPs over their share of a replay, ``seconds`` for the whole graphs less
    ``seconds_without_flops`` for the same graphs with those ops' outputs left empty
    (:func:`without_flop_ops`). ``machine``'s own when the graphs count no FLOPs or the replays do not tell
    them apart."""
    flops = sum(node_flops(node) for gm in graphs for node in compute_nodes(gm))
    if not flops or seconds <= seconds_without_flops:
        return machine.flops_per_s
    return flops / (seconds - seconds_without_flops)


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


def _bisect(step_time: Callable[[float], float], seconds: float, low: float, high: float) -> float:
    """The value in [low, high] at which ``step_time``, monotonic over it, takes ``seconds``; the end nearer to
    ``seconds`` where it never does."""
    at_low, at_high = step_time(low), step_time(high)
    rising = at_high > at_low
    if (seconds <= at_low) if rising else (seconds >= at_low):
        return low
    if (seconds >= at_high) if rising else (seconds <= at_high):
        return high
    for _ in range(60):
        middle = (low + high) / 2
        if (step_time(middle) < seconds) == rising:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def _fit_field(field: str, graphs, world: int, seconds: float, machine: Machine, high: float) -> float:
    """The value in [0, ``high``] of ``machine``'s ``field`` at which ``graphs`` (GraphModules with collectives, run
    one after another) take ``seconds`` on ``world`` ranks, the other constants held (bisection on the timeline)."""
    graphs = list(graphs)
    if not any(collective_role(node) in COLLECTIVE_ROLES for gm in graphs for node in gm.graph.nodes):
        raise FxShardError(f"fitting {field} needs graphs with collectives; calibrate on a stage whose graphs "
                           "communicate (0, 2 or 3), or keep the ring benchmark's")

    def step_time(value: float) -> float:
        return simulate(graphs, world, machine=dataclasses.replace(machine, **{field: value},
                                                                   step_overhead=0.0)).step_time

    return _bisect(step_time, seconds, 0.0, high)


def fit_collective_overhead(graphs, world: int, seconds: float, machine: Machine) -> float:
    """Seconds per collective such that ``graphs`` (GraphModules, run one after another with their collectives,
    each waited for as soon as it is issued: :func:`serialized`) take ``seconds`` on ``world`` ranks, the other
    constants held at ``machine``'s: what a collective costs inside a step, where it contends with compute for the
    cores. Bisection on the timeline, which grows with it; 0 when the graphs take ``seconds`` without it. Needs
    graphs with collectives."""
    # each collective costs at least the overhead, so `seconds` is too much
    return _fit_field("collective_overhead", graphs, world, seconds, machine, max(seconds, 1e-9))


def fit_overlap(graphs, world: int, seconds: float, machine: Machine) -> float:
    """The share of a collective's time that runs under compute (``Machine.overlap``, 0 to 1) such that ``graphs``
    (GraphModules as scheduled, collectives issued ahead of their waits) take ``seconds`` on ``world`` ranks, the
    other constants held at ``machine``'s: 1 when they are as fast as full overlap predicts, 0 when no faster than
    without any."""
    return _fit_field("overlap", graphs, world, seconds, machine, 1.0)


def fit_step_overhead(source, world: int, seconds: float, machine: Machine) -> float:
    """Seconds per step outside the graphs: a measured step of ``source`` (a backend that ran it) minus what
    :func:`simulate` predicts for its graphs and optimizer collectives; 0 when the prediction already exceeds it."""
    if seconds <= 0:
        raise FxShardError(f"a step must take positive seconds, got {seconds!r}")
    modelled = simulate(source, world, machine=dataclasses.replace(machine, step_overhead=0.0)).step_time
    return max(0.0, seconds - modelled)


def fit_step(machine: Machine, backend, world: int, compute_only: float, without_flops: float, serial: float,
             scheduled: float, step: float) -> Machine:
    """``machine`` with its compute rates, overheads and overlap fitted to ``backend``'s step on ``world`` ranks,
    each fit on the ones before: ``flops_per_s`` to its forward and backward graphs taking ``compute_only``
    seconds without their collectives and ``without_flops`` seconds without their FLOP-counted ops too
    (:func:`fit_flops`), ``op_overhead`` to the first; ``collective_overhead`` to them taking ``serial`` seconds
    with each collective waited for as soon as it is issued, and ``overlap`` to them taking ``scheduled`` seconds
    as scheduled (both unchanged when the graphs have no collectives); ``step_overhead`` to the whole step taking
    ``step`` seconds."""
    graphs = [gm for _, gm in graphs_of(backend)[0]]
    machine = dataclasses.replace(machine, flops_per_s=fit_flops(graphs, compute_only, without_flops, machine))
    machine = dataclasses.replace(machine, op_overhead=fit_op_overhead(graphs, compute_only, machine))
    if any(collective_role(node) in COLLECTIVE_ROLES for gm in graphs for node in gm.graph.nodes):
        overhead = fit_collective_overhead([serialized(gm) for gm in graphs], world, serial, machine)
        machine = dataclasses.replace(machine, collective_overhead=overhead)
        machine = dataclasses.replace(machine, overlap=fit_overlap(graphs, world, scheduled, machine))
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
        values.append(torch.zeros([size_hint(size) for size in val.shape], dtype=val.dtype))
    return values


def serialized(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` in which every collective is waited for as soon as it is issued: nothing it sends can
    overlap compute, whatever the machine (what :func:`fit_collective_overhead` times)."""
    graph = copied_graph(gm)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is WAIT:
            node.args[0].append(node)
    return fx.GraphModule(gm, graph)


def _leave_empty(graph: fx.Graph, node: fx.Node) -> None:
    """Replace ``node`` by an empty tensor of its output's shape, strides and dtype (the views after it rely on
    them); a node with several outputs, each getitem of it by one of its own."""
    for target in [user for user in node.users if user.target is operator.getitem] or [node]:
        val = target.meta["val"]
        with graph.inserting_before(node):
            stand_in = graph.call_function(torch.ops.aten.empty_strided.default,
                                           ([size_hint(size) for size in val.shape],
                                            [size_hint(stride) for stride in val.stride()]), {"dtype": val.dtype})
        target.replace_all_uses_with(stand_in)
        if target is not node:
            graph.erase_node(target)
    graph.erase_node(node)


def _without_collectives(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose collectives are empty tensors of their output's shape and whose waits are gone:
    the graph's compute alone, runnable on one rank."""
    graph = copied_graph(gm)
    for node in list(graph.nodes):
        if collective_role(node) in COLLECTIVE_ROLES:
            _leave_empty(graph, node)
        elif node.op == "call_function" and node.target is WAIT:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    return fx.GraphModule(gm, graph)


def without_flop_ops(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose FLOP-counted ops (matmuls, attention) are empty tensors of their outputs' shapes:
    replayed beside ``gm``, what those ops take apart from the rest (:func:`fit_flops`)."""
    graph = copied_graph(gm)
    for node in list(graph.nodes):
        if node.op == "call_function" and node_flops(node):
            _leave_empty(graph, node)
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


def calibrate(group=None, *, backend=None, step=None, sizes=(1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24),
              repeats: int = 20, steps: int = 20) -> Machine:
    """Measure this machine and process group; a collective: every rank calls it with the same arguments. Returns
    the same :class:`Machine` on every rank (times are averaged over the ranks before anything is fitted).

    Always: matmul FLOP/s and copy bandwidth (medians of ``repeats``, every rank computing at once as in a step:
    the ranks of one host share its cores and memory), the ring's per-collective overhead and latency per hop
    (:func:`fit_ring`) from functional all-gathers and all-reduces of full buffers of ``sizes`` bytes (up to the
    16 MiB of an optimizer step's bucket), its bandwidth from the all-gathers alone and the all-to-all's from
    all-to-alls of the same buffers (:func:`fit_bandwidth`: gloo's all-reduce runs faster than the two ring passes
    the model charges, which would flatter the all-gather), each the median of ``repeats`` timed after a
    barrier.

    With ``backend`` (one that ran a step) and ``step`` (a callable running one whole training step of it: forward,
    backward, optimizer step, zero_grad; called ``steps + 1`` times, so it trains), five fits, each on the ones
    before, from the backend's forward and backward graphs replayed on zero inputs and from real steps:
    ``flops_per_s`` (:func:`fit_flops`: the graphs' own matmuls and attention, at their shapes, with every rank
    at work) from the medians of ``repeats`` replays without the collectives, and without the FLOP-counted ops as
    well (:func:`without_flop_ops`); ``op_overhead`` (:func:`fit_op_overhead`) from the first;
    ``collective_overhead`` (:func:`fit_collective_overhead`) from replays with them, each waited for as soon as it
    is issued (:func:`serialized`), where a collective contends with compute for the cores; ``overlap``
    (:func:`fit_overlap`) from replays as scheduled (both keep the ring's values when the graphs have no
    collectives); ``step_overhead`` (:func:`fit_step_overhead`) from the steps. The replays with collectives and
    the steps alternate over ``steps`` rounds (medians), so a change in load moves them alike. The fits assume one
    machine for every configuration of the same model and optimizer: calibrate one configuration and predict the
    others; another model needs its own."""
    import torch.distributed as dist

    if (backend is None) != (step is None):
        raise FxShardError("calibrate fits a step's overheads from both backend= (that ran a step) and step= (a "
                           "callable running one training step of it); pass both, or neither for the machine alone")
    if repeats < 1 or steps < 1:
        raise FxShardError(f"repeats and steps must be >= 1, got repeats={repeats}, steps={steps}")
    world = dist.get_world_size(group)
    a = torch.randn(512, 512)
    big = torch.randn(1 << 22)
    barrier = lambda: dist.barrier(group)  # noqa: E731
    # matmuls and copies on every rank at once, as a step runs them: the ranks of one host share its cores (in
    # time, where there are more ranks than cores) and its memory bandwidth. Each timed call lasts ~10 ms, several
    # of the kernel's time slices, so that sharing shows in it.
    measured = [8 * 2 * 512**3 / _median_seconds(lambda: [a @ a for _ in range(8)], repeats, before=barrier),
                4 * big.nbytes / _median_seconds(lambda: [big.clone() for _ in range(4)], repeats, before=barrier)]
    group_name = (group or dist.group.WORLD).group_name
    functional = c10d_functional
    shard_numels = [max(1, int(full_bytes) // 4 // world) for full_bytes in sizes]
    for numel in shard_numels:  # the graphs' own collectives: functional, then wait
        shard, full, rows = torch.randn(numel), torch.randn(numel * world), [numel] * world
        measured += _interleaved_medians(
            [lambda: functional.wait_tensor(functional.all_gather_into_tensor(shard, world, group_name)),
             lambda: functional.wait_tensor(functional.all_reduce(full, "sum", group_name)),
             lambda: functional.wait_tensor(functional.all_to_all_single(full, rows, rows, group_name))],
            repeats, barrier)
    if backend is not None:
        graphs = [gm for _, gm in graphs_of(backend)[0]]
        compute_only = [_without_collectives(gm) for gm in graphs]
        # after a barrier, every rank replaying at once: compute shares the cores as in a step
        without_flops = [without_flop_ops(gm) for gm in compute_only]
        measured += _interleaved_medians([_replay(compute_only), _replay(without_flops)], repeats, barrier)
        measured += _interleaved_medians([_replay([serialized(gm) for gm in graphs]), _replay(graphs), step], steps,
                                         barrier)
    averaged = torch.tensor(measured, dtype=torch.float64)
    dist.all_reduce(averaged, group=group)
    flops, memory, *times = (averaged / world).tolist()
    ring_times, step_times = times[:3 * len(sizes)], times[3 * len(sizes):]
    full_bytes = [4 * numel * world for numel in shard_numels]
    overhead, latency, _ = fit_ring(full_bytes, ring_times[0::3], ring_times[1::3], world)
    machine = Machine(flops_per_s=flops, memory_bandwidth=memory, latency=latency, collective_overhead=overhead,
                      bandwidth=fit_bandwidth(full_bytes, ring_times[0::3], world),
                      all_to_all_bandwidth=fit_bandwidth(full_bytes, ring_times[2::3], world),
                      gathers_into_staging=uses_gloo(group or dist.group.WORLD),
                      name=f"calibrated on {world} ranks of this group")
    return machine if backend is None else fit_step(machine, backend, world, *step_times)
