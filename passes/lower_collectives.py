"""lower_collectives: replace the marker ops by ``_c10d_functional`` collectives, one per unit.

Assumes: a partitioned ``forward`` / ``backward`` or an ``inference`` graph whose parameters enter as flat shards
through ``fxshard.unshard`` markers and whose shard gradients leave through ``fxshard.reduce_grad`` markers, every
node carrying ``meta["val"]``.
Guarantees: no marker is left. The markers of one unit (``meta["fxshard"]["bucket"]`` if a pass before set it,
else the module that uses the parameter) and dtype become:

- gather: shards -> ``cat`` (when several) -> ``all_gather_into_tensor`` -> ``wait_tensor`` -> per parameter
  ``split_with_sizes`` / ``clone`` / ``slice`` (drops padding) / ``view`` to the full shape, placed where the unit's
  first marker was; a shard read twice in a unit is gathered once;
- reduce: per gradient ``view`` (flat) -> ``constant_pad_nd`` -> ``view [world, chunk]`` -> ``cat`` on dim 1 (when
  several) -> ``reduce_scatter_tensor(avg)`` -> ``wait_tensor`` -> ``split_with_sizes``, placed where the unit's
  last marker was. A gradient whose shard is consumed before that point is reduced on its own.

Every inserted node records ``meta["fxshard"] = {"unit", "role", "params"}`` and carries ``meta["val"]``. The joint
graph is returned unchanged.
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch
from torch import fx

from fxshard.ops import REDUCE_GRAD, UNSHARD

from .context import PassContext
from .fx_utils import fxshard_meta, position, refresh_fake_values, unit_of

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _marker_groups(graph: fx.Graph, target) -> dict[tuple[str, torch.dtype], list[fx.Node]]:
    groups: dict[tuple[str, torch.dtype], list[fx.Node]] = defaultdict(list)
    for node in graph.find_nodes(op="call_function", target=target):
        fqn = node.args[-1]
        unit = node.meta.get("fxshard", {}).get("bucket", unit_of(fqn))
        groups[(unit, node.meta["val"].dtype)].append(node)
    return groups


class _Emitter:
    """Inserts nodes that all record the same unit and parameter names."""

    def __init__(self, graph: fx.Graph, unit: str, params: list[str]):
        self.graph, self.unit, self.params = graph, unit, params

    def __call__(self, role: str, target, *args, name: str | None = None) -> fx.Node:
        # Collectives and waits are named after their unit, gathered weights after their parameter, so a printed
        # graph reads "wait_blocks_0_attn_qkv" and "blocks_0_attn_qkv_weight".
        if role in ("all_gather", "reduce_scatter", "wait"):
            name = f"{role}_{self.unit}"
        name = name and name.replace(".", "_")
        node = self.graph.create_node("call_function", target, args, name=name)
        fxshard_meta(node).update(unit=self.unit, role=role, params=self.params)
        return node


def _lower_gather(graph: fx.Graph, unit: str, markers: list[fx.Node], ctx: PassContext) -> None:
    shards = list(dict.fromkeys(m.args[0] for m in markers))
    chunks = [s.meta["val"].numel() for s in shards]
    world = ctx.world_size
    emit = _Emitter(graph, unit, list(dict.fromkeys(m.args[-1] for m in markers)))
    order = position(graph)
    anchor = min(markers, key=order.__getitem__)
    latest_input = max(shards, key=order.__getitem__)
    if order[latest_input] > order[anchor]:
        anchor = latest_input.next
    with graph.inserting_before(anchor):
        flat = shards[0] if len(shards) == 1 else emit("copy_in", aten.cat.default, shards)
        gathered = emit("all_gather", c10d.all_gather_into_tensor.default, flat, world, ctx.group_name)
        gathered = emit("wait", c10d.wait_tensor.default, gathered)
        if len(shards) > 1:
            rows = emit("copy_out", aten.view.default, gathered, [world, sum(chunks)])
            split = emit("copy_out", aten.split_with_sizes.default, rows, chunks, 1)
        full_by_shard = {}
        for i, (shard, chunk) in enumerate(zip(shards, chunks)):
            marker = next(m for m in markers if m.args[0] is shard)
            numel = marker.meta["val"].numel()
            piece = gathered
            if len(shards) > 1:  # this parameter's column of the [world, chunks] buffer, made contiguous
                piece = emit("copy_out", aten.clone.default, emit("copy_out", operator.getitem, split, i))
            if numel != chunk * world:
                flat = piece if len(shards) == 1 else emit("copy_out", aten.view.default, piece, [-1])
                piece = emit("copy_out", aten.slice.Tensor, flat, 0, 0, numel)
            full_by_shard[shard] = emit("copy_out", aten.view.default, piece, list(marker.args[1]), name=marker.args[-1])
    for marker in markers:
        full = full_by_shard[marker.args[0]]
        full.meta.update({k: v for k, v in marker.meta.items() if k in ("recompute", "stack_trace", "nn_module_stack")})
        marker.replace_all_uses_with(full)
        graph.erase_node(marker)


def _split_late_consumers(graph: fx.Graph, markers: list[fx.Node]) -> list[list[fx.Node]]:
    """One group reduced at the last marker, plus singletons for markers whose shard is consumed before it."""
    order = position(graph)
    last = max(order[m] for m in markers)
    together = [m for m in markers if all(order[u] > last for u in m.users)]
    return [together] + [[m] for m in markers if m not in together] if together else [[m] for m in markers]


def _lower_reduce(graph: fx.Graph, unit: str, markers: list[fx.Node], ctx: PassContext) -> None:
    world = ctx.world_size
    order = position(graph)
    markers = sorted(markers, key=order.__getitem__)
    emit = _Emitter(graph, unit, [m.args[-1] for m in markers])
    chunks = [m.meta["val"].numel() for m in markers]
    with graph.inserting_before(markers[-1]):
        rows = []
        for marker, chunk in zip(markers, chunks):
            grad = marker.args[0]
            if not grad.meta["val"].is_contiguous():
                grad = emit("copy_in", aten.clone.default, grad)
            flat = grad if grad.meta["val"].dim() == 1 else emit("copy_in", aten.view.default, grad, [-1])
            padding = chunk * world - grad.meta["val"].numel()
            if padding:
                flat = emit("copy_in", aten.constant_pad_nd.default, flat, [0, padding])
            rows.append(flat if len(markers) == 1 else emit("copy_in", aten.view.default, flat, [world, chunk]))
        buffer = rows[0] if len(rows) == 1 else emit("copy_in", aten.view.default, emit("copy_in", aten.cat.default, rows, 1), [-1])
        reduced = emit("reduce_scatter", c10d.reduce_scatter_tensor.default, buffer, "avg", world, ctx.group_name)
        reduced = emit("wait", c10d.wait_tensor.default, reduced)
        if len(markers) == 1:
            shard_grads = [reduced]
        else:
            split = emit("copy_out", aten.split_with_sizes.default, reduced, chunks)
            shard_grads = [emit("copy_out", operator.getitem, split, i, name=f"{m.args[-1]}_grad") for i, m in enumerate(markers)]
    for marker, shard_grad in zip(markers, shard_grads):
        marker.replace_all_uses_with(shard_grad)
        graph.erase_node(marker)


def lower_collectives_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.graph == "joint":
        return gm
    graph = gm.graph
    for (unit, _), markers in _marker_groups(graph, UNSHARD).items():
        _lower_gather(graph, unit, markers, ctx)
    for (unit, _), markers in _marker_groups(graph, REDUCE_GRAD).items():
        for group in _split_late_consumers(graph, markers):
            _lower_reduce(graph, unit, group, ctx)
    graph.lint()
    gm.recompile()
    refresh_fake_values(gm)
    return gm
