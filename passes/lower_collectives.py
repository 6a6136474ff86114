"""lower_collectives: replace the marker ops by ``_c10d_functional`` collectives, one per unit.

Assumes: a partitioned ``forward`` / ``backward`` or an ``inference`` graph whose parameters enter through
``fxshard.unshard`` markers and whose gradients leave through ``fxshard.reduce_grad`` markers, every node carrying
``meta["val"]``.
Guarantees: no marker is left, and what replaces each follows from the marker's arguments (the layout ``prepare``
chose for the stage), not from the stage itself:

- ``unshard`` with a ``resident`` full copy (stage 2) or of a full ``local`` (stage 0) becomes that tensor: no
  communication;
- the other ``unshard`` markers (stage 3) of one unit and dtype become: shards -> ``cat`` (when several) ->
  ``all_gather_into_tensor`` -> ``wait_tensor`` -> per parameter ``split_with_sizes`` / ``clone`` / ``slice``
  (drops padding) / ``view`` to the full shape (the node named after the parameter), placed where the unit's
  first marker was; a shard read twice in a unit is gathered once; with ``ctx.quantize_weights`` the flat shards
  are packed first (``passes/quantize.py``: one int8 buffer of values and fp32 block scales, nodes of role
  ``quantize``) and the gathered rows unpacked into the compute dtype (role ``dequantize``), the collective
  recording ``quantized``, ``block`` and ``row``; a row is packed only where that makes it smaller
  (``packing_saves``); a marker ``recompute_gathers`` tagged ``regather=k`` (``reshard_after_forward=k``) reads a
  secondary shard and gathers it over its group of k ranks (``all_gather_secondary_<unit>``, recording
  ``across="secondary"`` and ``ranks=k``), never packed: its bytes stay inside a node;
- ``reduce_grad`` markers of one unit, dtype and reduction become one collective placed where the unit's last
  marker was: ``reduce_scatter``: per gradient flat ``view`` -> ``constant_pad_nd`` -> ``view [world, chunk]`` ->
  ``cat`` on dim 1 -> ``reduce_scatter_tensor(avg)`` -> ``wait_tensor`` (with ``ctx.reduce_scatter_by_all_to_all``,
  on gloo: ``all_to_all_single`` -> ``wait_tensor`` -> ``view [world, chunk]`` -> ``sum`` on dim 0 -> ``div`` by the
  world size, twice as fast as gloo's own reduce-scatter, which all-reduces the whole buffer; with
  ``ctx.quantize_grads``, on any backend: the ``[world, chunk]`` rows packed -> ``all_to_all_single`` -> unpacked
  to fp32 -> ``sum`` -> ``div``, cast back to the reduce dtype) -> (hybrid sharding,
  where the markers name a replicate group: ``all_reduce(avg)`` of the shard over it, named
  ``all_reduce_replicas_<unit>`` and recording ``across="replicate"`` and ``ranks``, -> ``wait_tensor``) ->
  ``split_with_sizes`` (nodes named ``<param>_grad``);
  ``all_reduce``: flat ``view`` -> ``cat`` -> ``all_reduce(avg)`` -> ``wait_tensor`` -> ``split_with_sizes`` ->
  ``view`` to each shape. A gradient consumed before that point is reduced on its own;
  ``none`` (stage 0 under ``no_sync``) becomes the gradient itself.

A unit is ``meta["fxshard"]["bucket"]`` of the marker if a pass before set it, else the module that uses the
parameter. Every inserted node records ``meta["fxshard"] = {"unit", "role", "params"}`` and carries
``meta["val"]``, computed where it is inserted (``computed_value``; the closing ``refresh_fake_values`` recomputes
only readers of a marker whose replacement is laid out otherwise). The joint graph and the Dynamo-level optimizer
graph are returned unchanged.
"""

from __future__ import annotations

import functools
import operator
from collections import defaultdict

import torch
from torch import fx

