"""The ledger's prepare terms: what a rank holds at the worst point of building and preparing the model, before the
first step (see fxshard/budget/step_ledger.py).

Prepare leaves each parameter in its stage's layout: the ledger's resident ``master`` and ``compute copy`` terms
(stage 3: the shards alone). On the way there a rank also holds, at worst:

- born on the meta device: one unit's full parameters, materialised and initialised whole before each rank keeps
  its rows (``fxshard.runtime.materialise``): the largest unit, ``U`` elements;
- built whole: the whole model, ``Ψ`` elements, as the user built it before prepare. The full parameters a stage
  keeps in the master's dtype (stage 0's) are the built ones, counted once; a stage-1 or stage-2 full copy is counted
  beside them, which is exact under mixed precision (the copy is cast) and an upper bound without.

Both are in the dtype the model was built in, the master's. Buffers and the allocator's slack are outside it."""

from __future__ import annotations

import dataclasses

import sympy

from .symbols import B_MASTER, U, Term


def prepare_terms(memory: list[Term], units: dict[str, int], counts: list[sympy.Symbol],
                  values: dict[sympy.Symbol, int]) -> list[Term]:
    """The prepare terms from the step's resident ``memory`` terms, the units prepare materialised (``{}``: the
    model came built whole) and every parameter's element count; records ``U``'s value in ``values``."""
    kept = [t for t in memory if t.item in ("master", "compute copy")]
    if not units:
        built = Term("prepare", "model built whole", sympy.Add(*counts), B_MASTER, "the model as built before prepare")
        kept = [t for t in kept if t.item != "master" or t.elements.has(sympy.ceiling)]  # shards and copies are new
        return _kept(kept) + [built]
    largest = max(units, key=units.get)
    values[U] = units[largest]
    return _kept(kept) + [Term("prepare", "largest unit", U, B_MASTER,
                               f"unit {largest or '(the root module)'}, materialised whole, one unit at a time")]


def _kept(terms: list[Term]) -> list[Term]:
    return [dataclasses.replace(t, section="prepare", item="parameters kept") for t in terms]
