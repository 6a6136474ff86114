"""The sympy ledger: memory per rank and bytes communicated per step, read off the rewritten graphs.

Nothing here is a table keyed by ZeRO stage. Every term comes from a node (or the prepared optimizer):

- the AOT joint graph's ``fxshard.unshard`` markers say which graph input is a parameter's trainable leaf
  (``local``) and which is a separate full copy (``resident``), and whether the graph reads the leaf whole or
  gathers it from shards; a graph without markers (stage 1) reads every input that receives a gradient as a
  plain parameter;
- the backward graph's outputs (``GradAOTOutput``) are the gradients that stay resident, full or sharded;
- every collective node (``meta["fxshard"]["role"]`` of ``all_gather`` / ``reduce_scatter`` / ``all_reduce``)
  contributes its input buffer, expressed in the element counts of the parameters its ``params`` name;
- the forward graph's outputs marked ``SavedForBackwardsAOTOutput`` that are not graph inputs are the activations
  saved for backward;
- the gathered buffers (``wait`` of an all-gather, the per-parameter copies after it) alive at once, walked in
  graph order, give the transient peak under the schedule the passes chose;
- the prepared optimizer gives the tensors it updates (the master copy: the shard leaf, the stage-1 master shard,
  or the full parameter) and, from its class, the state kinds it keeps per element (Adam: ``exp_avg`` and
  ``exp_avg_sq``); where the master is not what the graph reads, its update is followed by an all-gather into the
  copy the graph reads, and where a gradient arrives full but the master is a shard, by a reduce-scatter.

Symbols: ``N`` (the ranks a parameter is sharded over: the world size, or a 2-D mesh's shard dimension), ``R``
(hybrid sharding only: the replicas of each shard, the mesh's replicate dimension), one element count ``ψ[name]``
per trainable parameter (``Ψ`` is their sum), byte widths ``b_param`` (the copy the graph reads), ``b_grad``,
``b_master``, ``b_state``, and with dynamic shapes the graph's size symbols, named ``batch``/``seq`` after the model
input dimension they come from. A shard of ``ψ`` elements holds ``ceiling(ψ/N)`` (flat padded sharding); :meth:`Ledger.closed_form` assumes N divides every parameter and writes the sum as Ψ.
"""

from __future__ import annotations

import collections
import dataclasses
import operator
from collections.abc import Iterable

import sympy
import torch
from torch import fx

from .errors import FxShardError
from .passes.fx_utils import COLLECTIVE_ROLES, is_view, replica_ranks, size_hint

N = sympy.Symbol("N", positive=True, integer=True)
R = sympy.Symbol("R", positive=True, integer=True)
PSI = sympy.Symbol("Ψ", positive=True)
B_PARAM, B_GRAD, B_MASTER, B_STATE = (sympy.Symbol(n, positive=True) for n in ("b_param", "b_grad", "b_master", "b_state"))
WIDTHS = (B_PARAM, B_GRAD, B_MASTER, B_STATE)
# The ZeRO paper's mixed-precision Adam accounting: 2-byte parameters and gradients, fp32 master copy and moments.
ZERO_PAPER_WIDTHS = {B_PARAM: 2, B_GRAD: 2, B_MASTER: 4, B_STATE: 4}

# Names of a model input's leading dimensions when the graph has symbolic sizes (``torch.compile(dynamic=True)``).
SIZE_NAMES = ("batch", "seq")

# What each elementwise optimizer keeps per element of what it updates (0-dim "step" counters are not counted).
def optimizer_state_kinds(name: str, group: dict) -> tuple[str, ...]:
    """State tensors an optimizer class (by name: ``"AdamW"``) keeps per element, given a param group's settings."""
    if name in ("Adam", "AdamW"):
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
    if name == "SGD":
        return ("momentum_buffer",) if group.get("momentum", 0) else ()
    if name == "Adagrad":
        return ("sum",)
    if name == "Adamax":
        return ("exp_avg", "exp_inf")
    if name == "RMSprop":
        return (("square_avg",) + (("momentum_buffer",) if group.get("momentum", 0) else ())
                + (("grad_avg",) if group.get("centered") else ()))
    if name in ("NAdam", "RAdam"):
        return ("exp_avg", "exp_avg_sq")
    raise FxShardError(f"the ledger does not know the state of {name}; use an optimizer fxshard supports")


def psi(name: str) -> sympy.Symbol:
    """The element count of one trainable parameter."""
    return sympy.Symbol(f"ψ[{name}]", positive=True, integer=True)


def shard(elements: sympy.Expr) -> sympy.Expr:
    """Elements of one rank's flat padded shard."""
    return sympy.ceiling(elements / N)


