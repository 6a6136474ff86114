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


def born_on_meta_terms(memory: list[Term], largest_unit: str) -> list[Term]:
    """The prepare terms of a model materialised from the meta device, ``largest_unit`` (``U`` elements) the
    largest unit, from the step's resident ``memory`` terms."""
    return _kept(memory) + [Term("prepare", "largest unit", U, B_MASTER, f"unit {largest_unit or '(the root module)'}")]


def built_whole_terms(memory: list[Term], counts: list[sympy.Symbol]) -> list[Term]:
    """The prepare terms of a model that came to prepare built whole (``counts``: every parameter's elements),
    from the step's resident ``memory`` terms."""
    new = [t for t in memory if t.item != "master" or t.elements.has(sympy.ceiling)]  # shards and copies are new
    return _kept(new) + [Term("prepare", "model built whole", sympy.Add(*counts), B_MASTER,
                              "the model as built before prepare")]


def _kept(memory: list[Term]) -> list[Term]:
    """What prepare leaves: the parameters in their stage's layout."""
    return [dataclasses.replace(t, section="prepare", item="parameters kept")
            for t in memory if t.item in ("master", "compute copy")]