from fxshard.runtime.collectives import COLLECTIVE_ROLES
from fxshard.runtime.ops import REDUCE_GRAD, UNSHARD
from fxshard.runtime.sharding import unit_of
from fxshard.torch_compat import c10d_functional

from .context import PassContext
from .fx_utils import (
    computed_value,
    fxshard_meta,
    marker_args,
    marker_layout,
    position,
    refresh_fake_values,
    replace_value,
)
from .quantize import QuantizedNodes, packing_saves, wire_elements

aten = torch.ops.aten
prims = torch.ops.prims
c10d = c10d_functional


def _unit_groups(markers, key=lambda m: ()) -> dict[tuple, list[fx.Node]]:
    groups: dict[tuple, list[fx.Node]] = defaultdict(list)
    for node in markers:
        unit = node.meta.get("fxshard", {}).get("bucket", unit_of(marker_args(node)["fqn"]))
        groups[(unit, node.meta["val"].dtype, _group_of(node), *key(node))].append(node)
    return groups


class _Emitter:
    """Inserts nodes that all record the same unit and parameter names."""

    def __init__(self, graph: fx.Graph, unit: str, params: list[str]):
        self.graph, self.unit, self.params = graph, unit, params

    def __call__(self, role: str, target, *args, name: str | None = None) -> fx.Node:
        # Collectives and waits are named after their unit, gathered weights after their parameter, so a printed
        # graph reads "wait_blocks_0_attn_qkv" and "blocks_0_attn_qkv_weight".
        if role in (*COLLECTIVE_ROLES, "wait") and name is None:
            name = f"{role}_{self.unit}"
        name = name and name.replace(".", "_")
        node = self.graph.create_node("call_function", target, args, name=name)
        node.meta["val"] = computed_value(target, args)
        fxshard_meta(node).update(unit=self.unit, role=role, params=self.params)
        return node


def _replace_marker(graph: fx.Graph, marker: fx.Node, value: fx.Node) -> None:
    value.meta.update({k: v for k, v in marker.meta.items() if k == "recompute"})
    replace_value(marker, value)
    graph.erase_node(marker)


def _cast(emit: _Emitter, value: fx.Node, dtype: torch.dtype | None) -> fx.Node:
    """``value`` in ``dtype`` (mixed precision), or ``value`` itself when no cast is needed."""
    if dtype is None or value.meta["val"].dtype == dtype:
        return value
    return emit("cast", prims.convert_element_type.default, value, dtype)


def _read_full(graph: fx.Graph, marker: fx.Node) -> None:
    args = marker_args(marker)
    full = args["resident"] if marker_layout(marker).reads_resident else args["local"]
    fxshard_meta(full).update(unit=unit_of(args["fqn"]), role="resident", params=[args["fqn"]])
    with graph.inserting_before(marker):
        value = _cast(_Emitter(graph, unit_of(args["fqn"]), [args["fqn"]]), full, marker.meta["val"].dtype)
    _replace_marker(graph, marker, value)


def _group_of(marker: fx.Node) -> tuple[int, str, str]:
    """(world size, group name, replicate group name) of the process groups a marker names: every graph, the
    optimizer's too, carries its own, whatever the graph's inputs are."""
    args = marker_args(marker)
    return args["world_size"], args["group_name"], args["replicate_group_name"]