def ring_factor(kind: str, ranks: sympy.Expr = N) -> sympy.Expr:
    """Bytes a rank sends in a ring collective over ``ranks`` per byte of its input buffer (what
    ``CollectiveCounter`` counts)."""
    return {"all_gather": ranks - 1, "reduce_scatter": (ranks - 1) / ranks, "all_reduce": 2 * (ranks - 1) / ranks}[kind]


@dataclasses.dataclass(frozen=True)
class Term:
    """One line of the ledger: ``elements × width`` bytes of one kind, and where in the graphs it comes from."""

    section: str  # "memory" (resident between steps), "peak" (alive at the step's worst point besides the resident
    # state without gradients), "saved" (activations forward saves for backward), "comm" (per step)
    item: str  # "master", "gradients", "exp_avg", "activations", "gathered", "all_gather", ...
    elements: sympy.Expr
    width: sympy.Expr
    source: str
    calls: int = 0  # collectives: how many run per step
    unit: str = ""
    ranks: sympy.Expr = N  # collectives: the group they run over (R: across the replicas of a hybrid mesh)

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

    def peak_at(self) -> str:
        """Where the peak is: the graph and node."""
        return next((t.source for t in self.select("peak") if t.item == "peak point"), "")

    def communicated(self, kind: str | None = None, *, moved: bool = False, ranks: sympy.Expr | None = None
                     ) -> sympy.Expr:
        """Bytes per step: handed to collectives (``moved=False``, what ``CollectiveCounter`` counts) or sent in a
        ring (``moved=True``); of one kind, over one group (``ranks``: ``N`` or ``R``), or all."""
        terms = [t for t in self.select("comm", kind) if ranks is None or t.ranks == ranks]
        return sympy.Add(*((t.moved if moved else t.bytes) for t in terms))

    def calls(self, kind: str, ranks: sympy.Expr | None = None) -> int:
        return sum(t.calls for t in self.select("comm", kind) if ranks is None or t.ranks == ranks)

    def groups(self, kind: str) -> list[sympy.Expr]:
        """The groups (``N``, then ``R`` on a hybrid mesh) that collectives of ``kind`` run over."""
        return [g for g in (N, R) if any(t.ranks == g for t in self.select("comm", kind))]

    def mixed_precision(self) -> sympy.Expr:
        """Resident bytes under the ZeRO paper's mixed-precision accounting: the run's terms plus a compute copy
        wherever the graph reads the master."""
        return self.resident() + sympy.Add(*(t.bytes for t in self.mixed_precision_copies))

    def at(self, expr: sympy.Expr, **sizes) -> int | float:
        """``expr`` evaluated at this run's sizes (Ψ is the sum of the ψ), overridden by name: ``N=64``,
        ``b_param=2``, ``Ψ=7.5e9``."""
        values = {**self.values, PSI: sum(self.values.get(c, 0) for c in self.params.values())}
        known = {s.name: s for s in [N, R, PSI, *WIDTHS, *values]}
        for name, value in sizes.items():
            if name not in known:
                raise FxShardError(f"the ledger has no symbol {name!r}; it has {sorted(known)}")
            values[known[name]] = value
        result = sympy.sympify(expr).subs(values)
        if not result.is_number:
            raise FxShardError(f"cannot evaluate {expr}: no value for {sorted(map(str, result.free_symbols))}")
        return int(result) if result == int(result) else float(result)

    def closed_form(self, expr: sympy.Expr) -> sympy.Expr:
        """``expr`` assuming N divides every parameter (no padding), the per-parameter counts summed into Ψ."""
        return closed_form(expr, list(self.params.values()))


def _symbol_named(ledger: Ledger, symbol: sympy.Symbol) -> sympy.Symbol:
    for known in [N, R, *WIDTHS, *ledger.values]:
        if known.name == symbol.name:
            return known
    return symbol


def closed_form(expr: sympy.Expr, counts: list[sympy.Symbol]) -> sympy.Expr:
    """Drop the padding (``ceiling(ψ/N) -> ψ/N``) and write Σψ as Ψ; what depends on one parameter alone stays."""
    expr = sympy.sympify(expr).replace(sympy.ceiling, lambda x: x)
    if counts:
        last = counts[-1]
        expr = expr.subs(last, PSI - sympy.Add(*counts[:-1]))
    return sympy.simplify(sympy.expand(expr))


# -- reading the graphs ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Param:
    """A trainable parameter as the graphs see it."""

    name: str
    numel: int
    reads: str  # "local" (the graph reads the trainable leaf whole), "gathered" (gathers the leaf), "resident", "plain"
    sites: list[str] = dataclasses.field(default_factory=list)

    @property
    def count(self) -> sympy.Symbol:
        return psi(self.name)


