"""``fxshard.simulate``: an alpha-beta timeline of the scheduled graphs, to predict step time at any world size.

Two streams, as the rewritten graphs run them: a compute stream that runs every node in graph order, and a
communication stream that runs the collectives one after another. A collective is issued when the compute stream
reaches it (its input is ready then) and the communication stream is free; ``wait_tensor`` holds the compute stream
until its collective is done. So the order the scheduling passes chose (prefetch: gathers issued early, waits late)
decides how much communication hides behind compute.

What a node costs is the one estimator's (``fxshard/passes/cost_model.py``, the one the prefetch pass placed the
gathers by): compute from FLOPs or bytes written, each collective by its kind, bytes, ranks and link. The timeline
adds:
- a collective holds the compute stream for ``1 - overlap`` of its time from when it is issued (the share of moving
  its bytes that takes the cores compute runs on: ``overlap`` is 1 on GPUs, less for gloo on a CPU host);
- the optimizer's update, after the graphs and the optimizer step's collectives: the bytes it writes (its
  master and state read and written, its gradients read, its buckets copied in and out) / ``memory_bandwidth``;
- ``step_overhead`` seconds per step on the compute stream, after that: what a step runs outside the graphs (the
  autograd engine, the compiled function's wrappers and guards, the optimizer's Python, ``zero_grad``);
- data parallelism with a fixed batch per rank (weak scaling): compute and the full buffers do not change with N,
  so one compiled graph predicts every N; padding is ignored.
The optimizer step's own collectives (stages 1, 2) run eagerly after backward and are added unhidden.

:func:`fxshard.simulate.calibrate` (``calibration.py``) measures these constants.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re
from collections.abc import Callable

import sympy
import torch
from torch import fx

from fxshard.budget import Ledger, R
from fxshard.budget import ledger as ledger_of
from fxshard.budget.symbols import N
from fxshard.errors import FxShardError
from fxshard.passes.cost_model import (
    Machine,
    collective_role,
    collective_seconds,
    compute_seconds,
    default_machine,
    full_bytes,
    replica_ring,
    ring_of,
)
from fxshard.passes.fx_utils import size_hint
from fxshard.passes.quantize import DEFAULT_QUANTIZE_BLOCK, packed_rows_bytes, packing_nodes
from fxshard.runtime.collectives import COLLECTIVE_ROLES, WAIT, collective_of
from fxshard.runtime.groups import scatters_by_all_to_all
from fxshard.runtime.param import spec_of



@dataclasses.dataclass(frozen=True)
class WhatIf:
    """Communication options priced on graphs compiled without them (``simulate(..., what_if=...)``): the weights'
    gathers of forward and backward packed as ``quantize_weights``, the gradients' reductions as
    ``quantize_grads`` (bytes: ``passes.quantize``'s layout; packing and unpacking: the lowering's own nodes, on the
    compute stream), backward's gathers over ``secondary`` ranks of a node (``reshard_after_forward=k``), unpacked
    as the lowering leaves them. Collectives already packed or over another group keep their cost."""

    quantize_weights: str | None = None
    quantize_grads: str | None = None
    quantize_block: int = DEFAULT_QUANTIZE_BLOCK
    secondary: int | None = None
    recompute: tuple[str, ...] = ()  # modules (names) whose forward backward recomputes: activation checkpointing

    def describe(self) -> str:
        parts = [f'{k}="{v}"' for k, v in (("quantize_weights", self.quantize_weights),
                                           ("quantize_grads", self.quantize_grads)) if v]
        if self.secondary:
            parts.append(f"reshard_after_forward={self.secondary}")
        if self.recompute:
            parts.append(f"{len(self.recompute)} modules checkpointed")
        return ", ".join(parts) or "as compiled"

    def checkpointed(self, unit: str) -> str | None:
        """The checkpointed module a compute node of ``unit`` (its module's name) runs in, if any."""
        return next((m for m in self.recompute if unit == m or unit.startswith(m + ".")), None)

    def scheme_for(self, node: fx.Node, role: str) -> str | None:
        meta = node.meta.get("fxshard", {})
        if meta.get("quantized") or meta.get("across"):
            return None
        return {"all_gather": self.quantize_weights, "reduce_scatter": self.quantize_grads}.get(role)


def machine_of(source) -> Machine:
    """The machine a prediction of ``source`` runs on where none is given: a backend's own (``machine=``, the one
    its schedules were chosen on), else the default of its parameters' device (``default_machine``), as for
    rewritten graphs alone."""
    machine = getattr(source, "machine", None)
    if machine is not None:
        return machine
    model = getattr(source, "model", None)
    return default_machine("cpu" if model is None else next(model.parameters()).device.type)


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





def _unit(node: fx.Node) -> str:
    """The fxshard unit of a node the passes made, else the innermost module Dynamo traced it in."""
    return node.meta.get("fxshard", {}).get("unit") or module_of(node)


def module_of(node: fx.Node) -> str:
    """The name of the innermost module (as ``named_modules`` gives it) whose forward traced ``node`` (a backward
    node: the forward node it differentiates), from Dynamo's ``nn_module_stack`` paths (``L['self'].layers[0]``,
    ``L['args'][0].model._modules['norm']``); "" where none did. Entries for plain functions (``G[...]``) are
    skipped."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    paths = [path for path, _ in stack.values() if path.startswith("L[")]
    if not paths:
        return ""
    path = re.sub(r"\._modules\['([^']*)'\]", r".\1", paths[-1])
    path = re.sub(r"^L\[[^\]]*\](\[[^\]]*\])*\.?", "", path)  # the frame's local: self, args[0]
    return re.sub(r"\[(\d+)\]", r".\1", path)


def compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes the compute stream runs and charges ``op_overhead`` for: every call but collectives and waits."""
    return [node for node in gm.graph.nodes
            if node.op == "call_function" and collective_role(node) not in COLLECTIVE_ROLES and node.target is not WAIT]


@functools.lru_cache(maxsize=4096)
def _packing(scheme: str, block: int, rows: int, elements: int, received_rows: int, dtype: torch.dtype,
             unpacked_dtype: torch.dtype) -> tuple[list[fx.Node], list[fx.Node]]:
    """The nodes that pack a collective's rows and those that unpack the rows it receives: the lowering's own
    (``passes.quantize.packing_nodes``), priced as any compute node."""
    nodes = packing_nodes(scheme, block, rows, elements, received_rows, dtype, unpacked_dtype)
    return ([n for n in nodes if n.meta["fxshard"]["role"] == "quantize"],
            [n for n in nodes if n.meta["fxshard"]["role"] == "dequantize"])


def _priced(node: fx.Node, role: str, name: str, world: int, machine: Machine, what_if: WhatIf | None
            ) -> tuple[float, float, float]:
    """(seconds on the communication stream, seconds of packing before it and of unpacking after its wait on the
    compute stream) of a collective, ``what_if``'s options applied."""
    full = full_bytes(node, role)
    meta = node.meta.get("fxshard", {})
    kind = collective_of(node.target).kind
    ranks, ring = ring_of(node, world, machine)
    if what_if is None:
        return collective_seconds(kind, full, ranks, ring), 0.0, 0.0
    scheme = what_if.scheme_for(node, role)
    if what_if.secondary and role == "all_gather" and "backward" in name and not meta.get("across"):
        ranks, ring, scheme = what_if.secondary, machine.inside_node(), None  # re-gathers travel unpacked
    if scheme is None:
        return collective_seconds(kind, full, ranks, ring), 0.0, 0.0
    value = node.meta.get("val") if role == "all_gather" else node.args[0].meta.get("val")
    elements = size_hint(value.numel())
    # packed a row per rank (passes/quantize.py), where that makes a row smaller
    packed = packed_rows_bytes(-(-elements // ranks), ranks, value.element_size(), scheme, what_if.quantize_block)
    if packed is None:
        return collective_seconds(kind, full, ranks, ring), 0.0, 0.0
    # a gather packs this rank's row and unpacks every rank's; a reduction packs and unpacks every rank's rows,
    # exchanged by an all-to-all and summed in fp32
    rows, unpacked_dtype = (1, value.dtype) if role == "all_gather" else (ranks, torch.float32)
    if role == "reduce_scatter":
        kind = "all_to_all"
    pack, unpack = (sum(compute_seconds(n, machine) for n in nodes)
                    for nodes in _packing(scheme, what_if.quantize_block, rows, -(-elements // ranks), ranks,
                                          value.dtype, unpacked_dtype))
    return collective_seconds(kind, packed, ranks, ring), pack, unpack


def simulate_graph(gm: fx.GraphModule, name: str, world: int, machine: Machine, start: float = 0.0,
                   what_if: WhatIf | None = None, recompute: collections.Counter | None = None):
    """Run one graph's nodes on the two streams; returns (end time, busy compute, busy comm, events).

    Activation checkpointing (``what_if.recompute``): a forward graph adds each checkpointed module's compute to
    ``recompute``; a backward graph spends it, running the module's forward again on the compute stream right
    before the module's first node, where the collectives in flight hide behind it as behind any compute."""
    checkpointed = what_if.checkpointed if what_if and what_if.recompute and recompute is not None else None
    forward = name.endswith("forward")
    compute_at = comm_at = start
    busy_compute = busy_comm = 0.0
    done: dict[fx.Node, float] = {}
    unpacking: dict[fx.Node, float] = {}
    events = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        role = collective_role(node)
        if role in COLLECTIVE_ROLES:
            seconds, packing, unpacking[node] = _priced(node, role, name, world, machine, what_if)
            compute_at += packing  # packing is compute, before the collective can start
            busy_compute += packing + unpacking[node]
            begin = max(compute_at, comm_at)
            comm_at = done[node] = begin + seconds
            compute_at += (1.0 - machine.overlap) * seconds
            busy_comm += seconds
            events.append(Event(name, node.name, "comm", begin, comm_at, _unit(node)))
        elif node.target is WAIT:
            issued = node.args[0]
            compute_at = max(compute_at, done.get(issued, compute_at)) + unpacking.get(issued, 0.0)
        else:
            seconds = compute_seconds(node, machine)
            # the model's own compute, not the gathers' copies (a recomputed forward reads backward's gathers)
            model_own = node.meta.get("fxshard", {}).get("role") is None
            module = checkpointed(module_of(node)) if checkpointed and model_own else None
            if module is not None and forward:
                recompute[module] += seconds
            elif module is not None and recompute.get(module):
                again = recompute.pop(module)
                events.append(Event(name, f"recompute {module}", "compute", compute_at, compute_at + again, module))
                compute_at += again
                busy_compute += again
            events.append(Event(name, node.name, "compute", compute_at, compute_at + seconds, _unit(node)))
            compute_at += seconds
            busy_compute += seconds
    return max(compute_at, comm_at), busy_compute, busy_comm, events


def chosen_candidate(candidates: list[dict], seconds: list[float]) -> int:
    """The candidate autotune compiles: of those that fit the memory budget, the one predicted fastest (``seconds``,
    the first on a tie), else the one that needs the fewest bytes."""
    indices = range(len(candidates))
    fitting = [i for i in indices if candidates[i]["fits"]]
    if fitting:
        return min(fitting, key=lambda i: (seconds[i], i))
    return min(indices, key=lambda i: (candidates[i]["bytes"], i))


def as_chosen_at(gm: fx.GraphModule, name: str, world: int, machine: Machine,
                 what_if: WhatIf | None = None, knobs: str | None = None) -> fx.GraphModule:
    """The graph the backend would have compiled for ``world`` ranks on ``machine``: where autotune chose among
    candidates (``gm.meta["fxshard_choice"]``), the one with ``knobs`` (``autotune.describe_knobs``) where one has
    them, else the one ``chosen_candidate`` picks by their predictions there (whether each fits the memory budget
    stays as judged at the compiled world); else ``gm`` itself."""
    choice = gm.meta.get("fxshard_choice")
    if choice is None:
        return gm
    candidates = choice["candidates"]
    named = [c["graph"] for c in candidates if c["knobs"] == knobs]
    if named:
        return named[0]
    seconds = [simulate_graph(c["graph"], name, world, machine, what_if=what_if)[0] for c in candidates]
    return candidates[chosen_candidate(candidates, seconds)]["graph"]


def _scatters_by_all_to_all(model) -> bool:
    """Whether the optimizer step reduce-scatters ``model``'s gradients as an all-to-all and a local sum (its
    parameters' group is gloo's: ``fxshard.runtime.groups.scatters_by_all_to_all``)."""
    spec = next((spec for p in model.parameters() if (spec := spec_of(p)) is not None), None)
    return spec is not None and scatters_by_all_to_all(spec.group_name)


def _no_update(world: int) -> float:
    return 0.0


def graphs_of(source) -> tuple[list[tuple[str, fx.GraphModule]], list[tuple[str, float, int | None]],
                               Callable[[int], float]]:
    """(name, graph) pairs of one step in execution order; the optimizer step's collectives (kind, full bytes,
    replicas: the ranks of one across the replicas of a hybrid mesh, else None); and the bytes the optimizer's
    update writes on ``world`` ranks (a function of it): each element it updates reads and writes its master and
    state and reads its gradient (3 x the master's bytes + 2 x the state's, from the ledger), and each step
    collective writes its bucket's input and output."""
    if isinstance(source, fx.GraphModule):
        return [("graph", source)], [], _no_update
    if isinstance(source, (list, tuple)) and all(isinstance(g, fx.GraphModule) for g in source):
        return [(f"graph {i}", g) for i, g in enumerate(source)], [], _no_update
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
    if getattr(source, "optimizer", None) is None or getattr(source, "model", None) is None:
        return order, [], _no_update
    ledger: Ledger = ledger_of(source)
    by_all_to_all = _scatters_by_all_to_all(source.model)
    step, buckets = [], []
    for term in ledger.select("comm"):
        if term.source.startswith("optimizer step"):
            full = ledger.at(term.bytes) * (ledger.at(N) if term.item == "all_gather" else 1)
            kind = "all_to_all" if term.item == "reduce_scatter" and by_all_to_all else term.item
            step.append((kind, full, ledger.at(R) if term.ranks == R else None))
            buckets.append(2 * full if kind == "all_reduce" else full + full / N)  # input and output, one a shard
    updated = sympy.Add(*(term.bytes * (3 if term.item == "master" else 2) for term in ledger.select("memory")
                          if term.source.startswith("optimizer: ")), *buckets)
    return order, step, lambda world: ledger.at(updated, N=world)


def simulate(source, world: int, *, bandwidth: float | None = None, latency: float | None = None,
             flops: float | None = None, machine: Machine | None = None, what_if: WhatIf | None = None,
             knobs: str | None = None) -> Timeline:
    """Predict one training step on ``world`` ranks from the rewritten graphs of ``source`` (a backend that ran
    a step, or GraphModules): ``bandwidth`` bytes/s per rank, ``latency`` seconds per ring hop, ``flops`` FLOP/s
    per rank override ``machine``'s (see :class:`Machine`, :func:`calibrate`; None: ``machine_of(source)``, a
    backend's own machine or its device's default). The step is the graphs in order,
    then the optimizer step's collectives, then ``machine.step_overhead``. On a hybrid mesh ``world`` is the shard
    group's size; the all-reduces across the replicas run over the mesh's replicas, on
    ``machine.replicate_bandwidth`` and ``replicate_latency`` (where None, the ring's, overrides included).
    ``what_if``: communication options priced on graphs compiled without them (:class:`WhatIf`). Where the backend
    chose a graph's knobs (``bucket="auto"``, prefetch under a memory budget), the choice is made again for
    ``world`` ranks on ``machine`` (:func:`as_chosen_at`), or the candidate compiled with ``knobs`` (as
    ``describe_choices`` names them: ``'bucket="layer", prefetch=1, max_inflight_gathers=2'``) where there is one."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise FxShardError(f"world must be a positive number of ranks, got {world!r}")
    machine = machine or machine_of(source)
    overrides = {k: v for k, v in (("bandwidth", bandwidth), ("latency", latency), ("flops_per_s", flops))
                 if v is not None}
    for key, value in overrides.items():
        if value < 0 or (key != "latency" and value == 0):
            raise FxShardError(f"{key} must be positive, got {value!r}")
    machine = dataclasses.replace(machine, **overrides)
    graphs, step_collectives, update_bytes = graphs_of(source)
    clock = compute = comm = 0.0
    events: list[Event] = []
    recompute: collections.Counter = collections.Counter()  # per checkpointed module: its forward's compute
    for name, gm in graphs:
        gm = as_chosen_at(gm, name, world, machine, what_if, knobs)
        clock, busy_compute, busy_comm, graph_events = simulate_graph(gm, name, world, machine, clock, what_if,
                                                                      recompute)
        compute += busy_compute
        comm += busy_comm
        events += graph_events
    for kind, full, replicas in step_collectives:  # eager, one after another, nothing to hide behind
        seconds = collective_seconds(kind, full, *replica_ring(replicas, world, machine))
        events.append(Event("optimizer step", kind, "comm", clock, clock + seconds))
        clock += seconds
        comm += seconds
    update = update_bytes(world) / machine.memory_bandwidth
    if update:
        events.append(Event("optimizer step", "update", "compute", clock, clock + update))
        clock += update
        compute += update
    events.append(Event("step", "overhead", "compute", clock, clock + machine.step_overhead))
    clock += machine.step_overhead
    compute += machine.step_overhead
    return Timeline(world, clock, compute, comm, max(0.0, clock - compute), machine.step_overhead, events)
