"""The ledger's algebra: the symbols (ranks, element counts, byte widths), one ``Term`` per line of the ledger,
the ``Ledger`` that sums and evaluates them, and the closed forms a person reads. Nothing here reads a graph;
fxshard/budget/step_ledger.py explains where each term comes from."""

from __future__ import annotations

import dataclasses

import sympy

from fxshard.errors import FxShardError

N = sympy.Symbol("N", positive=True, integer=True)
R = sympy.Symbol("R", positive=True, integer=True)
T = sympy.Symbol("T", positive=True, integer=True)  # the tensor-parallel degree: the ranks DTensor's collectives span
K = sympy.Symbol("K", positive=True, integer=True)  # reshard_after_forward=k: the ranks backward re-gathers over
PSI = sympy.Symbol("Ψ", positive=True)
U = sympy.Symbol("U", positive=True, integer=True)  # the elements of the largest unit prepare materialises at once
B_PARAM, B_GRAD, B_MASTER, B_STATE = (sympy.Symbol(n, positive=True)
                                      for n in ("b_param", "b_grad", "b_master", "b_state"))
WIDTHS = (B_PARAM, B_GRAD, B_MASTER, B_STATE)
# quantize_weights / quantize_grads: the bytes per element of a packed buffer on the wire (1: int8, fp8; 2: bf16)
Q_PARAM, Q_GRAD = sympy.Symbol("q_param", positive=True), sympy.Symbol("q_grad", positive=True)
# The ZeRO paper's mixed-precision Adam accounting: 2-byte parameters and gradients, fp32 master copy and moments.
ZERO_PAPER_WIDTHS = {B_PARAM: 2, B_GRAD: 2, B_MASTER: 4, B_STATE: 4}


def psi(name: str) -> sympy.Symbol:
    """The element count of one trainable parameter."""
    return sympy.Symbol(f"ψ[{name}]", positive=True, integer=True)


def shard(elements: sympy.Expr, row: int = 1) -> sympy.Expr:
    """Elements of one rank's flat padded shard of a parameter of ``elements`` in rows of ``row`` elements (shards
    are whole rows: ``fxshard/runtime/sharding.py``)."""
    return row * sympy.ceiling(elements / (row * N))


def ring_factor(kind: str, ranks: sympy.Expr = N) -> sympy.Expr:
    """Bytes a rank sends in a ring collective over ``ranks`` per byte of its input buffer (what
    ``CollectiveCounter`` counts)."""
    return {"all_gather": ranks - 1, "reduce_scatter": (ranks - 1) / ranks, "all_reduce": 2 * (ranks - 1) / ranks}[kind]


@dataclasses.dataclass(frozen=True)
class Term:
    """One line of the ledger: ``elements × width`` bytes of one kind, and where in the graphs it comes from."""

    section: str  # "memory" (resident between steps), "peak" (alive at the step's worst point besides the resident
    # state without gradients), "saved" (activations forward saves for backward), "comm" (per step), "prepare"
    # (alive at prepare's worst point)
    item: str  # "master", "gradients", "exp_avg", "activations", "gathered", "all_gather", ...
    elements: sympy.Expr
    width: sympy.Expr
    source: str
    calls: int = 0  # collectives: how many run per step
    unit: str = ""
    ranks: sympy.Expr = N  # collectives: the group they run over (R: across the replicas of a hybrid mesh; T: over
    # the tensor-parallel dimension, DTensor's own collectives; K: backward's re-gathers from secondary shards)

    @property
    def bytes(self) -> sympy.Expr:
        return self.elements * self.width

    @property
    def moved(self) -> sympy.Expr:
        """Collectives: bytes this rank sends per step in a ring algorithm."""
        return self.bytes * ring_factor(self.item, self.ranks)