def _input_index(node) -> int | None:
    desc = node.meta.get("desc") if isinstance(node, fx.Node) else None
    return getattr(desc, "idx", None)


def _meta(node: fx.Node) -> dict:
    return node.meta.get("fxshard", {})


def parameters_of_joint(joint: fx.GraphModule, names: dict[tuple, str] | None = None) -> dict[int, _Param]:
    """{graph input index of each trainable leaf: _Param}, from the joint graph's markers (before any pass).

    ``names`` optionally renames a parameter from (first use-site fqn,) to the name ``prepare`` gave it."""
    from fxshard.ops import UNSHARD

    from fxshard.passes.fx_utils import marker_args

    found: dict[int, _Param] = {}
    for node in joint.graph.find_nodes(op="call_function", target=UNSHARD):
        args = marker_args(node)
        idx = _input_index(args["local"])
        if idx is None:
            continue
        numel = int(torch.Size(args["full_shape"]).numel())
        if args["resident"] is not None:
            reads = "resident"
        elif args["grad_reduction"] == "reduce_scatter":
            reads = "gathered"
        else:
            reads = "local"
        param = found.setdefault(idx, _Param(args["fqn"], numel, reads))
        param.sites.append(args["fqn"])
    if not found:  # no markers: the graph reads every parameter as it is (stage 1 keeps them full and plain)
        output = next(iter(joint.graph.find_nodes(op="output")))
        placeholders = {_input_index(p): p for p in joint.graph.find_nodes(op="placeholder")}
        for desc in output.meta.get("desc", []):
            grad_of = getattr(desc, "grad_of", None)
            idx = getattr(grad_of, "idx", None)
            if idx is not None and idx in placeholders:
                value = placeholders[idx].meta["val"]
                found[idx] = _Param(f"input{idx}", size_hint(value.numel()), "plain")
    if names:
        for param in found.values():
            param.name = names.get(tuple(param.sites) or (param.name,), param.name)
    return found


class _Sizes:
    """Maps tensors of the graphs to expressions in the parameters' counts, checked against their real sizes."""

    def __init__(self, params: Iterable[_Param], world_size: int):
        self.params = {p.name: p for p in params}
        self.by_site = {site: p for p in self.params.values() for site in (p.sites or [p.name])}
        self.values: dict[sympy.Symbol, int] = {N: world_size, **{p.count: p.numel for p in self.params.values()}}
        self.size_names: dict[str, sympy.Symbol] = {}  # name given -> torch's size symbol

    def of_sites(self, sites) -> list[_Param]:
        return list({id(self.by_site[s]): self.by_site[s] for s in sites if s in self.by_site}.values())

    def numel_of(self, value: torch.Tensor) -> sympy.Expr:
        """A tensor's element count as an expression: a number, or for dynamic shapes, in the graph's size
        symbols named after the model input dimension each came from (their sizes in this run join ``values``)."""
        numel = value.numel()
        if not isinstance(numel, torch.SymInt):
            return sympy.Integer(int(numel))
        expr = sympy.sympify(numel.node.expr)
        shape_env = numel.node.shape_env
        named = {}
        for symbol in expr.free_symbols:
            named[symbol] = self._size_symbol(symbol, shape_env)
            if symbol in shape_env.backed_var_to_val:
                self.values[named[symbol]] = int(shape_env.backed_var_to_val[symbol])
        return expr.xreplace(named)

    def _size_symbol(self, symbol: sympy.Symbol, shape_env) -> sympy.Symbol:
        """``batch`` for dim 0 of a model input, ``seq`` for dim 1, ``<input>_dim<k>`` beyond (suffixed with
        torch's name where two sizes would share one); torch's own name where Dynamo recorded no input for it."""
        from torch._dynamo.source import LocalSource, TensorProperty, TensorPropertySource

        name = symbol.name
        for source in shape_env.var_to_sources.get(symbol, []):
            if (isinstance(source, TensorPropertySource) and source.prop is TensorProperty.SIZE
                    and isinstance(source.base, LocalSource)):
                leading = source.idx < len(SIZE_NAMES)
                name = SIZE_NAMES[source.idx] if leading else f"{source.base.local_name}_dim{source.idx}"
                break
        if self.size_names.setdefault(name, symbol) != symbol:
            name = f"{name}_{symbol.name}"
        return sympy.Symbol(name, positive=True, integer=True)

    def matching(self, numel: int, candidates: list[sympy.Expr]) -> sympy.Expr:
        """The first candidate that evaluates to ``numel`` here; the bare number if none does."""
        for expr in candidates:
            if int(expr.subs(self.values)) == numel:
                return expr
        return sympy.Integer(numel)


