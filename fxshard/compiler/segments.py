"""A rewritten graph compiled a segment at a time, each distinct segment once (regional compilation).

A model that repeats one block 48 times gives the passes one forward and one backward graph holding 48 copies of
the block's compute, each between its gather, its wait and its reduce-scatter; Inductor's time grows with the nodes
it lowers, so it would compile the block 48 times. Here the final graph is cut at every collective and every wait:
the compute between two of them is a *segment*. Segments that apply the same ops to inputs of the same shapes,
strides and dtypes (a block's forward, its backward: the passes schedule every middle block alike) are compiled
once, and the one compiled function runs for each of them. The collectives and waits run between the segments, in
the graph's order, as the compiled whole graph runs them; the values between steps are dropped after their last
reader, and each segment takes its inputs boxed, so Inductor frees them inside it as in a whole graph.

Where too little repeats (``MOST_DISTINCT``), or a graph's shapes are symbolic (``dynamic=True``: a segment's sizes
would depend on symbols only the whole graph binds), the graph is compiled whole; ``SegmentPlan.whole_because`` says
why.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable

import torch
from torch import fx

from fxshard.passes.fx_utils import value_layout
from fxshard.runtime.collectives import WAIT, is_any_collective
from fxshard.torch_compat import taking_boxed_inputs, tree_map

# A graph is cut only where at least three quarters of its segments reuse another's compile: each cut costs the
# fusion Inductor would make across it. Measured on the benchmark GPT (2 gloo ranks): width 256, 8 blocks (7 and 15
# distinct of 19 and 36 segments) a step 5% slower, 4 blocks 6%, for a few seconds of compile saved; 24 blocks (7
# and 15 of 51 and 100) the step unchanged at widths 64 and 256, the first step 1.4-2x faster; 48 blocks alike.
MOST_DISTINCT = 0.25

CompileSegment = Callable[[fx.GraphModule, list], Callable]  # (segment module, example inputs) -> boxed callable


def runs_between_segments(node: fx.Node) -> bool:
    """Whether ``node`` runs eagerly between segments: a collective, a wait, or an element of a collective's
    tuple (a coalesced collective)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return runs_between_segments(node.args[0])
    return node.target is WAIT or is_any_collective(node.target)


@dataclasses.dataclass
class Segment:
    """Consecutive compute nodes of the graph (with the ``getitem``s of their tuples, wherever those stand), the
    values they read from before (``inputs``) and those read after them (``outputs``)."""

    nodes: list[fx.Node]
    inputs: list[fx.Node] = dataclasses.field(default_factory=list)
    outputs: list[fx.Node] = dataclasses.field(default_factory=list)
    key: tuple = ()


Step = Segment | fx.Node  # a segment, or one node that runs between segments


def split_at_collectives(graph: fx.Graph) -> list[Step]:
    """The graph's call nodes as steps in graph order: each collective and wait alone, and the compute between
    them as segments with their inputs, outputs and keys filled in."""
    steps: list[Step] = []
    segment_of: dict[fx.Node, Segment] = {}
    current: Segment | None = None
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if runs_between_segments(node):
            steps.append(node)
            current = None
            continue
        source = node.args[0] if node.target is operator.getitem else None
        if isinstance(source, fx.Node) and source in segment_of:  # a tuple's element stays with the tuple
            owner = segment_of[source]
        else:
            if current is None:
                current = Segment([])
                steps.append(current)
            owner = current
        owner.nodes.append(node)
        segment_of[node] = owner
    for segment in (s for s in steps if isinstance(s, Segment)):
        inside = set(segment.nodes)
        segment.inputs = list(dict.fromkeys(i for n in segment.nodes for i in n.all_input_nodes if i not in inside))
        segment.outputs = [n for n in segment.nodes if any(user not in inside for user in n.users)]
        segment.key = segment_key(segment)
    return steps


class _Ref:
    """A value a segment's node reads, by its place in the segment (an input or an earlier node)."""

    def __init__(self, place: str):
        self.place = place

    def __repr__(self) -> str:
        return self.place


def segment_key(segment: Segment) -> tuple:
    """What two segments share when one compiled function computes both: each node's op and arguments by place,
    the inputs' shapes, strides, dtypes and devices, and which nodes are outputs."""
    places = {node: _Ref(f"in{i}") for i, node in enumerate(segment.inputs)}
    places.update({node: _Ref(f"n{i}") for i, node in enumerate(segment.nodes)})
    ops = tuple((str(node.target), repr(fx.node.map_arg((node.args, node.kwargs), places.__getitem__)))
                for node in segment.nodes)
    inputs = tuple(value_layout(node.meta.get("val")) for node in segment.inputs)
    return ops, inputs, tuple(repr(places[node]) for node in segment.outputs)


