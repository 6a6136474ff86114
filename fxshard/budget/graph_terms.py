"""Reading the rewritten graphs for the ledger: which inputs are parameters (and how the graph reads them),
the collectives' buffers, the gathered and reduce buffers alive at once in graph order, the activations forward
saves and the gradients backward leaves, each as ``fxshard.budget.symbols.Term``s (see fxshard/budget/step_ledger.py)."""

from __future__ import annotations

import collections
import dataclasses
import operator
from collections.abc import Iterable

import sympy
import torch
from torch import fx

from fxshard.errors import FxShardError
from fxshard.passes.fx_utils import marker_args, marker_layout, replica_ranks, size_hint, storage_lifetimes
from fxshard.runtime.collectives import COLLECTIVE_ROLES, collective_of, group_name_of
from fxshard.runtime.ops import UNSHARD
from fxshard.runtime.sharding import row_size
from fxshard.torch_compat import (
    LocalSource,
    SavedForBackwardsAOTOutput,
    TensorProperty,
    TensorPropertySource,
)

from .symbols import B_GRAD, B_PARAM, K, N, Q_GRAD, Q_PARAM, R, T, Term, psi, shard, sizes_at

# Names of a model input's leading dimensions when the graph has symbolic sizes (``torch.compile(dynamic=True)``).
SIZE_NAMES = ("batch", "seq")
SCALES = " (scales)"  # ends the source of a packed collective's scales term


@dataclasses.dataclass
class Param:
    """A trainable parameter as the graphs see it."""

    name: str
    numel: int
    reads: str  # "local" (the graph reads the trainable leaf whole), "gathered" (gathers the leaf), "resident", "plain"
    sites: list[str] = dataclasses.field(default_factory=list)
    row: int = 1  # elements of one dim-0 row: a shard holds whole rows

    @property
    def count(self) -> sympy.Symbol:
        return psi(self.name)

    @property
    def shard(self) -> sympy.Expr:
        """Elements of one rank's shard of it."""
        return shard(self.count, self.row)


def input_index(node) -> int | None:
    desc = node.meta.get("desc") if isinstance(node, fx.Node) else None
    return getattr(desc, "idx", None)


def _meta(node: fx.Node) -> dict:
    return node.meta.get("fxshard", {})


def parameters_of_joint(joint: fx.GraphModule, names: dict[tuple, str] | None = None) -> dict[int, Param]:
    """{graph input index of each trainable leaf: Param}, from the joint graph's markers (before any pass).

    ``names`` optionally renames a parameter from (first use-site fqn,) to the name ``prepare`` gave it."""
    found: dict[int, Param] = {}
    for node in joint.graph.find_nodes(op="call_function", target=UNSHARD):
        args = marker_args(node)
        idx = input_index(args["local"])
        if idx is None:
            continue
        numel = int(torch.Size(args["full_shape"]).numel())
        layout = marker_layout(node)
        reads = "resident" if layout.reads_resident else "gathered" if layout.gathers else "local"
        param = found.setdefault(idx, Param(args["fqn"], numel, reads, row=row_size(args["full_shape"])))
        param.sites.append(args["fqn"])
    if not found:  # no markers: the graph reads every parameter as it is (stage 1 keeps them full and plain)
        output = next(iter(joint.graph.find_nodes(op="output")))
        placeholders = {input_index(p): p for p in joint.graph.find_nodes(op="placeholder")}
        for desc in output.meta.get("desc", []):
            grad_of = getattr(desc, "grad_of", None)
            idx = getattr(grad_of, "idx", None)
            if idx is not None and idx in placeholders:
                value = placeholders[idx].meta["val"]
                found[idx] = Param(f"input{idx}", size_hint(value.numel()), "plain")
    if names:
        for param in found.values():
            param.name = names.get(tuple(param.sites) or (param.name,), param.name)
    return found


class Sizes:
    """Maps tensors of the graphs to expressions in the parameters' counts, checked against their real sizes."""

    def __init__(self, params: Iterable[Param], world_size: int):
        self.params = {p.name: p for p in params}
        self.by_site = {site: p for p in self.params.values() for site in (p.sites or [p.name])}
        self.values: dict[sympy.Symbol, int] = {N: world_size, **{p.count: p.numel for p in self.params.values()}}
        self.size_names: dict[str, sympy.Symbol] = {}  # name given -> torch's size symbol

    def of_sites(self, sites) -> list[Param]:
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
            if sizes_at(expr, self.values) == numel:
                return expr
        return sympy.Integer(numel)