def _width(value: torch.Tensor, symbol: sympy.Symbol, values: dict) -> sympy.Symbol:
    """The width symbol for a tensor of this role; a dtype-suffixed one if the role already has another width."""
    size = value.element_size()
    if values.get(symbol, size) != size:
        symbol = sympy.Symbol(f"{symbol.name}_{str(value.dtype).removeprefix('torch.')}", positive=True)
    values[symbol] = size
    return symbol


def collective_terms(gm: fx.GraphModule, graph: str, sizes: _Sizes) -> tuple[list[Term], list[dict]]:
    """One comm term per collective node, its input buffer in parameter counts; and the schedule rows."""
    terms, schedule = [], []
    for index, node in enumerate(gm.graph.nodes):
        meta = _meta(node)
        kind = meta.get("role")
        if kind not in COLLECTIVE_ROLES:
            continue
        buffer = node.args[0].meta["val"]
        params = sizes.of_sites(meta.get("params", []))
        counts = [p.count for p in params]
        across_replicas = replica_ranks(node) is not None  # hybrid mesh: a gradient shard averaged over R ranks
        if across_replicas:
            sizes.values[R] = replica_ranks(node)
        candidates = {
            "all_gather": [sympy.Add(*map(shard, counts))],
            "reduce_scatter": [N * sympy.Add(*map(shard, counts))],
            "all_reduce": [sympy.Add(*map(shard, counts)) if across_replicas else sympy.Add(*counts)],
        }[kind]
        elements = sizes.matching(size_hint(buffer.numel()), candidates)
        width = _width(buffer, B_PARAM if kind == "all_gather" else B_GRAD, sizes.values)
        unit = meta.get("unit", "")
        terms.append(Term("comm", kind, elements, width, f"{graph}: {node.name}", calls=1, unit=unit,
                          ranks=R if across_replicas else N))
        schedule.append({"graph": graph, "position": index,
                         "collective": f"{kind} over replicas" if across_replicas else kind, "unit": unit,
                         "params": [p.name for p in params], "node": node.name,
                         "bytes": size_hint(buffer.numel()) * buffer.element_size()})
    return terms, schedule


def _storage_root(node: fx.Node, roots: dict) -> fx.Node:
    # wait_tensor returns the very tensor its collective wrote into
    waits = node.op == "call_function" and node.target is torch.ops._c10d_functional.wait_tensor.default
    if is_view(node) or waits or (node.op == "call_function" and node.target is operator.getitem):
        source = node.args[0]
        if isinstance(source, fx.Node):
            return roots.get(source, source)
    return node


def live_peak(gm: fx.GraphModule, graph: str, sizes: _Sizes, grads: dict[fx.Node, sympy.Expr]) -> list[Term]:
    """The tensors ``gm`` holds at its worst point, walking the nodes in order (a tensor lives from the node that
    makes it to its last use, or past the end if returned; views share their base's storage). Graph inputs that are
    parameters or the batch are not counted (they are resident or the caller's); saved activations a backward
    graph takes are, until their last use. Communication buffers and gradients are written in the parameters'
    counts, the rest as their (possibly symbolic) sizes."""
    nodes = list(gm.graph.nodes)
    roots: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        roots[node] = _storage_root(node, roots)
    last_use: dict[fx.Node, int] = {}
    for index, node in enumerate(nodes):
        for used in node.all_input_nodes:
            last_use[roots[used]] = len(nodes) if node.op == "output" else index
    for node in nodes:  # autograd keeps what forward saved (and the incoming gradient) until backward returns
        if node.op == "placeholder":
            last_use[node] = len(nodes)
    saved = _saved_outputs(gm)
    aliases: dict[fx.Node, list[fx.Node]] = collections.defaultdict(list)
    for node in nodes:
        aliases[roots[node]].append(node)
    held: dict[fx.Node, tuple[str, sympy.Expr, sympy.Expr]] = {}
    for node in nodes:
        value = node.meta.get("val")
        if roots[node] is not node or not isinstance(value, torch.Tensor) or node.op == "output":
            continue
        if node.op == "placeholder" and _input_index(node) is not None:
            continue  # a parameter or the batch
        held[node] = _held_as(node, aliases[node], value, sizes, grads, saved)
    # One sweep: each held tensor enters at the node that makes it and leaves at its last use (bytes evaluated once).
    born = {node: index for index, node in enumerate(nodes)}
    ends = {h: last_use.get(h, born[h] + 1) for h in held}
    nbytes = {h: sizes_at(held[h][1] * held[h][2], sizes.values) for h in held}
    entering, leaving = collections.defaultdict(list), collections.defaultdict(list)
    for h in held:
        if born[h] < ends[h]:
            entering[born[h]].append(h)
            leaving[ends[h]].append(h)
    alive: dict[fx.Node, None] = {}
    best, best_bytes, where, total = [], -1, "", 0
    for index, node in enumerate(nodes):
        for h in leaving[index]:
            del alive[h]
            total -= nbytes[h]
        for h in entering[index]:
            alive[h] = None
            total += nbytes[h]
        if total > best_bytes:
            best, best_bytes, where = sorted(alive, key=born.__getitem__), total, f"{graph}: {node.name}"
    terms = [Term("peak", held[h][0], held[h][1], held[h][2], f"{graph}: {h.name}", unit=_meta(h).get("unit", ""))
             for h in best]
    return terms + [Term("peak", "peak point", sympy.Integer(0), sympy.Integer(0), where)]


