"""Readable summaries of what the passes did: the collectives of each rewritten graph (``collective_report``) and
the step's ledger beside what a run measured (``ledger_report``), as tabulate tables or JSON."""

from __future__ import annotations

import collections
import json

import sympy
from tabulate import tabulate

from fxshard import budget
from fxshard.budget.communication_options import option_rows
from fxshard.budget.formula import SumNames, describe
from fxshard.errors import FxShardError
from fxshard.runtime.collectives import COLLECTIVE_ROLES

FORMATS = ("text", "json")
REPORT_WIDTH = 120  # characters a line of the text report takes at most, where its columns allow


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


def compile_time_report(records) -> str:
    """fxshard's own share of compile time, by phase (each pass, the pass history, autotune trials, the consistency
    check) summed over the rewritten graphs, largest first; then what Inductor took over each final graph and how it
    compiled it (whole, or a segment at a time); "" before any graph."""
    seconds = collections.Counter()
    for record in records:
        seconds.update(record.seconds)
    if not seconds:
        return ""
    graphs = sum(1 for record in records if record.seconds)
    rows = [(phase, f"{value:.3f}") for phase, value in seconds.most_common()]
    text = (f"fxshard's compile time: {sum(seconds.values()):.2f} s over {graphs} graphs (Dynamo, AOT autograd and "
            "the compiler not included)\n" + tabulate(rows, headers=["phase", "seconds"]))
    compiled = [record for record in records if record.compiled_as is not None]
    if compiled:
        text += "\n" + "\n".join(f"Inductor, graph {r.graph_id} {r.kind}: {r.compiler_seconds:.2f} s, "
                                  f"{r.compiled_as.describe()}" for r in compiled)
    return text


def _per_step(measured) -> dict[str, int] | None:
    """Collective input bytes of one step by kind, from a ``CollectiveCounter`` (its last marked step if it has
    any, else everything it recorded) or from a ``totals()`` dict of one step."""
    if measured is None:
        return None
    if hasattr(measured, "totals"):
        totals = measured.totals(step=-1) if getattr(measured, "steps", 0) else measured.totals()
    else:
        totals = measured
    return {kind: totals.get(kind, {}).get("bytes", 0) for kind in COLLECTIVE_ROLES}


def ledger_rows(ledger: budget.Ledger, measured=None, sums: SumNames | None = None) -> list[dict]:
    """The ledger as rows: what, the closed form (N divides every parameter: ``expression`` per parameter,
    ``readable`` with the sums named by ``sums``), bytes at this run, measured bytes."""
    per_step = _per_step(measured)
    sums = sums or SumNames(list(ledger.params))
    rows = []

    def add(section, what, expr, measured_value=None):
        closed = ledger.closed_form(expr)
        rows.append({"section": section, "what": what, "expression": str(sympy.factor(closed) if "ring" in what
                                                                          else closed),
                     "readable": str(sums.readable(closed)),
                     "exact": str(sympy.sympify(expr)) if len(str(expr)) < 200 else "(see terms)",
                     "bytes": ledger.at(expr), "measured": measured_value})

    memory_items = list(dict.fromkeys(t.item for t in ledger.select("memory")))
    for item in memory_items:
        add("memory", item, sympy.Add(*(t.bytes for t in ledger.select("memory", item))))
    add("memory", "resident total", ledger.resident())
    add("memory", "mixed-precision accounting", ledger.mixed_precision())
    add("memory", f"peak ({ledger.peak_at()})", ledger.peak())
    if ledger.select("prepare"):
        born = "born on meta" if ledger.select("prepare", "largest unit") else "built whole"
        add("memory", f"prepare peak ({born})", ledger.prepare_peak())
    saved = ledger.select("saved")
    if saved:
        add("memory", "saved activations", sympy.Add(*(t.bytes for t in saved)))
    for kind in COLLECTIVE_ROLES:
        groups = ledger.groups(kind)
        for ranks in groups:
            # a counter sees collectives, not their groups: its bytes go where one group runs this kind
            value = None if per_step is None or len(groups) > 1 else per_step[kind]
            what = {budget.R: f"{kind} over replicas", budget.T: f"{kind} over tp",
                    budget.K: f"{kind} from secondary shards"}.get(ranks, kind)
            add("per step", f"{what} input ({ledger.calls(kind, ranks)} calls)", ledger.communicated(kind, ranks=ranks),
                value)
            add("per step", f"{what} sent (ring)", ledger.communicated(kind, moved=True, ranks=ranks))
    return rows