def width_of(value: torch.Tensor, symbol: sympy.Symbol, values: dict) -> sympy.Symbol:
    """The width symbol for a tensor of this role; a dtype-suffixed one if the role already has another width."""
    size = value.element_size()
    if values.get(symbol, size) != size:
        symbol = sympy.Symbol(f"{symbol.name}_{str(value.dtype).removeprefix('torch.')}", positive=True)
    values[symbol] = size
    return symbol


def _tensor_parallel_term(node: fx.Node, index: int, graph: str, sizes: Sizes, degree: int):
    """A comm term and schedule row of DTensor's collective over the tensor-parallel dimension: its input buffer
    (activations or their gradients) as its own size, over ``T`` ranks."""
    kind = collective_of(node.target).kind
    buffer = node.args[0].meta["val"]
    sizes.values[T] = degree
    term = Term("comm", kind, sizes.numel_of(buffer), sympy.Integer(buffer.element_size()), f"{graph}: {node.name}",
                calls=1, ranks=T)
    row = {"graph": graph, "position": index, "collective": f"{kind} over tp", "unit": "", "params": [],
           "node": node.name, "bytes": size_hint(buffer.numel()) * buffer.element_size()}
    return term, row


def _quantized_terms(node: fx.Node, kind: str, source: str, sizes: Sizes) -> list[Term]:
    """The comm terms of a packed collective (``quantize_weights`` / ``quantize_grads``, ``passes/quantize.py``):
    its values at the wire width ``q_param`` / ``q_grad``, and, blockwise, one fp32 scale per block as a term of its
    own. A gather packs one row (this rank's shards), the gradients' all-to-all N rows."""
    meta = _meta(node)
    params = sizes.of_sites(meta.get("params", []))
    row = sizes.matching(meta["row"], [sympy.Add(*(p.shard for p in params))])
    rows = 1 if kind == "all_gather" else N
    buffer = node.args[0].meta["val"]
    width = Q_PARAM if kind == "all_gather" else Q_GRAD
    sizes.values[width] = 2 if meta["quantized"] == "bf16" else 1
    if meta["quantized"] == "bf16":
        return [Term("comm", kind, rows * row, width, source, calls=1, unit=meta.get("unit", ""))]
    blocks = sympy.ceiling(row / meta["block"])
    expected = sizes_at(rows * (meta["block"] * blocks + 4 * blocks), sizes.values)
    if expected != size_hint(buffer.numel()):
        raise FxShardError(f"{source}: a packed buffer of {size_hint(buffer.numel())} elements, the ledger expects "
                           f"{expected}: passes/quantize.py and the ledger disagree on the layout")
    return [Term("comm", kind, rows * meta["block"] * blocks, width, source, calls=1, unit=meta.get("unit", "")),
            Term("comm", kind, rows * blocks, sympy.Integer(4), f"{source}{SCALES}", unit=meta.get("unit", ""))]


def collective_terms(gm: fx.GraphModule, graph: str, sizes: Sizes,
                     tensor_parallel: dict[str, int] | None = None) -> tuple[list[Term], list[dict]]:
    """One comm term per collective node, its input buffer in parameter counts; and the schedule rows.
    ``tensor_parallel``: {group name: ranks} of the tensor-parallel dimension, whose collectives (DTensor's) count
    too, over ``T``."""
    terms, schedule = [], []
    for index, node in enumerate(gm.graph.nodes):
        meta = _meta(node)
        kind = meta.get("role")
        collective = collective_of(node.target)
        if (kind is None and tensor_parallel and collective is not None and collective.kind in COLLECTIVE_ROLES
                and group_name_of(node) in tensor_parallel):
            term, row = _tensor_parallel_term(node, index, graph, sizes, tensor_parallel[group_name_of(node)])
            terms.append(term)
            schedule.append(row)
            continue
        if kind not in COLLECTIVE_ROLES:
            continue
        buffer = node.args[0].meta["val"]
        params = sizes.of_sites(meta.get("params", []))
        counts = [p.count for p in params]
        if meta.get("quantized"):
            terms += _quantized_terms(node, kind, f"{graph}: {node.name}", sizes)
            schedule.append({"graph": graph, "position": index, "collective": f"{kind} ({meta['quantized']})",
                             "unit": meta.get("unit", ""), "params": [p.name for p in params], "node": node.name,
                             "bytes": size_hint(buffer.numel()) * buffer.element_size()})
            continue
        across_replicas = replica_ranks(node) is not None  # hybrid mesh: a gradient shard averaged over R ranks
        if across_replicas:
            sizes.values[R] = replica_ranks(node)
        from_secondary = meta.get("across") == "secondary"  # reshard_after_forward=k: a re-gather over K ranks
        if from_secondary:
            sizes.values[K] = meta["ranks"]
        shards = sympy.Add(*(p.shard for p in params))
        candidates = {
            "all_gather": [N * shards / K if from_secondary else shards],
            "reduce_scatter": [N * shards],
            "all_reduce": [shards if across_replicas else sympy.Add(*counts)],
        }[kind]
        elements = sizes.matching(size_hint(buffer.numel()), candidates)
        width = width_of(buffer, B_PARAM if kind == "all_gather" else B_GRAD, sizes.values)
        unit = meta.get("unit", "")
        ranks = R if across_replicas else K if from_secondary else N
        terms.append(Term("comm", kind, elements, width, f"{graph}: {node.name}", calls=1, unit=unit, ranks=ranks))
        where = {R: " over replicas", K: " from secondary shards"}.get(ranks, "")
        schedule.append({"graph": graph, "position": index, "collective": f"{kind}{where}", "unit": unit,
                         "params": [p.name for p in params], "node": node.name,
                         "bytes": size_hint(buffer.numel()) * buffer.element_size()})
    return terms, schedule