def _saved_outputs(gm: fx.GraphModule) -> set[fx.Node]:
    from torch._functorch._aot_autograd.descriptors import SavedForBackwardsAOTOutput

    output = next(iter(gm.graph.find_nodes(op="output")))
    values = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    descs = output.meta.get("desc") or [None] * len(values)
    return {v for v, d in zip(values, descs) if isinstance(d, SavedForBackwardsAOTOutput) and isinstance(v, fx.Node)}


def _held_as(node, aliases, value, sizes: _Sizes, grads, saved) -> tuple[str, sympy.Expr, sympy.Expr]:
    """(item, elements, width) of a storage a graph holds, named by what its views are."""
    meta = _meta(node)
    grad_views = [a for a in aliases if a in grads]
    if grad_views and sizes_at(sympy.Add(*(grads[a] for a in grad_views)), sizes.values) == size_hint(value.numel()):
        return "gradients", sympy.Add(*(grads[a] for a in grad_views)), _width(value, B_GRAD, sizes.values)
    if meta.get("role") == "all_gather":
        return "gathered", _gathered_expr(node, sizes), _width(value, B_PARAM, sizes.values)
    if meta.get("role") == "copy_out" and node.target is torch.ops.aten.clone.default:
        return "gathered", _column_expr(node, sizes), _width(value, B_PARAM, sizes.values)
    if meta.get("role") == "copy_in" and any(_meta(u).get("role") in ("reduce_scatter", "all_reduce")
                                             for u in _users_through_views(node)):
        return "reduce buffer", _reduce_buffer_expr(node, sizes), _width(value, B_GRAD, sizes.values)
    elements = sizes.numel_of(value)
    item = "activations" if node in saved or node.op == "placeholder" else "temporaries"
    return item, elements, sympy.Integer(value.element_size())


def _users_through_views(node: fx.Node) -> list[fx.Node]:
    users, pending = [], list(node.users)
    while pending:
        user = pending.pop()
        users.append(user)
        if _meta(user).get("role") == "copy_in" and user.target is torch.ops.aten.view.default:
            pending.extend(user.users)
    return users


def _reduce_buffer_expr(node: fx.Node, sizes: _Sizes) -> sympy.Expr:
    """A gradient buffer built for a reduction: a padded flat gradient, or the unit's concatenation of them."""
    params = sizes.of_sites(_meta(node).get("params", []))
    counts = [p.count for p in params]
    padded = [N * sympy.Add(*map(shard, counts))] + [N * shard(c) for c in counts]
    whole = [sympy.Add(*counts)] + counts
    all_reduce = any(_meta(u).get("role") == "all_reduce" for u in _users_through_views(node))
    return sizes.matching(size_hint(node.meta["val"].numel()), whole + padded if all_reduce else padded + whole)


def _gathered_expr(wait: fx.Node, sizes: _Sizes) -> sympy.Expr:
    params = sizes.of_sites(_meta(wait).get("params", []))
    return sizes.matching(size_hint(wait.meta["val"].numel()), [N * sympy.Add(*(shard(p.count) for p in params))])


def _column_expr(clone: fx.Node, sizes: _Sizes) -> sympy.Expr:
    params = sizes.of_sites(_meta(clone).get("params", []))
    numel = size_hint(clone.meta["val"].numel())
    piece = clone.args[0]
    if isinstance(piece, fx.Node) and piece.target is operator.getitem and piece.args[1] < len(params):
        params = [params[piece.args[1]]] + params
    return sizes.matching(numel, [N * shard(p.count) for p in params])


def saved_activations(forward: fx.GraphModule, sizes: _Sizes) -> list[Term]:
    """Forward outputs saved for backward that are not graph inputs (those are parameters or the batch)."""
    from torch._functorch._aot_autograd.descriptors import SavedForBackwardsAOTOutput

    output = next(iter(forward.graph.find_nodes(op="output")))
    values = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    terms = []
    for value, desc in zip(values, output.meta.get("desc", [None] * len(values))):
        if not isinstance(desc, SavedForBackwardsAOTOutput) or not isinstance(value, fx.Node):
            continue
        tensor = value.meta.get("val")
        if value.op == "placeholder" or not isinstance(tensor, torch.Tensor):
            continue
        elements = sizes.numel_of(tensor)
        terms.append(Term("saved", "activations", elements, sympy.Integer(tensor.element_size()), f"forward: {value.name}"))
    return terms