def segment_module(root: fx.GraphModule, segment: Segment) -> fx.GraphModule:
    """``segment`` as a graph of its own: its inputs as placeholders, its outputs returned as a tuple."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in segment.inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta["val"] = node.meta["val"]
    for node in segment.nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[node] for node in segment.outputs))
    return fx.GraphModule(root, graph)


@dataclasses.dataclass
class SegmentPlan:
    """How one graph is compiled: ``steps`` (segments and the nodes between them), or the graph whole with the
    reason in ``whole_because``."""

    steps: list[Step]
    whole_because: str = ""

    @property
    def segments(self) -> list[Segment]:
        return [step for step in self.steps if isinstance(step, Segment)]

    def describe(self) -> str:
        """One line for the report."""
        if self.whole_because:
            return f"compiled whole ({self.whole_because})"
        return (f"compiled in {len(self.segments)} segments between its collectives, {self.distinct} distinct "
                f"(each compiled once)")

    @property
    def distinct(self) -> int:
        """How many segments Inductor compiles: one per key."""
        return len({s.key for s in self.segments})


def plan_segments(gm: fx.GraphModule) -> SegmentPlan:
    """Whether and how to compile ``gm`` a segment at a time."""
    if any(node.op == "get_attr" for node in gm.graph.nodes):
        return SegmentPlan([], "it reads constants of its module")
    values = [node.meta.get("val") for node in gm.graph.nodes if node.op != "output"]
    if any(value is None for value in values):
        return SegmentPlan([], "a node has no example value")
    if any(_is_symbolic(value) for value in values):
        return SegmentPlan([], "its shapes are symbolic")
    steps = split_at_collectives(gm.graph)
    segments = [step for step in steps if isinstance(step, Segment)]
    distinct = len({s.key for s in segments})
    if distinct > len(segments) * MOST_DISTINCT:
        return SegmentPlan([], f"{distinct} of the {len(segments)} segments between its collectives differ: too few "
                               "repeat to pay for the cuts")
    if any(not isinstance(node.meta["val"], torch.Tensor) for s in segments for node in s.inputs):
        return SegmentPlan([], "a segment reads a value that is not a tensor")
    return SegmentPlan(steps)


def _is_symbolic(value) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_is_symbolic(v) for v in value)
    if isinstance(value, torch.Tensor):
        return any(isinstance(s, torch.SymInt) for s in (*value.shape, *value.stride(), value.storage_offset()))
    return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))


class _Slot:
    """An eager step's argument: the value at ``index`` of the values the step reads."""

    def __init__(self, index: int):
        self.index = index


def _filled(structure, values: list):
    """``structure`` with each ``_Slot`` replaced by the value it names."""
    return tree_map(lambda a: values[a.index] if isinstance(a, _Slot) else a, structure)


def _eager_step(node: fx.Node, reads: list[fx.Node]) -> Callable[[list], tuple]:
    """``node`` run eagerly on the values it reads (in the order of ``reads``)."""
    where = {read: _Slot(i) for i, read in enumerate(reads)}
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), where.__getitem__)
    target = node.target

    def run(values: list) -> tuple:
        return (target(*_filled(args, values), **_filled(kwargs, values)),)

    return run


def segmented_callable(gm: fx.GraphModule, plan: SegmentPlan, compile_segment: CompileSegment) -> Callable:
    """``gm`` run as ``plan`` says, boxed (the argument list is emptied on entry): each distinct segment compiled
    once by ``compile_segment``, the nodes between segments run eagerly, each value dropped after its last reader."""
    nodes = [node for node in gm.graph.nodes if node.op != "output"]
    slot = {node: i for i, node in enumerate(nodes)}
    placeholders = [node for node in nodes if node.op == "placeholder"]
    output = gm.graph.output_node()
    compiled: dict[tuple, Callable] = {}
    program = []  # (function over the values it reads, slots read, slots written)
    for step in plan.steps:
        if isinstance(step, Segment):
            if step.key not in compiled:
                example = [node.meta["val"] for node in step.inputs]
                compiled[step.key] = compile_segment(segment_module(gm, step), example)
            program.append((compiled[step.key], [slot[n] for n in step.inputs], [slot[n] for n in step.outputs]))
        else:
            reads = step.all_input_nodes
            program.append((_eager_step(step, reads), [slot[n] for n in reads], [slot[step]]))
    returned = {slot[n] for n in output.all_input_nodes}
    last_read: dict[int, int] = {}
    for index, (_, reads, _) in enumerate(program):
        last_read.update({s: index for s in reads})
    program = [(fn, reads, writes, [s for s in set(reads) if last_read[s] == index and s not in returned])
               for index, (fn, reads, writes) in enumerate(program)]
    unread = [slot[p] for p in placeholders if slot[p] not in last_read and slot[p] not in returned]
    result = fx.node.map_arg(output.args[0], lambda n: _Slot(slot[n]))
    size = len(nodes)

    def run(args: list):
        values = [None] * size
        values[:len(args)] = args
        args.clear()
        for s in unread:
            values[s] = None
        for fn, reads, writes, frees in program:
            inputs = [values[s] for s in reads]
            for s in frees:
                values[s] = None
            for s, value in zip(writes, fn(inputs)):
                values[s] = value
        return _filled(result, values)

    return taking_boxed_inputs(run)