def live_peak(gm: fx.GraphModule, graph: str, sizes: Sizes, grads: dict[fx.Node, sympy.Expr]) -> list[Term]:
    """The tensors ``gm`` holds at its worst point, walking the nodes in order (``storage_lifetimes``: a tensor
    lives from the node that makes it to its last reader, a returned one to the output; views share their base's
    storage). Graph inputs that are parameters or the batch are not counted (they are resident or the caller's);
    saved activations a backward graph takes are, until their last reader. Communication buffers and gradients are
    written in the parameters' counts, the rest as their (possibly symbolic) sizes."""
    nodes = list(gm.graph.nodes)
    roots, lifetimes = storage_lifetimes(nodes)
    saved = _saved_outputs(gm)
    aliases: dict[fx.Node, list[fx.Node]] = collections.defaultdict(list)
    for node in nodes:
        aliases[roots[node]].append(node)
    held: dict[fx.Node, tuple[str, sympy.Expr, sympy.Expr]] = {}
    for node in nodes:
        value = node.meta.get("val")
        if roots[node] is not node or not isinstance(value, torch.Tensor) or node.op == "output":
            continue
        if node.op == "placeholder" and input_index(node) is not None:
            continue  # a parameter or the batch
        held[node] = _held_as(node, aliases[node], value, sizes, grads, saved)
    # One sweep: each held tensor is alive from the node that makes it to its last reader (bytes evaluated once).
    nbytes = {h: sizes_at(held[h][1] * held[h][2], sizes.values) for h in held}
    entering, leaving = collections.defaultdict(list), collections.defaultdict(list)
    for h in held:
        born, last = lifetimes[h]
        entering[born].append(h)
        leaving[last].append(h)
    alive: dict[fx.Node, None] = {}
    best, best_bytes, where, total = [], -1, "", 0
    for index, node in enumerate(nodes):
        for h in entering[index]:
            alive[h] = None
            total += nbytes[h]
        if total > best_bytes:
            best, best_bytes, where = sorted(alive, key=lambda h: lifetimes[h][0]), total, f"{graph}: {node.name}"
        for h in leaving[index]:
            del alive[h]
            total -= nbytes[h]
    terms = [Term("peak", held[h][0], held[h][1], held[h][2], f"{graph}: {h.name}", unit=_meta(h).get("unit", ""))
             for h in best]
    return terms + [Term("peak", "peak point", sympy.Integer(0), sympy.Integer(0), where)]


def _saved_outputs(gm: fx.GraphModule) -> set[fx.Node]:
    output = next(iter(gm.graph.find_nodes(op="output")))
    values = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    descs = output.meta.get("desc") or [None] * len(values)
    return {v for v, d in zip(values, descs) if isinstance(d, SavedForBackwardsAOTOutput) and isinstance(v, fx.Node)}


def _held_as(node, aliases, value, sizes: Sizes, grads, saved) -> tuple[str, sympy.Expr, sympy.Expr]:
    """(item, elements, width) of a storage a graph holds, named by what its views are."""
    meta = _meta(node)
    grad_views = [a for a in aliases if a in grads]
    if grad_views and sizes_at(sympy.Add(*(grads[a] for a in grad_views)), sizes.values) == size_hint(value.numel()):
        return "gradients", sympy.Add(*(grads[a] for a in grad_views)), width_of(value, B_GRAD, sizes.values)
    if meta.get("role") == "all_gather":
        return "gathered", _gathered_expr(node, sizes), width_of(value, B_PARAM, sizes.values)
    if meta.get("role") == "secondary":
        return _secondary_shard(node, value, sizes)
    if meta.get("role") == "copy_out" and node.target is torch.ops.aten.clone.default:
        return "gathered", _column_expr(node, sizes), width_of(value, B_PARAM, sizes.values)
    if meta.get("role") == "copy_in" and any(_meta(u).get("role") in ("reduce_scatter", "all_reduce")
                                             for u in _users_through_views(node)):
        return "reduce buffer", _reduce_buffer_expr(node, sizes), width_of(value, B_GRAD, sizes.values)
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


