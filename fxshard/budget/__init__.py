"""``fxshard.budget``: the sympy ledger of memory per rank and bytes communicated per step.

- ``symbols``: the algebra (ranks ``N``, element counts ``Ψ``/``ψ``, byte widths, ``Term``, ``Ledger``);
- ``graph_terms``: the terms read off a rewritten graph; ``optimizer_terms``: the prepared optimizer's terms;
- ``prepare_terms``: the worst point of building and preparing the model;
- ``step_ledger``: a step's ledger put together from them (``ledger(backend)``, ``graph_ledger``);
- ``formula``: closed forms a person can read (sums named, not expanded);
- ``budget_pass``: the pass that records each lowered graph's ledger and enforces ``memory_budget``.

Everything a user needs for a budget is importable from here.
"""

from .budget_pass import budget_pass
from .optimizer_terms import optimizer_bytes
from .step_ledger import graph_ledger, ledger, ledger_of_graphs, step_records
from .symbols import B_GRAD, B_MASTER, B_PARAM, B_STATE, PSI, WIDTHS, ZERO_PAPER_WIDTHS, K, Ledger, N, Q_GRAD, Q_PARAM, R, T, U, psi

__all__ = [
    "B_GRAD", "B_MASTER", "B_PARAM", "B_STATE", "K", "N", "Q_GRAD", "Q_PARAM", "PSI", "R", "T", "U", "WIDTHS", "ZERO_PAPER_WIDTHS", "Ledger",
    "budget_pass", "graph_ledger", "ledger", "ledger_of_graphs", "optimizer_bytes", "psi", "step_records",
]
