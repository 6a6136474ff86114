"""What each communication option would send per step, priced on a ledger of the step as it ran: the compiled
graphs' weight gathers at ``quantize_weights``' wire width, their gradient reductions at ``quantize_grads``', the
blockwise schemes' padding and fp32 scales added, where packing makes a row smaller (``passes/quantize.py``). A
collective already packed, or of another group (replicas, tp, secondary shards), keeps its bytes."""

from __future__ import annotations

import dataclasses
import math

import sympy

from fxshard.passes.quantize import DEFAULT_QUANTIZE_BLOCK, packed_rows_bytes, wire_bytes

from .graph_terms import SCALES
from .symbols import N, Q_GRAD, Q_PARAM, Ledger, Term


def _packable(term: Term, kind: str, wire_width) -> bool:
    """A collective of ``kind`` over the shard group in the compiled forward or backward, not packed already (its
    values at the wire width ``wire_width``, or its scales)."""
    packed = term.width == wire_width or term.source.endswith(SCALES)
    return (term.item == kind and term.ranks == N and not packed
            and any(f"{g}: " in term.source for g in ("forward", "backward")))


def _packed(ledger: Ledger, term: Term, scheme: str, block: int) -> float:
    """Bytes a ring sends for ``term`` packed as ``scheme`` (a gather packs one row, this rank's shards; a reduction
    N rows), where packing makes it smaller (``passes.quantize.packed_rows_bytes``)."""
    elements, width = ledger.at(term.elements), ledger.at(term.width)
    rows = 1 if term.item == "all_gather" else ledger.at(N)
    sent = ledger.at(term.moved)
    packed = packed_rows_bytes(math.ceil(elements / rows), rows, width, scheme, block)
    return sent if packed is None else sent * packed / (elements * width)


def _scheme(term: Term, weights: str | None, grads: str | None) -> str | None:
    """The scheme ``term`` would travel packed as: ``weights`` for a packable gather, ``grads`` for a reduction."""
    if weights and _packable(term, "all_gather", Q_PARAM):
        return weights
    if grads and _packable(term, "reduce_scatter", Q_GRAD):
        return grads
    return None


def sent_with(ledger: Ledger, weights: str | None, grads: str | None, block: int = DEFAULT_QUANTIZE_BLOCK) -> float:
    """Bytes per rank and step a ring sends if the step's gathers were packed as ``weights`` and its reductions as
    ``grads`` (None: as they ran)."""
    total = 0.0
    for term in ledger.select("comm"):
        scheme = _scheme(term, weights, grads)
        total += ledger.at(term.moved) if scheme is None else _packed(ledger, term, scheme, block)
    return total


def sent_form(ledger: Ledger, weights: str | None, grads: str | None, block: int = DEFAULT_QUANTIZE_BLOCK,
              ranks: sympy.Expr | None = None) -> sympy.Expr:
    """``sent_with`` as an expression in the ledger's symbols (Ψ, N, the widths), over one group (``ranks``) or all:
    for a model whose rows span many blocks, where a row's padding to whole blocks is nothing beside it, each
    packable term travels at its scheme's bytes per element (bf16: 2; int8, fp8: 1 + 4 / ``block`` for the scales),
    or at its own width where that is less."""
    total = []
    for term in ledger.select("comm"):
        if ranks is not None and term.ranks != ranks:
            continue
        scheme = _scheme(term, weights, grads)
        if scheme is not None:
            term = dataclasses.replace(term, width=sympy.Min(term.width, sympy.Rational(wire_bytes(block, scheme,
                                                                                                    block), block)))
        total.append(term.moved)
    return sympy.Add(*total)


OPTIONS = {  # name -> (quantize_weights, quantize_grads)
    'quantize_weights="bf16"': ("bf16", None),
    'quantize_weights="int8" (or "fp8")': ("int8", None),
    'quantize_grads="int8"': (None, "int8"),
    'quantize_weights="int8", quantize_grads="int8"': ("int8", "int8"),
}


def option_rows(ledger: Ledger) -> list[dict]:
    """For each option that would change this step's bytes: its name, the bytes a rank would send per step (ring),
    and that as a fraction of what it sends now."""
    now = ledger.at(ledger.communicated(moved=True))
    rows = []
    for name, (weights, grads) in OPTIONS.items():
        sent = sent_with(ledger, weights, grads)
        if sent < now:
            rows.append({"option": name, "sent": sent, "of_now": sent / now})
    return rows
