"""A simulated step (``fxshard.simulate``) as a Chrome trace-event JSON, to open in Perfetto (ui.perfetto.dev) or
chrome://tracing beside the measured step's profiler trace.

One process ("fxshard simulate", pid 0) with two threads, the simulator's streams: ``compute`` (tid 1: every node
of the graphs in order, then the step's overhead) and ``communication`` (tid 2: the collectives as the
communication stream runs them). Each node is a complete event (``"ph": "X"``) named after its node, with the graph,
the unit (the collective's unit, or the module the node was traced in) and the stream in ``args``; ``cat`` is the
graph, so Perfetto can filter one graph. Times are microseconds from the step's start.
"""

from __future__ import annotations

import json
import os
import pathlib

PID = 0
LANES = {"compute": 1, "comm": 2}
LANE_NAMES = {"compute": "compute", "comm": "communication"}


def chrome_trace(timeline) -> dict:
    """The trace-event JSON object of a ``fxshard.simulate.Timeline``."""
    metadata = [{"name": "process_name", "ph": "M", "pid": PID, "tid": 0, "args": {"name": "fxshard simulate"}}]
    metadata += [{"name": "thread_name", "ph": "M", "pid": PID, "tid": tid, "args": {"name": LANE_NAMES[stream]}}
                 for stream, tid in LANES.items()]
    events = [{
        "name": event.node,
        "cat": event.graph,
        "ph": "X",
        "ts": event.start * 1e6,
        "dur": (event.end - event.start) * 1e6,
        "pid": PID,
        "tid": LANES[event.stream],
        "args": {"graph": event.graph, "unit": event.unit, "stream": LANE_NAMES[event.stream]},
    } for event in timeline.events]
    return {
        "traceEvents": metadata + events,
        "displayTimeUnit": "ms",
        "otherData": {"world": timeline.world, "step_ms": timeline.step_time * 1e3,
                      "exposed_comm_ms": timeline.exposed_comm * 1e3},
    }


def write_chrome_trace(timeline, path: str | os.PathLike) -> pathlib.Path:
    """Write :func:`chrome_trace` of ``timeline`` to ``path`` (JSON); returns the path."""
    path = pathlib.Path(path)
    path.write_text(json.dumps(chrome_trace(timeline)))
    return path