@dataclasses.dataclass
class Ledger:
    """The step's ledger per rank; expressions in N, ψ[...] and the widths, ``values`` their sizes in this run."""

    terms: list[Term]
    values: dict[sympy.Symbol, int]
    params: dict[str, sympy.Symbol]
    # Where the graph reads the master itself, mixed-precision training would read a compute-dtype copy instead:
    # these terms add that copy (the ZeRO paper's accounting); with one dtype the run has no such copy.
    mixed_precision_copies: list[Term] = dataclasses.field(default_factory=list)
    schedule: list[dict] = dataclasses.field(default_factory=list)

    def select(self, section: str, item: str | None = None) -> list[Term]:
        return [t for t in self.terms if t.section == section and (item is None or t.item == item)]

    def resident(self) -> sympy.Expr:
        """Bytes per rank held between steps: parameters, gradients (after backward), optimizer state."""
        return sympy.Add(*(t.bytes for t in self.select("memory")))

    def peak(self) -> sympy.Expr:
        """Bytes per rank at the step's worst point: the state held between steps (gradients are not: the step
        starts with none) plus every tensor the graphs hold there (saved activations, gathered and reduce buffers,
        gradients produced so far, other intermediates)."""
        between_steps = [t.bytes for t in self.select("memory") if t.item != "gradients"]
        return sympy.Add(*between_steps, *(t.bytes for t in self.select("peak")))

    def prepare_peak(self) -> sympy.Expr:
        """Bytes per rank at the worst point of building and preparing the model: the parameters prepare leaves
        plus the largest unit materialised whole (born on the meta device) or the whole model (built whole)."""
        return sympy.Add(*(t.bytes for t in self.select("prepare")))

    def peak_at(self) -> str:
        """Where the peak is: the graph and node."""
        return next((t.source for t in self.select("peak") if t.item == "peak point"), "")

    def communicated(self, kind: str | None = None, *, moved: bool = False, ranks: sympy.Expr | None = None
                     ) -> sympy.Expr:
        """Bytes per step: handed to collectives (``moved=False``, what ``CollectiveCounter`` counts) or sent in a
        ring (``moved=True``); of one kind, over one group (``ranks``: ``N``, ``R``, ``T`` or ``K``), or all."""
        terms = [t for t in self.select("comm", kind) if ranks is None or t.ranks == ranks]
        return sympy.Add(*((t.moved if moved else t.bytes) for t in terms))

    def calls(self, kind: str, ranks: sympy.Expr | None = None) -> int:
        return sum(t.calls for t in self.select("comm", kind) if ranks is None or t.ranks == ranks)

    def groups(self, kind: str) -> list[sympy.Expr]:
        """The groups (``N``, then ``R`` on a hybrid mesh, ``T`` under tensor parallelism, ``K`` with secondary
        shards) that collectives of ``kind`` run over."""
        return [g for g in (N, R, T, K) if any(t.ranks == g for t in self.select("comm", kind))]

    def mixed_precision(self) -> sympy.Expr:
        """Resident bytes under the ZeRO paper's mixed-precision accounting: the run's terms plus a compute copy
        wherever the graph reads the master."""
        return self.resident() + sympy.Add(*(t.bytes for t in self.mixed_precision_copies))

    def at(self, expr: sympy.Expr, **sizes) -> int | float:
        """``expr`` evaluated at this run's sizes (Ψ is the sum of the ψ), overridden by name: ``N=64``,
        ``b_param=2``, ``Ψ=7.5e9``."""
        values = {**self.values, PSI: sum(self.values.get(c, 0) for c in self.params.values())}
        known = {s.name: s for s in [N, R, T, K, PSI, U, *WIDTHS, *values]}
        for name, value in sizes.items():
            if name not in known:
                raise FxShardError(f"the ledger has no symbol {name!r}; it has {sorted(known)}")
            values[known[name]] = value
        result = sympy.sympify(sympy.sympify(expr).xreplace(values))  # a bare symbol's value is a Python number
        if not result.is_number:
            raise FxShardError(f"cannot evaluate {expr}: no value for {sorted(map(str, result.free_symbols))}")
        return int(result) if result == int(result) else float(result)

    def closed_form(self, expr: sympy.Expr) -> sympy.Expr:
        """``expr`` assuming N divides every parameter (no padding), the per-parameter counts summed into Ψ."""
        return closed_form(expr, list(self.params.values()))


def closed_form(expr: sympy.Expr, counts: list[sympy.Symbol]) -> sympy.Expr:
    """Drop the padding (``ceiling(ψ/N) -> ψ/N``) and write Σψ as Ψ; what depends on one parameter alone stays."""
    expr = sympy.sympify(expr).replace(sympy.ceiling, lambda x: x)
    if counts:
        last = counts[-1]
        expr = expr.subs(last, PSI - sympy.Add(*counts[:-1]))
    return sympy.simplify(sympy.expand(expr))


def sizes_at(expr: sympy.Expr, values: dict) -> int:
    # xreplace: one walk of the tree with a lookup per symbol, where subs tries every key of ``values`` in turn (a
    # ledger has a ψ per parameter: subs made a 110M-parameter GPT's ledger take half a minute)
    return int(sympy.sympify(expr).xreplace(values))