def gradient_terms(backward: fx.GraphModule, params: dict[int, _Param], sizes: _Sizes,
                   produced: dict[fx.Node, sympy.Expr]) -> list[Term]:
    """The backward graph's output gradient of each trainable leaf: full (ψ) or a shard (ceiling(ψ/N)); records
    each output node's expression in ``produced``."""
    output = next(iter(backward.graph.find_nodes(op="output")))
    values = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    terms = []
    for value, desc in zip(values, output.meta.get("desc", [None] * len(values))):
        idx = getattr(getattr(desc, "grad_of", None), "idx", None)
        if idx not in params or not isinstance(value, fx.Node):
            continue
        param, tensor = params[idx], value.meta["val"]
        elements = sizes.matching(size_hint(tensor.numel()), [param.count, shard(param.count)])
        terms.append(Term("memory", "gradients", elements, _width(tensor, B_GRAD, sizes.values), f"backward: {value.name}"))
        produced[value] = elements
    return terms


# -- the step: graphs + optimizer ---------------------------------------------------------------------------


def _names_from_model(model) -> dict[tuple, str]:
    """(use sites...) -> the name prepare gave the parameter, for tied parameters read at several sites."""
    if model is None:
        return {}
    names = {}
    by_id: dict[int, list[str]] = {}
    for site, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(site)
    for module_path, module in model.named_modules(remove_duplicate=False):
        for attr, spec in getattr(module, "_fxshard_specs", {}).items():
            site = f"{module_path}.{attr}" if module_path else attr
            names[(site,)] = spec.name
    for sites in by_id.values():
        for site in sites:
            names.setdefault((site,), sites[0])
    return names


def _rename(params: dict[int, _Param], names: dict[tuple, str], optimizer) -> None:
    for param in params.values():
        if param.sites:
            param.name = names.get((param.sites[0],), param.name)
    if optimizer is not None and any(p.reads == "plain" for p in params.values()):  # no markers: name the graph's inputs after the specs, matched by shape
        from .prepare import spec_of

        specs = [spec_of(p) for g in optimizer.param_groups for p in g["params"]]
        for idx, param in list(params.items()):
            if param.reads != "plain":
                continue
            match = next((s for s in specs if s is not None and s.numel == param.numel), None)
            if match is None:  # an input that requires grad, not a parameter
                del params[idx]
                continue
            specs.remove(match)
            param.name = match.name
            param.sites = [match.name]


def step_records(records) -> dict[int, dict]:
    """The backend's graph records grouped by Dynamo graph: {graph_id: {"joint": <graph before passes>, ...}}."""
    steps: dict[int, dict] = {}
    for record in records:
        if record.final is None:
            continue
        graphs = steps.setdefault(record.graph_id, {})
        graphs[record.kind] = record.passes[0].before if record.kind == "joint" and record.passes else record.final
    return steps


