"""Closed forms a person can read: the ledger's per-parameter sums named instead of expanded.

A ledger expression is linear in the parameters' element counts ``ψ[name]``: after ``Ledger.closed_form`` it is
``c0 + cΨ·Ψ + Σ c_p·ψ[p]`` with coefficients in N and the byte widths. Printed as it is, a GPT's peak lists one
``ψ`` per parameter (hundreds of characters). ``SumNames.readable`` groups the parameters that share a coefficient
and writes each group as one symbol:

- ``ψ[blocks.0.ln2]`` where the group is exactly the parameters of one module (no legend needed);
- ``ψ[name]`` for a group of one parameter;
- ``ψ₁``, ``ψ₂``, ... otherwise, each defined once for the whole report by ``SumNames.legend()`` as a sum over a
  pattern: repeated blocks are factored (``blocks.*`` where every block is in the group) and names that differ in
  one place are braced (``blocks.*.{attn.proj,fc}.bias``).

The value is unchanged: substituting each symbol's definition gives the per-parameter form back (the tests check
it). ``format="json"`` reports keep the per-parameter form beside the readable one.
"""

from __future__ import annotations

import collections

import sympy

from .symbols import PSI, psi

SUBSCRIPTS = str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉")


def _wildcard(name: str) -> str:
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def _braced(pieces: list[str], split) -> list[str]:
    """Pieces that ``split`` cuts into the same (head, tail) around different middles, written ``head{m1,m2}tail``."""
    groups: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    order = []
    for piece in pieces:
        cut = split(piece)
        key = (cut[0], cut[2]) if cut is not None else (piece, "")
        if key not in groups:
            order.append(key)
        groups[key].append(cut[1] if cut is not None else None)
    out = []
    for head, tail in order:
        middles = groups[(head, tail)]
        if len(middles) > 1 and None not in middles:
            parts = [m.split(".") for m in middles]
            shared = []  # components every middle starts with move out of the braces (each keeps one at least)
            for column in zip(*parts):
                if len(set(column)) > 1 or len(shared) + 1 >= min(map(len, parts)):
                    break
                shared.append(column[0])
            inner = [".".join(p[len(shared):]) for p in parts]
            out.append(f"{head}{''.join(c + '.' for c in shared)}{{{','.join(inner)}}}{tail}")
        else:
            out.extend(head + (m or "") + tail if m is not None else head for m in middles)
    return out


def _split_middle(piece: str):
    """``blocks.*.attn.proj.bias`` -> (``blocks.*.``, ``attn.proj``, ``.bias``): what lies between the last
    wildcard (or the start) and the last component."""
    parts = piece.split(".")
    if len(parts) < 2 or "{" in piece:
        return None
    stars = [i for i, part in enumerate(parts[:-1]) if part == "*"]
    start = stars[-1] + 1 if stars else 0
    if start >= len(parts) - 1:
        return None
    head = ".".join(parts[:start]) + ("." if start else "")
    return head, ".".join(parts[start:-1]), "." + parts[-1]


def _split_last(piece: str):
    """``ln_f.weight`` -> (``ln_f.``, ``weight``, ``""``)."""
    if "{" in piece or "." not in piece:
        return None
    head, _, last = piece.rpartition(".")
    return head + ".", last, ""


def _prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _covering(chosen: list[str], every: list[str]) -> list[str]:
    """``chosen`` as the fewest modules and parameters, in model order: a module stands for all its parameters."""
    chosen_set = set(chosen)
    under: dict[str, set[str]] = collections.defaultdict(set)
    for name in every:
        for prefix in _prefixes(name):
            under[prefix].add(name)
    pieces: list[str] = []
    for name in chosen:
        piece = next(p for p in _prefixes(name) if under[p] <= chosen_set)
        if piece not in pieces:
            pieces.append(piece)
    return pieces