def _reduce_buffer_expr(node: fx.Node, sizes: Sizes) -> sympy.Expr:
    """A gradient buffer built for a reduction: a padded flat gradient, or the unit's concatenation of them."""
    params = sizes.of_sites(_meta(node).get("params", []))
    counts = [p.count for p in params]
    padded = [N * sympy.Add(*(p.shard for p in params))] + [N * p.shard for p in params]
    whole = [sympy.Add(*counts)] + counts
    all_reduce = any(_meta(u).get("role") == "all_reduce" for u in _users_through_views(node))
    return sizes.matching(size_hint(node.meta["val"].numel()), whole + padded if all_reduce else padded + whole)


def _gathered_expr(wait: fx.Node, sizes: Sizes) -> sympy.Expr:
    params = sizes.of_sites(_meta(wait).get("params", []))
    return sizes.matching(size_hint(wait.meta["val"].numel()), [N * sympy.Add(*(p.shard for p in params))])


def _column_expr(clone: fx.Node, sizes: Sizes) -> sympy.Expr:
    params = sizes.of_sites(_meta(clone).get("params", []))
    numel = size_hint(clone.meta["val"].numel())
    piece = clone.args[0]
    if isinstance(piece, fx.Node) and piece.target is operator.getitem and piece.args[1] < len(params):
        params = [params[piece.args[1]]] + params
    return sizes.matching(numel, [N * p.shard for p in params])


def _secondary_shard(node: fx.Node, value: torch.Tensor, sizes: Sizes) -> tuple[str, sympy.Expr, sympy.Expr]:
    """(item, elements, width) of a secondary shard forward keeps for backward (``reshard_after_forward=k``): 1/K of
    its weight's gathered, padded length."""
    sizes.values[K] = _meta(node)["ranks"]
    params = sizes.of_sites(_meta(node)["params"])
    elements = sizes.matching(size_hint(value.numel()), [N * p.shard / K for p in params])
    return "secondary shards", elements, width_of(value, B_PARAM, sizes.values)


def saved_activations(forward: fx.GraphModule, sizes: Sizes) -> list[Term]:
    """Forward outputs saved for backward that are not graph inputs (those are parameters or the batch)."""
    output = next(iter(forward.graph.find_nodes(op="output")))
    values = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    terms = []
    for value, desc in zip(values, output.meta.get("desc", [None] * len(values))):
        if not isinstance(desc, SavedForBackwardsAOTOutput) or not isinstance(value, fx.Node):
            continue
        tensor = value.meta.get("val")
        if value.op == "placeholder" or not isinstance(tensor, torch.Tensor):
            continue
        if _meta(value).get("role") == "secondary":
            terms.append(Term("saved", *_secondary_shard(value, tensor, sizes), f"forward: {value.name}"))
            continue
        elements = sizes.numel_of(tensor)
        width = sympy.Integer(tensor.element_size())
        terms.append(Term("saved", "activations", elements, width, f"forward: {value.name}"))
    return terms


def gradient_terms(backward: fx.GraphModule, params: dict[int, Param], sizes: Sizes,
                   produced: dict[fx.Node, sympy.Expr], held: set[str]) -> list[Term]:
    """The backward graph's output gradient of each trainable leaf: full (ψ) or a shard (ceiling(ψ/N)); records
    each output node's expression in ``produced``. A leaf named in ``held`` already has its gradient from an earlier
    graph (a weight tied across a graph break): this graph's accumulates into the same ``.grad``, no new term.
    Adds the names it counts to ``held``."""
    output = next(iter(backward.graph.find_nodes(op="output")))
    values = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    terms = []
    for value, desc in zip(values, output.meta.get("desc", [None] * len(values))):
        idx = getattr(getattr(desc, "grad_of", None), "idx", None)
        if idx not in params or not isinstance(value, fx.Node):
            continue
        param, tensor = params[idx], value.meta["val"]
        elements = sizes.matching(size_hint(tensor.numel()), [param.count, param.shard])
        produced[value] = elements
        if param.name in held:
            continue
        held.add(param.name)
        width = width_of(tensor, B_GRAD, sizes.values)
        terms.append(Term("memory", "gradients", elements, width, f"backward: {value.name}"))
    return terms


def merge_sizes(sizes: Sizes, params) -> Sizes:
    for p in params:
        sizes.params[p.name] = p
        for site in p.sites or [p.name]:
            sizes.by_site[site] = p
        sizes.values[p.count] = p.numel
    return sizes
