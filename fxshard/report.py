"""Readable summaries of what the passes did, built from ``node.meta["fxshard"]`` of the rewritten graphs."""

from __future__ import annotations

import collections

from tabulate import tabulate

COLLECTIVE_ROLES = ("all_gather", "reduce_scatter", "all_reduce")


def collectives(gm) -> list[dict]:
    """One row per collective node of a rewritten graph: kind, unit, parameters and bytes of the buffer."""
    rows = []
    for node in gm.graph.nodes:
        meta = node.meta.get("fxshard", {})
        if meta.get("role") in COLLECTIVE_ROLES:
            buffer = node.args[0].meta["val"]
            rows.append(
                {"kind": meta["role"], "unit": meta["unit"], "params": meta["params"],
                 "input_bytes": buffer.numel() * buffer.element_size()}
            )
    return rows


def collective_report(records) -> str:
    """A table per rewritten graph (forward, backward, inference): each collective in graph order."""
    parts = []
    for record in records:
        if record.final is None or record.kind == "joint":
            continue
        rows = collectives(record.final)
        counts = collections.Counter(r["kind"] for r in rows)
        summary = ", ".join(f"{n} {kind}" for kind, n in counts.items()) or "no collectives"
        parts.append(f"graph {record.graph_id} {record.kind}: {summary}")
        if rows:
            parts.append(tabulate(
                [(r["kind"], r["unit"], ", ".join(r["params"]), r["input_bytes"]) for r in rows],
                headers=["collective", "unit", "parameters", "bytes in"],
            ))
    return "\n".join(parts)
