"""Measure what a step communicates: every ``_c10d_functional`` collective that runs, by kind and size.

    with CollectiveCounter() as counter:
        loss = model(batch); loss.backward(); opt.step()
    counter.totals()  # {"all_gather": {"calls": 16, "elements": ..., "bytes": ...}, ...}

It reads torch's profiler, so it sees collectives wherever they run (compiled graphs, the marker ops' eager
implementations, the optimizer's step hooks) without disturbing torch.compile, which refuses to run compiled code
under a Python dispatch mode. Sizes are what each rank contributes: the all-gather input, the reduce-scatter and
all-reduce inputs, in any dtype (the packed int8 / fp8 / bf16 buffers of the wire options too). Kinds are the
ledger's (``fxshard.runtime.collectives``): an all-to-all is counted as the reduce-scatter fxshard makes of it.

A script that runs several steps inside one counter calls ``counter.mark_step()`` after each (``python -m fxshard
report`` does it from an optimizer step hook); ``totals(step=-1)`` then sums one step alone. The first step of a
compiled model is not a fair sample: compiling traces the graphs on fake tensors, and the profiler records those
collective calls as if they ran.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from fxshard.errors import FxShardError
from fxshard.runtime.collectives import profiled_collective
from fxshard.torch_compat import profiled_item_size, profiled_ops

_STEP_MARK = "fxshard::step_end"


@dataclasses.dataclass
class CollectiveRecord:
    kind: str
    elements: int
    bytes: int
    step: int  # how many ``mark_step`` calls came before it


class CollectiveCounter:
    """A context manager that records each collective run inside it, in order (``records``), and sums them."""

    def __init__(self):
        self.records: list[CollectiveRecord] = []
        self.steps = 0  # completed steps: ``mark_step`` calls
        self._profile = profile(activities=[ProfilerActivity.CPU], record_shapes=True)

    def __enter__(self) -> "CollectiveCounter":
        self._profile.__enter__()
        return self

    @torch.compiler.disable  # a hook inside a compiled optimizer.step: a traced record_function would be dropped
    def mark_step(self) -> None:
        """End a step: the collectives recorded from here on belong to the next one."""
        with record_function(_STEP_MARK):
            self.steps += 1

    def __exit__(self, *exc) -> None:
        self._profile.__exit__(*exc)
        step = 0
        for op in profiled_ops(self._profile):
            if op.name == _STEP_MARK:
                step += 1
            elif (collective := profiled_collective(op.name)) is not None:
                elements = math.prod(op.input_shapes[0])
                item_size = profiled_item_size(op.input_dtypes[0])
                if item_size is None:
                    raise FxShardError(f"{op.name} ran on a tensor of type {op.input_dtypes[0]!r}, whose size "
                                       "CollectiveCounter does not know: add it to _PROFILED_ITEM_SIZES in "
                                       "fxshard/torch_compat.py")
                self.records.append(CollectiveRecord(collective.role, elements, elements * item_size, step))

    def totals(self, step: int | None = None) -> dict[str, dict[str, int]]:
        """Calls, elements and bytes by kind: of every record, or of one step (``-1``: the last completed one)."""
        if step is not None:
            if not self.steps:
                raise FxShardError("totals(step=...) needs steps: call counter.mark_step() after each step")
            if not -self.steps <= step < self.steps:
                raise FxShardError(f"step {step} was not recorded: the counter saw {self.steps} completed steps")
            step %= self.steps
        sums: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for record in self.records:
            if step is None or record.step == step:
                sums[record.kind].update(calls=1, elements=record.elements, bytes=record.bytes)
        return {kind: dict(counter) for kind, counter in sums.items()}