def _gathered(emit: _Emitter, shards: list[fx.Node], dtype: torch.dtype, world: int, group_name: str,
              quantized: QuantizedNodes | None, regather: int | None) -> fx.Node:
    """Every rank's (concatenated) shards, flat, in ``dtype``: gathered as they are (cast to ``dtype`` first), or
    packed by ``quantized`` from their own dtype and unpacked into ``dtype``."""
    if quantized is None:
        cast = [_cast(emit, shard, dtype) for shard in shards]
    else:
        own = {s.meta["val"].dtype for s in shards}
        cast = [_cast(emit, shard, dtype if len(own) > 1 else None) for shard in shards]
    flat = cast[0] if len(cast) == 1 else emit("copy_in", aten.cat.default, cast)
    chunk = sum(s.meta["val"].numel() for s in shards)
    if quantized is not None:
        flat = quantized.pack(emit("quantize", aten.view.default, flat, [1, chunk]), (1, chunk))
    suffix = f"secondary_{emit.unit}" if regather else None  # reshard_after_forward=k: from secondary shards
    gathered = emit("all_gather", c10d.all_gather_into_tensor.default, flat, world, group_name,
                    name=suffix and f"all_gather_{suffix}")
    if regather:
        fxshard_meta(gathered).update(across="secondary", ranks=regather)
    if quantized is not None:
        fxshard_meta(gathered).update(quantized=quantized.scheme, block=quantized.block, row=chunk)
    gathered = emit("wait", c10d.wait_tensor.default, gathered, name=suffix and f"wait_{suffix}")
    if quantized is None:
        return gathered
    return emit("dequantize", aten.view.default, quantized.unpack(gathered, (world, chunk), dtype), [-1])


def _quantizer(emit: _Emitter, scheme: str | None, block: int, elements: int, element_size: int
               ) -> QuantizedNodes | None:
    """How a row of ``elements`` values is packed for its collective; None where it travels as it is (no scheme,
    or packing would not make it smaller: ``packing_saves``)."""
    if scheme is None or not packing_saves(elements, element_size, scheme, block):
        return None
    return QuantizedNodes(emit, scheme, block)


def _lower_gather(graph: fx.Graph, unit: str, markers: list[fx.Node], ctx: PassContext) -> None:
    shards = list(dict.fromkeys(m.args[0] for m in markers))
    chunks = [s.meta["val"].numel() for s in shards]
    world, group_name, _ = _group_of(markers[0])
    emit = _Emitter(graph, unit, list(dict.fromkeys(marker_args(m)["fqn"] for m in markers)))
    order = position(graph)
    anchor = min(markers, key=order.__getitem__)
    latest_input = max(shards, key=order.__getitem__)
    if order[latest_input] > order[anchor]:
        anchor = latest_input.next
    with graph.inserting_before(anchor):
        dtype = markers[0].meta["val"].dtype  # the compute dtype: shards are cast before they travel
        regather = fxshard_meta(markers[0]).get("regather")
        # unpacked, the shards travel in the compute dtype: bf16 weights gain nothing from "bf16"
        quantized = None if regather else _quantizer(emit, ctx.quantize_weights, ctx.quantize_block, sum(chunks),
                                                     dtype.itemsize)
        gathered = _gathered(emit, shards, dtype, world, group_name, quantized, regather)
        if len(shards) > 1:
            rows = emit("copy_out", aten.view.default, gathered, [world, sum(chunks)])
            split = emit("copy_out", aten.split_with_sizes.default, rows, chunks, 1)
        full_by_shard = {}
        for i, (shard, chunk) in enumerate(zip(shards, chunks)):
            marker = next(m for m in markers if m.args[0] is shard)
            args = marker_args(marker)
            numel = marker.meta["val"].numel()
            piece = gathered
            if len(shards) > 1:  # this parameter's column of the [world, chunks] buffer, made contiguous
                piece = emit("copy_out", aten.clone.default, emit("copy_out", operator.getitem, split, i))
            if numel != chunk * world:
                flat = piece if len(shards) == 1 else emit("copy_out", aten.view.default, piece, [-1])
                piece = emit("copy_out", aten.slice.Tensor, flat, 0, 0, numel)
            full_by_shard[shard] = emit("copy_out", aten.view.default, piece, list(args["full_shape"]), name=args["fqn"])
    for marker in markers:
        _replace_marker(graph, marker, full_by_shard[marker.args[0]])


