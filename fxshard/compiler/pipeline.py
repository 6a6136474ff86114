"""The pass pipeline: run passes in order over one graph, keeping each pass's before/after graph."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from collections.abc import Sequence

from torch import fx

from fxshard.passes import PassContext
from fxshard.passes.trial import Pass, copied_graph
from fxshard.report.trace import trace_pass

from .segments import SegmentPlan


class _Snapshot:
    """A copy of a graph as it stood after a pass, made a GraphModule when first read: building one generates and
    compiles its Python code, which costs about as much as the copy, and most snapshots are never read."""

    def __init__(self, gm: fx.GraphModule):
        self._root: fx.GraphModule | None = gm  # where the copy's get_attr targets live
        self._graph = copied_graph(gm)
        self._module: fx.GraphModule | None = None

    def module(self) -> fx.GraphModule:
        if self._module is None:
            self._module, self._root = fx.GraphModule(self._root, self._graph), None
        return self._module


@dataclasses.dataclass
class PassRecord:
    """One pass over a graph: its name, and copies of the graph before and after it (``before``, ``after``)."""

    name: str
    _before: _Snapshot
    _after: _Snapshot

    @property
    def before(self) -> fx.GraphModule:
        return self._before.module()

    @property
    def after(self) -> fx.GraphModule:
        return self._after.module()


HISTORY = "pass history"  # the phase that copies the graph after each pass (``PassRecord``)


@dataclasses.dataclass
class GraphRecord:
    """One graph the backend rewrote: its kind, the pass-by-pass history, the final graph, and the seconds fxshard
    spent on it by phase (each pass by name, ``HISTORY``, and what the backend adds: autotune trials, the
    consistency check)."""

    kind: str
    graph_id: int
    passes: list[PassRecord] = dataclasses.field(default_factory=list)
    final: fx.GraphModule | None = None
    seconds: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    compiled_as: SegmentPlan | None = None  # how Inductor compiled the final graph (None: the eager compiler)
    compiler_seconds: float = 0.0  # what the compiler (Inductor) took over the final graph

    @contextlib.contextmanager
    def timing_compiler(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.compiler_seconds += time.perf_counter() - start

    @contextlib.contextmanager
    def timing(self, phase: str):
        """Add the seconds the block takes to ``phase``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start


def run_passes(gm: fx.GraphModule, ctx: PassContext, passes: Sequence[Pass], record: GraphRecord) -> fx.GraphModule:
    """Run ``passes`` over ``gm`` in order, recording each pass's graphs in ``record`` and in torch's logs
    (``fxshard.report.trace``)."""
    trace_pass(record.kind, record.graph_id, 0, "input", gm)
    with record.timing(HISTORY):
        before = _Snapshot(gm)
    for index, pass_fn in enumerate(passes, start=1):
        name = getattr(pass_fn, "__name__", repr(pass_fn))
        with record.timing(name):
            gm = pass_fn(gm, ctx)
        with record.timing(HISTORY):
            after = _Snapshot(gm)
        record.passes.append(PassRecord(name, before, after))  # one pass's after is the next one's before
        before = after
        trace_pass(record.kind, record.graph_id, index, name, gm)
    record.final = gm
    return gm
