"""What the passes did, in torch's own tools: ``TORCH_LOGS="fxshard"`` and ``TORCH_TRACE`` (tlparse).

For every graph the backend rewrites (joint, forward, backward, inference, optimizer) and every pass of its
pipeline, ``trace_pass`` writes

- to torch's structured trace (``TORCH_TRACE=/tmp/trace``, then ``tlparse /tmp/trace/*.log``), beside Dynamo's and
  AOT autograd's graphs of the same compile: the artifact ``fxshard_<kind>_<n>_<pass>`` (the graph's code after
  the pass; ``n`` counts from 0, the graph as the pipeline received it being ``input``) and
  ``fxshard_<kind>_<n>_<pass>_decisions`` (JSON: every node's ``meta["fxshard"]`` record: role, unit, bucket,
  parameters, schedule moves);
- to the logger ``fxshard`` (registered with torch's logging like its own, so ``TORCH_LOGS="fxshard"`` shows it):
  at INFO a line per pass counting what the graph holds by role and unit, at DEBUG (``TORCH_LOGS="+fxshard"``)
  the graph's code too.

Where ``fxshard.simulate.autotune`` chose a graph's knobs, ``trace_choice`` adds the artifact ``fxshard_<kind>_choice`` (JSON:
every candidate's knobs, predicted time and bytes, and the one chosen) and an INFO line.

Nothing is computed unless a trace handler or the log level asks for it.
"""

from __future__ import annotations

import collections
import json
import logging

from torch import fx

from fxshard.torch_compat import register_log, trace_log, trace_structured

register_log("fxshard", ["fxshard"])
log = logging.getLogger("fxshard")


def decisions(gm: fx.GraphModule) -> dict[str, dict]:
    """Every node's ``meta["fxshard"]`` record, by node name, as JSON values (the pure part of a trace)."""
    return {node.name: json.loads(json.dumps(node.meta["fxshard"], default=str))
            for node in gm.graph.nodes if node.meta.get("fxshard")}


def summary(records: dict[str, dict]) -> str:
    """``15 all_gather, ..., 15 wait; 16 units`` of a graph's decisions (roles in alphabetical order)."""
    roles = collections.Counter(r["role"] for r in records.values() if "role" in r)
    units = {r["unit"] for r in records.values() if r.get("unit")}
    counted = ", ".join(f"{roles[role]} {role}" for role in sorted(roles)) or "no fxshard nodes"
    return f"{counted}; {len(units)} units" if units else counted


def _code(gm: fx.GraphModule) -> str:
    return gm.print_readable(print_output=False, include_stride=True, include_device=True)


def tracing_passes() -> bool:
    """Whether ``trace_pass`` records anything (``TORCH_TRACE`` or ``TORCH_LOGS="fxshard"``)."""
    return bool(trace_log.handlers) or log.isEnabledFor(logging.INFO)


def trace_pass(kind: str, graph_id: int, index: int, pass_name: str, gm: fx.GraphModule) -> None:
    """Record ``gm`` as it stands after pass number ``index`` (``pass_name``) of graph ``graph_id`` of ``kind``."""
    if not tracing_passes():
        return
    tracing, logging_info = bool(trace_log.handlers), log.isEnabledFor(logging.INFO)
    records = decisions(gm)
    name = f"fxshard_{kind}_{index}_{pass_name}"
    if tracing:
        trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": "string"},
                         payload_fn=lambda: _code(gm))
        trace_structured("artifact", metadata_fn=lambda: {"name": f"{name}_decisions", "encoding": "json"},
                         payload_fn=lambda: records)
    if logging_info:
        log.info("graph %d %s, after %s: %s", graph_id, kind, pass_name, summary(records))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("graph %d %s, after %s:\n%s", graph_id, kind, pass_name, _code(gm))


def trace_choice(kind: str, graph_id: int, choice: dict) -> None:
    """Record the knobs ``fxshard.simulate.autotune`` chose for graph ``graph_id`` of ``kind``, with every candidate."""
    tracing, logging_info = bool(trace_log.handlers), log.isEnabledFor(logging.INFO)
    if tracing:
        trace_structured("artifact", metadata_fn=lambda: {"name": f"fxshard_{kind}_choice", "encoding": "json"},
                         payload_fn=lambda: json.loads(json.dumps(choice, default=str)))
    if logging_info:
        chosen = choice["candidates"][choice["chosen"]]
        log.info("graph %d %s: chose %s (%.2f ms predicted, %d bytes) of %d candidates", graph_id, kind,
                 chosen["knobs"], chosen["predicted_s"] * 1e3, chosen["bytes"], len(choice["candidates"]))