def _split_late_consumers(graph: fx.Graph, markers: list[fx.Node]) -> list[list[fx.Node]]:
    """One group reduced at the last marker, plus singletons for markers whose result is consumed before it."""
    order = position(graph)
    last = max(order[m] for m in markers)
    together = [m for m in markers if all(order[u] > last for u in m.users)]
    return [together] + [[m] for m in markers if m not in together] if together else [[m] for m in markers]


def _flat(emit: _Emitter, marker: fx.Node) -> fx.Node:
    """A ``reduce_grad`` marker's gradient as a flat, contiguous tensor in the dtype it is reduced in."""
    grad = _cast(emit, marker.args[0], marker_args(marker)["reduce_dtype"])
    if not grad.meta["val"].is_contiguous():
        grad = emit("copy_in", aten.clone.default, grad)
    return grad if grad.meta["val"].dim() == 1 else emit("copy_in", aten.view.default, grad, [-1])


def _reduce_dtype(marker: fx.Node) -> torch.dtype:
    return marker_args(marker)["reduce_dtype"] or marker.args[0].meta["val"].dtype


def _lower_reduce_scatter(emit: _Emitter, markers: list[fx.Node], by_all_to_all: bool,
                          quantized: QuantizedNodes | None) -> list[fx.Node]:
    world, group_name, replicate_group_name = _group_of(markers[0])
    chunks = [m.meta["val"].numel() for m in markers]
    rows = []
    for marker, chunk in zip(markers, chunks):
        flat = _flat(emit, marker)
        padding = chunk * world - marker.args[0].meta["val"].numel()
        if padding:
            flat = emit("copy_in", aten.constant_pad_nd.default, flat, [0, padding])
        rows.append(flat if len(markers) == 1 else emit("copy_in", aten.view.default, flat, [world, chunk]))
    buffer = rows[0] if len(rows) == 1 else emit("copy_in", aten.view.default, emit("copy_in", aten.cat.default, rows, 1), [-1])
    if quantized is not None:  # each rank's rows packed, exchanged, unpacked and summed here in fp32
        shape = (world, sum(chunks))
        packed = quantized.pack(emit("quantize", aten.view.default, buffer, list(shape)), shape)
        slices = [wire_elements(shape[1], quantized.scheme, quantized.block)] * world
        received = emit("reduce_scatter", c10d.all_to_all_single.default, packed, slices, slices, group_name)
        fxshard_meta(received).update(quantized=quantized.scheme, block=quantized.block, row=shape[1])
        received = emit("wait", c10d.wait_tensor.default, received)
        summed = emit("copy_out", aten.sum.dim_IntList, quantized.unpack(received, shape, torch.float32), [0])
        reduced = _cast(emit, emit("copy_out", aten.div.Tensor, summed, world), _reduce_dtype(markers[0]))
    elif by_all_to_all:
        slices = [sum(chunks)] * world
        received = emit("reduce_scatter", c10d.all_to_all_single.default, buffer, slices, slices, group_name)
        received = emit("wait", c10d.wait_tensor.default, received)
        rows_received = emit("copy_out", aten.view.default, received, [world, sum(chunks)])
        summed = emit("copy_out", aten.sum.dim_IntList, rows_received, [0])
        reduced = emit("copy_out", aten.div.Tensor, summed, world)
    else:
        reduced = emit("reduce_scatter", c10d.reduce_scatter_tensor.default, buffer, "avg", world, group_name)
        reduced = emit("wait", c10d.wait_tensor.default, reduced)
    if replicate_group_name:  # hybrid sharding: average the shard over the ranks that hold it too
        reduced = emit("all_reduce", c10d.all_reduce.default, reduced, "avg", replicate_group_name,
                       name=f"all_reduce_replicas_{emit.unit}")
        fxshard_meta(reduced).update(across="replicate", ranks=marker_args(markers[0])["replicate_size"])
        reduced = emit("wait", c10d.wait_tensor.default, reduced, name=f"wait_replicas_{emit.unit}")
    if len(markers) == 1:
        return [_cast(emit, reduced, markers[0].meta["val"].dtype)]
    split = emit("copy_out", aten.split_with_sizes.default, reduced, chunks)
    grads = [emit("copy_out", operator.getitem, split, i, name=f"{marker_args(m)['fqn']}_grad")
             for i, m in enumerate(markers)]
    return [_cast(emit, grad, m.meta["val"].dtype) for grad, m in zip(grads, markers)]