def ledger_report(ledger: budget.Ledger, *, format: str = "text", measured=None, title: str = "") -> str:
    """The ledger as a table of memory and one of the bytes per step (``format="text"``) or JSON: each line's
    closed form, its value at this run's sizes, the measured value where ``measured`` (a ``CollectiveCounter``: its
    last marked step, or a ``totals()`` dict of one step) gives one, then the per-layer collective schedule in graph
    order. The text fits in ``REPORT_WIDTH`` characters a line where its columns allow (a schedule row's parameters
    wrap)."""
    if format not in FORMATS:
        raise FxShardError(f"format must be one of {FORMATS}, got {format!r}")
    sums = SumNames(list(ledger.params))
    rows = ledger_rows(ledger, measured, sums)
    sizes = {str(k): v for k, v in ledger.values.items() if not str(k).startswith("ψ[")}
    if format == "json":
        return json.dumps({"title": title, "sizes": sizes, "parameters": {n: ledger.values[s] for n, s in
                                                                          ledger.params.items()},
                           "sums": dict(zip(map(str, sums.definitions.values()), map(sorted, sums.definitions))),
                           "ledger": rows, "options": option_rows(ledger), "schedule": ledger.schedule}, indent=2,
                          default=str)
    parts = [title or "fxshard ledger",
             f"N={ledger.values[budget.N]}, "
             + "".join(f"{g}={ledger.values[g]}, " for g in (budget.R, budget.T, budget.K) if g in ledger.values)
             + f"Ψ={ledger.at(budget.PSI)}, widths "
             + ", ".join(f"{w}={ledger.values[w]}" for w in (*budget.WIDTHS, budget.Q_PARAM, budget.Q_GRAD)
                         if w in ledger.values)]
    # a table per section, a blank line apart: the memory items' long forms and the collectives' long names never
    # share a line
    for index, section in enumerate(dict.fromkeys(r["section"] for r in rows)):
        section_rows = [r for r in rows if r["section"] == section]
        headers = [section, "closed form (N divides every parameter)", "bytes here"]
        cells = [[r["what"], r["readable"], r["bytes"]] for r in section_rows]
        if measured is not None and section == "per step":
            headers.append("measured")
            for cell, r in zip(cells, section_rows):
                cell.append("" if r["measured"] is None else int(r["measured"]))
        parts.append(("\n" if index else "") + tabulate(cells, headers=headers))
    parts.append("ψ[x]: the elements of parameter x, or of all the parameters of module x; Ψ: of the whole model")
    if budget.T in ledger.values:
        parts.append("T: the tensor-parallel ranks; ψ and Ψ count this tp rank's pieces (split parameters: 1/T each)")
    if budget.K in ledger.values:
        parts.append("K: the ranks backward re-gathers each weight over, from the secondary shards (1/K each) forward "
                     "keeps (reshard_after_forward=K)")
    for largest_unit in ledger.select("prepare", "largest unit"):
        parts.append(f"U: the elements of the largest unit prepare materialised whole ({largest_unit.source})")
    parts.extend(sums.legend())
    options = option_rows(ledger)
    if options:
        parts.append("\nwhat a communication option would send per step (a rank, ring; payload, docs/communication.md)")
        parts.append(tabulate([[o["option"], f"{o['sent']:,.0f}", f"{o['of_now']:.2f}x"] for o in options],
                              headers=["option", "bytes sent", "of now"]))
    if ledger.schedule:
        parts.append("\ncollective schedule (graph order)")
        every = list(ledger.params)
        parts.append(_within_width([(s["graph"], s["collective"], s["unit"], describe(s["params"], every), s["bytes"])
                                    for s in ledger.schedule],
                                   headers=["graph", "collective", "unit", "parameters", "bytes in"], wrapped=3))
    return "\n".join(parts)


def _within_width(rows: list, headers: list[str], wrapped: int) -> str:
    """``tabulate(rows, headers)``, with the cells of column ``wrapped`` broken onto more lines (at spaces) where
    the table would be wider than ``REPORT_WIDTH``."""
    table = tabulate(rows, headers=headers)
    excess = max(map(len, table.splitlines())) - REPORT_WIDTH
    if excess <= 0:
        return table
    widest = max(len(str(row[wrapped])) for row in rows)
    widths = [None] * len(headers)
    widths[wrapped] = max(widest - excess, len(headers[wrapped]))
    return tabulate(rows, headers=headers, maxcolwidths=widths)