def optimizer_terms(optimizer, params: list[_Param], sizes: _Sizes,
                    published: set[str] = frozenset()) -> tuple[list, list, list, list]:
    """The master copy and state the optimizer keeps, the optimizer step's eager collectives (one per bucket of
    its ``ShardedStep``; none for what a compiled step graph gathers: ``published`` names those parameters), the
    compute copies mixed precision would add where the graph reads the master itself, and the step's schedule
    rows."""
    from .optim import sharded_step_of
    from .prepare import spec_of

    by_name = {p.name: p for p in params}

    def count_of(spec) -> sympy.Symbol:
        param = by_name.get(spec.name)
        count = psi(spec.name) if param is None else param.count
        sizes.values.setdefault(count, spec.numel)
        return count

    memory, copies = [], []
    for group in optimizer.param_groups:
        kinds = optimizer_state_kinds(type(optimizer).__name__, group)
        for tensor in group["params"]:
            spec = spec_of(tensor)
            if spec is None or not tensor.requires_grad:
                continue
            count = count_of(spec)
            elements = shard(count) if tensor.numel() == spec.chunk and spec.chunk != spec.numel else count
            source = f"optimizer: {spec.name}"
            memory.append(Term("memory", "master", elements, _width(tensor, B_MASTER, sizes.values), source))
            for kind in kinds:
                memory.append(Term("memory", kind, elements, _width(tensor, B_STATE, sizes.values), source))
            reads = by_name[spec.name].reads if spec.name in by_name else "local"
            if reads in ("local", "gathered"):  # the graph reads the master: mixed precision adds a compute copy
                read = count if reads == "local" else shard(count)
                copies.append(Term("memory", "compute copy", read, B_PARAM, f"graph reads {spec.name}"))
    comm, rows = [], []
    step = sharded_step_of(optimizer)
    shards = step.shards()
    to_publish = [s for s in shards if spec_of(s).name not in published]
    for kind, role, taken in (("all_gather", B_PARAM, to_publish),
                              ("reduce_scatter", B_GRAD, shards if step.stage == 1 else [])):
        for index, bucket in enumerate(step.buckets(kind, taken)):
            elements = sympy.Add(*(shard(count_of(spec_of(s))) for s in bucket)) * (1 if kind == "all_gather" else N)
            dtype_of = torch.empty(0, dtype=step.collective_dtype(kind, bucket[0]))
            width = _width(dtype_of, role, sizes.values)
            comm.append(Term("comm", kind, elements, width, f"optimizer step: {kind} bucket {index}", calls=1,
                             unit=f"step bucket {index}"))
            rows.append({"graph": "optimizer step", "position": index, "collective": kind,
                         "unit": f"step bucket {index}", "params": [spec_of(s).name for s in bucket], "node": "-"})
            replicas = spec_of(bucket[0]).replicate_size
            if kind == "reduce_scatter" and replicas > 1:  # hybrid mesh: the reduced shards, averaged over R ranks
                sizes.values[R] = replicas
                comm.append(Term("comm", "all_reduce", elements / N, width,
                                 f"optimizer step: all_reduce over replicas bucket {index}", calls=1,
                                 unit=f"step bucket {index}", ranks=R))
                rows.append({**rows[-1], "collective": "all_reduce over replicas"})
    return memory, comm, copies, rows


def step_peaks(step_collectives: list[Term], gradients: list[Term]) -> list[list[Term]]:
    """The eager optimizer step's worst points, one per bucket collective: the gradients backward left (held until
    the step), the bucket's input buffer (the shards or padded gradients, concatenated) and its output (the whole
    all-gather, or one rank's share of a reduce-scatter; an all-reduce's is its input's size)."""
    peaks = []
    for term in step_collectives:
        output = {"reduce_scatter": term.elements / N, "all_gather": term.elements * N}.get(term.item, term.elements)
        peaks.append([dataclasses.replace(g, section="peak") for g in gradients] + [
            Term("peak", "step bucket", term.elements, term.width, f"{term.source} input"),
            Term("peak", "step bucket", output, term.width, f"{term.source} output"),
            Term("peak", "peak point", sympy.Integer(0), sympy.Integer(0), term.source),
        ])
    return peaks


def ledger_of_graphs(records, *, world_size: int, optimizer=None, model=None) -> Ledger:
    """The ledger of one training step: every forward/backward pair the backend compiled, plus the optimizer.

    Several Dynamo graphs (graph breaks) add their terms; a graph id without a backward (an inference graph)
    contributes only its collectives to the schedule. A compiled ``optimizer.step`` contributes the collectives of
    its graph (of the latest compile, where it was recompiled) in place of the eager step's per-parameter gathers."""
    from .prepare import updating_optimizer

    optimizer = None if optimizer is None else updating_optimizer(optimizer)
    names = _names_from_model(model)
    terms, schedule, copies = [], [], []
    all_params: dict[str, _Param] = {}
    sizes, peaks = None, []
    for graph_id, graphs in sorted(step_records(records).items()):
        if "joint" not in graphs or "forward" not in graphs or "backward" not in graphs:
            continue
        params = parameters_of_joint(graphs["joint"])
        _rename(params, names, optimizer)
        all_params.update({p.name: p for p in params.values()})
        sizes = _Sizes(all_params.values(), world_size) if sizes is None else _merge(sizes, params.values())
        for param in params.values():
            if param.reads in ("resident", "plain"):  # a full copy the graph reads, not what the optimizer updates
                terms.append(Term("memory", "compute copy", param.count, B_PARAM, f"graph {graph_id} reads {param.name}"))
            if optimizer is None and param.reads in ("local", "gathered"):
                read = param.count if param.reads == "local" else shard(param.count)
                terms.append(Term("memory", "master", read, B_MASTER, f"graph {graph_id}: {param.name}"))
        produced: dict[fx.Node, sympy.Expr] = {}
        terms += gradient_terms(graphs["backward"], params, sizes, produced)
        terms += saved_activations(graphs["forward"], sizes)
        for kind in ("forward", "backward"):
            comm, rows = collective_terms(graphs[kind], f"graph {graph_id} {kind}", sizes)
            terms += comm
            schedule += rows
            peaks.append(live_peak(graphs[kind], f"graph {graph_id} {kind}", sizes, produced))
    if sizes is None:
        raise FxShardError("no forward/backward graph was compiled yet: run one training step (forward and "
                           "backward) through torch.compile(model, backend=backend) before asking for the ledger")
    for param in all_params.values():
        sizes.values.setdefault(param.count, param.numel)
    published: set[str] = set()
    for graph_id, graphs in sorted(step_records(records).items(), reverse=True):
        if "optimizer" not in graphs or "inference" not in graphs:
            continue
        comm, rows = collective_terms(graphs["inference"], f"optimizer step graph {graph_id}", sizes)
        gathered = {name for row in rows for name in row["params"]}
        if gathered & published:  # recompiled: the later graph replaced this one
            continue
        published |= gathered
        terms += comm
        schedule += rows
    if optimizer is not None:
        memory, comm, copies, rows = optimizer_terms(optimizer, list(all_params.values()), sizes, published)
        terms += memory + comm
        peaks += step_peaks(comm, [t for t in terms if t.section == "memory" and t.item == "gradients"])
        schedule += [{**row, "bytes": sizes_at(t.bytes, sizes.values)} for row, t in zip(rows, comm)]
    # graphs and the step's buckets run one after the other: the step's worst point is the worst of theirs
    terms += max(peaks, key=lambda p: sum(sizes_at(t.bytes, sizes.values) for t in p))
    for width in WIDTHS:
        sizes.values.setdefault(width, 4)
    params_by_name = {p.name: p.count for p in all_params.values()}
    return Ledger(terms, sizes.values, params_by_name, copies, schedule)


