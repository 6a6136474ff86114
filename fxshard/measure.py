"""Measure what a step communicates: every ``_c10d_functional`` collective that runs, by kind and size.

    with CollectiveCounter() as counter:
        loss = model(batch); loss.backward(); opt.step()
    counter.totals()  # {"all_gather": {"calls": 16, "elements": ..., "bytes": ...}, ...}

It reads torch's profiler, so it sees collectives wherever they run (compiled graphs, the marker ops' eager
implementations, the optimizer's step hooks) without disturbing torch.compile, which refuses to run compiled code
under a Python dispatch mode. Sizes are what each rank contributes: the all-gather input, the reduce-scatter and
all-reduce inputs.
"""

from __future__ import annotations

import collections
import dataclasses
import math

from torch.profiler import ProfilerActivity, profile

_KINDS = {
    "_c10d_functional::all_gather_into_tensor": "all_gather",
    "_c10d_functional::reduce_scatter_tensor": "reduce_scatter",
    "_c10d_functional::all_reduce": "all_reduce",
}
_ITEM_BYTES = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4}


@dataclasses.dataclass
class CollectiveRecord:
    kind: str
    elements: int
    bytes: int


class CollectiveCounter:
    """A context manager that records each collective run inside it, in order (``records``), and sums them."""

    def __init__(self):
        self.records: list[CollectiveRecord] = []
        self._profile = profile(activities=[ProfilerActivity.CPU], record_shapes=True)

    def __enter__(self) -> "CollectiveCounter":
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profile.__exit__(*exc)
        for event in sorted(self._profile.events(), key=lambda e: e.time_range.start):
            kind = _KINDS.get(event.name)
            if kind is not None:
                elements = math.prod(event.input_shapes[0])
                self.records.append(CollectiveRecord(kind, elements, elements * _ITEM_BYTES[event.input_dtypes[0]]))

    def totals(self) -> dict[str, dict[str, int]]:
        sums: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for record in self.records:
            sums[record.kind].update(calls=1, elements=record.elements, bytes=record.bytes)
        return {kind: dict(counter) for kind, counter in sums.items()}
