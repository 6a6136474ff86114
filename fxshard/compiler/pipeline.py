"""The pass pipeline: run passes in order over one graph, keeping each pass's before/after graph (rebuilt when
read)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from collections.abc import Sequence

from torch import fx

from fxshard.passes import PassContext
from fxshard.passes.trial import Pass, copied_graph, copied_module, module_over
from fxshard.report.trace import trace_pass, tracing_passes

from .segments import SegmentPlan


class _Replay:
    """The graphs around each pass of one pipeline run, rebuilt when first read: the passes run again, one at a time,
    on a copy of the input graph. A pass is a function of its graph and its context alone (docs/writing-passes.md),
    so this gives the graphs the run made; a history costs one copy of the input until someone reads it."""

    def __init__(self, gm: fx.GraphModule, ctx: PassContext, passes: Sequence[Pass]):
        # the input's module is built when first read: building one generates and compiles its Python code
        self._input = gm, copied_graph(gm), dict(gm.meta)
        self._ctx, self._passes = ctx, list(passes)
        self._graphs: list[fx.GraphModule] = []

    def graph(self, index: int) -> fx.GraphModule:
        """The graph after pass number ``index`` (0: the input)."""
        if not self._graphs:
            self._graphs.append(module_over(*self._input))
        while len(self._graphs) <= index:
            self._graphs.append(self._passes[len(self._graphs) - 1](copied_module(self._graphs[-1]), self._ctx))
        return self._graphs[index]


@dataclasses.dataclass
class PassRecord:
    """One pass over a graph: its name, and copies of the graph before and after it (``before``, ``after``), made
    when first read."""

    name: str
    _replay: _Replay
    _index: int  # the pass's place in the pipeline, from 1

    @property
    def before(self) -> fx.GraphModule:
        return self._replay.graph(self._index - 1)

    @property
    def after(self) -> fx.GraphModule:
        return self._replay.graph(self._index)


HISTORY = "pass history"  # the phase that copies the input graph, to rebuild each pass's graphs from (``PassRecord``)


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

    def timing(self, phase: str):
        """Add the seconds the block takes to ``phase``."""
        return _timed(lambda seconds: self.seconds.update({phase: seconds}))

    def timing_compiler(self):
        """Add the seconds the block takes to ``compiler_seconds``."""
        return _timed(lambda seconds: setattr(self, "compiler_seconds", self.compiler_seconds + seconds))


@contextlib.contextmanager
def _timed(add):
    start = time.perf_counter()
    try:
        yield
    finally:
        add(time.perf_counter() - start)


def run_passes(gm: fx.GraphModule, ctx: PassContext, passes: Sequence[Pass], record: GraphRecord,
               result: fx.GraphModule | None = None) -> fx.GraphModule:
    """Run ``passes`` over ``gm`` in order, recording each pass in ``record`` (its graphs rebuilt when read) and in
    torch's logs (``fxshard.report.trace``). ``result``: what these passes make of ``gm`` under ``ctx``, made
    already (the candidate ``fxshard.simulate.autotune`` chose): kept as the final graph, the passes not run again."""
    trace_pass(record.kind, record.graph_id, 0, "input", gm)
    with record.timing(HISTORY):
        replay = _Replay(gm, ctx, passes)
    names = [getattr(pass_fn, "__name__", repr(pass_fn)) for pass_fn in passes]
    record.passes = [PassRecord(name, replay, index) for index, name in enumerate(names, start=1)]
    if result is not None:
        if tracing_passes():
            for index, name in enumerate(names, start=1):
                trace_pass(record.kind, record.graph_id, index, name, replay.graph(index))
        record.final = result
        return result
    for index, (name, pass_fn) in enumerate(zip(names, passes), start=1):
        with record.timing(name):
            gm = pass_fn(gm, ctx)
        trace_pass(record.kind, record.graph_id, index, name, gm)
    record.final = gm
    return gm