def _lower_all_reduce(emit: _Emitter, markers: list[fx.Node]) -> list[fx.Node]:
    flats = [_flat(emit, m) for m in markers]
    buffer = flats[0] if len(flats) == 1 else emit("copy_in", aten.cat.default, flats)
    reduced = emit("all_reduce", c10d.all_reduce.default, buffer, "avg", _group_of(markers[0])[1])
    reduced = emit("wait", c10d.wait_tensor.default, reduced)
    sizes = [m.meta["val"].numel() for m in markers]
    split = emit("copy_out", aten.split_with_sizes.default, reduced, sizes) if len(markers) > 1 else None
    grads = [
        emit("copy_out", aten.view.default, reduced if split is None else emit("copy_out", operator.getitem, split, i),
             list(m.meta["val"].shape), name=f"{marker_args(m)['fqn']}_grad")
        for i, m in enumerate(markers)
    ]
    return [_cast(emit, grad, m.meta["val"].dtype) for grad, m in zip(grads, markers)]


def _lower_reduce(graph: fx.Graph, unit: str, markers: list[fx.Node], ctx: PassContext) -> None:
    order = position(graph)
    markers = sorted(markers, key=order.__getitem__)
    sites = [site for m in markers for site in m.meta.get("fxshard", {}).get("merged", [marker_args(m)["fqn"]])]
    emit = _Emitter(graph, unit, sites)
    if marker_layout(markers[0]).gradient_collective == "all_reduce":
        lower = _lower_all_reduce
    else:
        row = sum(m.meta["val"].numel() for m in markers)  # this rank's part of each rank's gradient row
        quantized = _quantizer(emit, ctx.quantize_grads, ctx.quantize_block, row, _reduce_dtype(markers[0]).itemsize)
        lower = functools.partial(_lower_reduce_scatter, by_all_to_all=ctx.reduce_scatter_by_all_to_all,
                                  quantized=quantized)
    with graph.inserting_before(markers[-1]):
        reduced = lower(emit, markers)
    for marker, grad in zip(markers, reduced):
        replace_value(marker, grad)
        graph.erase_node(marker)


def lower_collectives_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    if ctx.graph in ("joint", "optimizer"):  # markers are lowered after partitioning / functionalization
        return gm
    graph = gm.graph
    gathering = []
    for marker in list(graph.find_nodes(op="call_function", target=UNSHARD)):
        if marker_layout(marker).gathers:
            gathering.append(marker)
        else:
            _read_full(graph, marker)
    for (unit, *_), markers in _unit_groups(gathering).items():
        _lower_gather(graph, unit, markers, ctx)
    reduces = []
    for marker in list(graph.find_nodes(op="call_function", target=REDUCE_GRAD)):
        if marker_layout(marker).gradient_collective is None:  # no_sync: the gradient stays local
            args = marker_args(marker)
            with graph.inserting_before(marker):
                emit = _Emitter(graph, unit_of(args["fqn"]), [args["fqn"]])
                _replace_marker(graph, marker, _cast(emit, marker.args[0], marker.meta["val"].dtype))
        else:
            reduces.append(marker)
    by_reduction = _unit_groups(reduces, key=lambda m: (marker_layout(m).gradient_collective, _reduce_dtype(m)))
    for (unit, *_), markers in by_reduction.items():
        for group in _split_late_consumers(graph, markers):
            _lower_reduce(graph, unit, group, ctx)
    graph.lint()
    gm.recompile()
    refresh_fake_values(gm)
    return gm
