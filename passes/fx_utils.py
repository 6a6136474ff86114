"""Small helpers over ``fx.Graph`` shared by the passes."""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxshard.runtime.collectives import WAIT
from fxshard.runtime.sharding import MarkerLayout
from fxshard.torch_compat import FakeTensor, OpOverload, detect_fake_mode, op_arguments, traced_size, tree_flatten



def size_hint(value: int | torch.SymInt) -> int:
    """A size as a plain int: its value in the example the graph was traced with, where it is symbolic (dynamic
    shapes). Read without a guard: ``int()``, ``bool()`` or a comparison on a ``torch.SymInt`` while the backend
    compiles adds a guard that pins the size, and Dynamo recompiles the graph for every new batch size or sequence
    length. Good for estimates (bytes, costs); a decision that must hold for every size has to come from the
    expression (``value.node.expr``) instead."""
    if isinstance(value, torch.SymInt):
        return traced_size(value)
    return int(value)


def is_view(node: fx.Node) -> bool:
    """Whether ``node`` is an op whose schema says it returns a view of its input (``view``, ``t``, ``slice``...)."""
    return node.op == "call_function" and isinstance(node.target, OpOverload) and node.target.is_view


def aliases_its_input(node: fx.Node) -> bool:
    """Whether ``node`` writes nothing: a view of its input, or one element of a multi-output op's tuple
    (``operator.getitem``)."""
    return is_view(node) or (node.op == "call_function" and node.target is operator.getitem)


def storage_roots(nodes) -> dict[fx.Node, fx.Node]:
    """For each of ``nodes`` (in graph order), the node whose storage its value lives in: a view, a ``getitem`` of a
    multi-output op's tuple and a ``wait_tensor`` (the very tensor its collective wrote into) share their source's;
    every other node is its own."""
    roots: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        source = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        shares = aliases_its_input(node) or (node.op == "call_function" and node.target is WAIT)
        roots[node] = roots.get(source, source) if shares and source is not None else node
    return roots


def storage_lifetimes(nodes) -> tuple[dict[fx.Node, fx.Node], dict[fx.Node, tuple[int, int]]]:
    """The storage each of ``nodes`` (in graph order) lives in (``storage_roots``), and per storage the positions
    in ``nodes`` where it is made and where it is last read, both inclusive: a node's inputs and its output are alive
    at its position. A graph input dies at its last reader too: Inductor's graphs and the eager compiler's
    (``torch_compat.boxed_freeing_inputs``) take their inputs boxed and drop each after its last use, and torch's
    compiled backward hands them its saved tensors that way (``ctx.maybe_clear_saved_tensors()``, then the graph
    with ``steal_args``), so a saved activation does not outlive its last reader unless ``retain_graph`` keeps it. A
    returned tensor lives to the output node; one nobody reads, at its own position only. The one liveness rule the
    prefetch pass's memory curve and the ledger's peak read."""
    nodes = list(nodes)
    roots = storage_roots(nodes)
    lifetimes: dict[fx.Node, tuple[int, int]] = {}
    for position, node in enumerate(nodes):
        root = roots[node]
        born = lifetimes[root][0] if root in lifetimes else position
        lifetimes[root] = (born, position)
        for used in node.all_input_nodes:
            lifetimes[roots[used]] = (lifetimes[roots[used]][0], position)
    return roots, lifetimes


def replica_ranks(node: fx.Node) -> int | None:
    """The ranks a collective across the replicas of a hybrid mesh runs over (``lower_collectives_pass`` records
    ``across="replicate"`` and ``ranks`` on it); None for every other collective (over the marker's group)."""
    meta = node.meta.get("fxshard", {})
    return meta["ranks"] if meta.get("across") == "replicate" else None


def marker_args(node: fx.Node) -> dict:
    """A marker node's arguments by their schema names (``local``, ``resident``, ``fqn``, ``layout``...), defaults
    filled in."""
    schema = op_arguments(node.target)
    values = {arg.name: arg.default_value for arg in schema if arg.has_default_value()}
    values.update({arg.name: value for arg, value in zip(schema, node.args)})
    values.update(node.kwargs)
    return values


def marker_layout(node: fx.Node) -> MarkerLayout:
    """How a marker finds its parameter's full value and returns its gradient (read through its properties)."""
    return MarkerLayout(marker_args(node)["layout"])


def fxshard_meta(node: fx.Node) -> dict:
    """The node's ``meta["fxshard"]`` record, created empty if missing."""
    return node.meta.setdefault("fxshard", {})


def computed_value(target, args: tuple):
    """What ``target(*args)`` gives on the ``meta["val"]`` of the nodes among ``args`` (fake or meta tensors, whose
    mode runs the op): the value a pass gives a node it inserts, computed there rather than by a propagation over the
    whole graph (``refresh_fake_values``)."""
    values = fx.node.map_arg(args, lambda node: node.meta["val"])
    fake_mode = next((v.fake_mode for v in tree_flatten(values)[0] if isinstance(v, FakeTensor)), None)
    if fake_mode is None:  # meta tensors (``quantize.packing_nodes``)
        return target(*values)
    with fake_mode:  # dispatched by the mode on the stack: faster than through each fake argument
        return target(*values)


def replace_value(old: fx.Node, new: fx.Node) -> None:
    """Make every reader of ``old`` read ``new`` instead; where ``new``'s value is laid out otherwise (shape,
    strides, offset, dtype), each reader drops its ``meta["val"]`` for ``refresh_fake_values`` to recompute."""
    if value_layout(old.meta.get("val")) != value_layout(new.meta.get("val")):
        for reader in old.users:
            reader.meta.pop("val", None)
    old.replace_all_uses_with(new)


def refresh_fake_values(gm: fx.GraphModule) -> None:
    """Give every node a correct ``meta["val"]``, from the placeholders' fake values: a node without one (a new node)
    is computed, and so is a node reading one whose value changed shape, strides, offset or dtype; every other node
    keeps its value (recomputing them all costs as much as the rest of a pass). A pass that changes what an
    existing node computes drops that node's ``meta["val"]`` first."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    values = [p.meta.get("val") for p in placeholders]
    fake_mode = detect_fake_mode(values)
    if fake_mode is None or any(v is None for v in values):
        return
    _MissingValues(gm, mode=fake_mode).propagate_dont_convert_inputs(*values)


class _MissingValues(FakeTensorProp):
    """Fake propagation that recomputes only the nodes ``refresh_fake_values`` names."""

    def __init__(self, gm: fx.GraphModule, mode):
        super().__init__(gm, mode=mode)
        self._changed: set[fx.Node] = set()

    def run_node(self, node: fx.Node):
        kept = node.meta.get("val")
        stale = kept is None or any(i in self._changed for i in node.all_input_nodes)
        if node.op in ("placeholder", "output") or stale:
            value = super().run_node(node)
            if node.op != "output" and (kept is None or value_layout(kept) != value_layout(node.meta.get("val"))):
                self._changed.add(node)
            return value
        return kept


def value_layout(value):
    """What a value's readers depend on: each tensor's shape, strides, storage offset, dtype and device (sizes as
    text: comparing symbolic sizes themselves would add guards); any other value as text."""
    if isinstance(value, torch.Tensor):
        return (tuple(map(str, value.shape)), tuple(map(str, value.stride())), str(value.storage_offset()),
                value.dtype, value.device)
    if isinstance(value, (list, tuple)):
        return tuple(value_layout(v) for v in value)
    return str(value)


def position(graph: fx.Graph) -> dict[fx.Node, int]:
    return {node: i for i, node in enumerate(graph.nodes)}
