"""What each communication option would send per step, priced on a ledger of the step as it ran: the compiled
graphs' weight gathers at ``quantize_weights``' wire width, their gradient reductions at ``quantize_grads``', the
blockwise schemes' fp32 scales added (``passes/quantize.py``). A collective already packed, or of another group
(replicas, tp, secondary shards), keeps its bytes."""

from __future__ import annotations

import sympy

from fxshard.passes.quantize import DEFAULT_QUANTIZE_BLOCK

from .symbols import N, Q_GRAD, Q_PARAM, Ledger, Term, ring_factor


def _in_graphs(term: Term, kind: str) -> bool:
    """A collective of ``kind`` over the shard group in the compiled forward or backward."""
    return term.item == kind and term.ranks == N and any(f"{g}: " in term.source for g in ("forward", "backward"))


def _packed(term: Term, scheme: str, block: int) -> sympy.Expr:
    """Bytes a ring sends for ``term`` packed as ``scheme``: values at its wire width, plus blockwise scales."""
    width = sympy.Min(term.width, 2) if scheme == "bf16" else 1 + sympy.Rational(4, block)
    return term.elements * width * ring_factor(term.item, term.ranks)


def sent_with(ledger: Ledger, weights: str | None, grads: str | None, block: int = DEFAULT_QUANTIZE_BLOCK
              ) -> sympy.Expr:
    """Bytes per rank and step a ring sends if the step's gathers were packed as ``weights`` and its reductions as
    ``grads`` (None: as they ran)."""
    total = []
    for term in ledger.select("comm"):
        if weights and term.width != Q_PARAM and _in_graphs(term, "all_gather"):
            total.append(_packed(term, weights, block))
        elif grads and term.width != Q_GRAD and _in_graphs(term, "reduce_scatter"):
            total.append(_packed(term, grads, block))
        else:
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
        sent = ledger.at(sent_with(ledger, weights, grads))
        if sent < now:
            rows.append({"option": name, "sent": sent, "of_now": sent / now})
    return rows