def _merge(sizes: _Sizes, params) -> _Sizes:
    for p in params:
        sizes.params[p.name] = p
        for site in p.sites or [p.name]:
            sizes.by_site[site] = p
        sizes.values[p.count] = p.numel
    return sizes


def sizes_at(expr: sympy.Expr, values: dict) -> int:
    return int(sympy.sympify(expr).subs(values))


def graph_ledger(gm: fx.GraphModule, graph: str, world_size: int, optimizer_bytes: int = 0) -> dict:
    """What one lowered graph (of kind ``graph``) needs per rank, in bytes, with ``optimizer_bytes`` kept outside it:
    ``{"inputs", "peak", "peak_at", "optimizer", "total", "terms": [(item, node, bytes)]}`` (see passes/budget.py)."""
    sizes = _Sizes([], world_size)
    held = live_peak(gm, graph, sizes, grads={})
    peak_terms = [t for t in held if t.item != "peak point"]
    inputs = [p for p in gm.graph.find_nodes(op="placeholder")
              if _input_index(p) is not None and hasattr(p.meta.get("val"), "element_size")]
    terms = [("input", p.name, size_hint(p.meta["val"].numel()) * p.meta["val"].element_size()) for p in inputs]
    input_bytes = sum(nbytes for _, _, nbytes in terms)
    terms += [(t.item, t.source.split(": ", 1)[1], sizes_at(t.bytes, sizes.values)) for t in peak_terms]
    peak = sum(b for item, _, b in terms if item != "input")
    if optimizer_bytes:
        terms.append(("optimizer", "state and masters", optimizer_bytes))
    return {"inputs": input_bytes, "peak": peak, "peak_at": held[-1].source, "optimizer": optimizer_bytes,
            "total": input_bytes + peak + optimizer_bytes, "terms": terms}


def optimizer_bytes(optimizer, model) -> int:
    """Bytes per rank the optimizer keeps that no graph of the model takes as input: its state for every element
    it updates (the state kinds of ``optimizer_state_kinds``, allocated at the first step), and the tensors it
    updates that are not the model's parameters (stage 1's master shards)."""
    from .prepare import updating_optimizer

    model_leaves = {id(p) for p in model.parameters()}
    total = 0
    for group in updating_optimizer(optimizer).param_groups:
        kinds = optimizer_state_kinds(type(optimizer).__name__, group)
        for tensor in group["params"]:
            if not tensor.requires_grad:
                continue
            per_element = len(kinds) + (id(tensor) not in model_leaves)
            total += per_element * tensor.numel() * tensor.element_size()
    return total


def ledger(backend) -> Ledger:
    """The ledger of a backend's compiled step (``backend.prepare`` and one forward/backward run first)."""
    from .prepare import sharded_world_size

    if backend.model is None:
        raise FxShardError("the backend has no prepared model: call `model, opt = backend.prepare(model, opt)` and "
                           "run a step through torch.compile(model, backend=backend) first")
    world = sharded_world_size(backend.model) or 1
    return ledger_of_graphs(backend.graphs, world_size=world, optimizer=backend.optimizer, model=backend.model)