def describe(chosen: list[str], every: list[str]) -> str:
    """A short pattern for the parameter names ``chosen`` out of ``every`` parameter name of the model: whole
    modules by their name, repeated blocks factored (``blocks.*`` where every block is in), names that differ in one
    place braced (``blocks.*.{attn.proj,fc}.bias``)."""
    instances = collections.Counter(_wildcard(p) for p in {p for n in every for p in _prefixes(n)})
    by_pattern: dict[str, list[str]] = collections.defaultdict(list)
    for piece in _covering(chosen, every):
        by_pattern[_wildcard(piece)].append(piece)
    pieces = []
    for pattern, names in by_pattern.items():
        if len(names) > 1 and len(names) == instances[pattern]:
            pieces.append(pattern)
        else:
            pieces.extend(names)
    return ", ".join(_braced(_braced(pieces, _split_middle), _split_last))


class SumNames:
    """Names for the sums of parameter counts in one report; the same group gets the same name in every line."""

    def __init__(self, names: list[str]):
        self.names = list(names)
        self.definitions: dict[frozenset[str], sympy.Symbol] = {}

    def _module_of(self, group: frozenset[str]) -> str | None:
        """The module whose parameters are exactly ``group``, if there is one."""
        prefix = ".".join(sorted(group)[0].split(".")[:-1])
        while prefix:
            under = {n for n in self.names if n.startswith(prefix + ".")}
            if under == group:
                return prefix
            if not group <= under:
                return None
            prefix = prefix.rpartition(".")[0]
        return None

    def symbol_for(self, group: frozenset[str]) -> sympy.Symbol:
        if len(group) == 1:
            return psi(next(iter(group)))
        module = self._module_of(group)
        if module is not None:
            return psi(module)
        if group not in self.definitions:
            index = len(self.definitions) + 1
            self.definitions[group] = sympy.Symbol(f"ψ{str(index).translate(SUBSCRIPTS)}", positive=True)
        return self.definitions[group]

    def readable(self, expr: sympy.Expr) -> sympy.Expr:
        """``expr`` (a closed form, linear in the ψ[name]) with the parameters of equal coefficient summed into one
        symbol each."""
        expr = sympy.expand(expr)
        counts = {psi(name): name for name in self.names}
        present = [s for s in expr.free_symbols if s in counts]
        coefficients = {s: expr.coeff(s) for s in present}
        if any(c.has(*present) for c in coefficients.values()):  # not linear: leave it as it is
            return expr
        groups: dict[sympy.Expr, set[str]] = collections.defaultdict(set)
        for symbol, coefficient in coefficients.items():
            groups[coefficient].add(counts[symbol])
        rest = sympy.expand(expr - sum(c * s for s, c in coefficients.items()))
        sums = {self.symbol_for(frozenset(g)): c for c, g in groups.items()}
        named = rest + sympy.Add(*(c * s for s, c in sums.items()))
        forms = [sympy.factor_terms(sympy.collect(named, [PSI, *sympy.ordered(sums)])), sympy.factor(named)]
        return min(forms, key=lambda form: len(str(form)))  # the same value; the shorter to read

    def substitutions(self) -> dict[sympy.Symbol, sympy.Expr]:
        """Each numbered sum as the per-parameter sum it stands for (module sums: ``module_sums``)."""
        return {symbol: sympy.Add(*(psi(n) for n in group)) for group, symbol in self.definitions.items()}

    def legend(self) -> list[str]:
        """One line per numbered sum: ``ψ₁ = Σ ψ over blocks.*.{attn.proj,fc}.bias (4 parameters)``."""
        return [f"{symbol} = Σ ψ over {describe(sorted(group, key=self.names.index), self.names)} "
                f"({len(group)} parameters)" for group, symbol in self.definitions.items()]


def module_sums(expr: sympy.Expr, names: list[str]) -> sympy.Expr:
    """``expr`` with every ``ψ[module]`` written as the sum of that module's parameters (the inverse of the module
    naming in ``SumNames.readable``)."""
    replacements = {}
    for symbol in sympy.sympify(expr).free_symbols:
        label = symbol.name[2:-1] if symbol.name.startswith("ψ[") else None
        if label is not None and label not in names:
            replacements[symbol] = sympy.Add(*(psi(n) for n in names if n.startswith(label + ".")))
    return sympy.sympify(expr).subs(replacements)
