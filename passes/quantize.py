"""Quantized collectives: the nodes that pack a buffer into fewer bytes before it travels and unpack it after
(ZeRO++'s qwZ and qgZ), used by ``lower_collectives_pass`` where ``quantize_weights`` / ``quantize_grads`` ask.

Schemes (``SCHEMES``):
- ``"bf16"``: a cast; half the bytes of fp32, relative error <= 2^-8 per element (half a unit in the last place);
- ``"int8"``: blockwise symmetric: each block of ``block`` elements is sent as int8 ``round(x / s)`` with its fp32
  scale ``s = max|x| / 127``; a quarter of fp32's bytes plus 4 / ``block`` bytes of scale per element, error
  <= s / 2 per element (half a step of its block's grid);
- ``"fp8"``: blockwise float8_e4m3fn, ``s = max|x| / 448``; the same bytes as int8, relative error <= 2^-4 per
  element, and at most 2^-10 s for the smallest (|x| < 2^-6 s, float8's subnormals).

A row is packed only where that makes it smaller (``packing_saves``): a unit much smaller than a block (a bias
of a few elements per rank) travels as it is. A quantized buffer travels as ONE int8 tensor (values then their scales' bytes) so a collective moves it once: gloo
takes no float8 and a second collective for the scales would pay its latency again. Every node here is plain ATen
(``view.dtype`` is a bitcast), so Inductor fuses the packing into the producer and the unpacking into the consumer.
"""

from __future__ import annotations

import torch
from torch import fx

from .fx_utils import computed_value

aten = torch.ops.aten
prims = torch.ops.prims

SCHEMES = ("bf16", "int8", "fp8")
GRAD_SCHEMES = ("bf16", "int8")
DEFAULT_QUANTIZE_BLOCK = 256  # elements per scale: 1.6% of int8's bytes go to scales
_LARGEST = {"int8": 127.0, "fp8": 448.0}
_WIRE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def wire_elements(elements: int, scheme: str, block: int) -> int:
    """The int8 elements a row of ``elements`` values travels as (values padded to whole blocks, then 4 bytes of
    scale per block); for ``"bf16"`` the bf16 elements."""
    if scheme == "bf16":
        return elements
    blocks = -(-elements // block)
    return blocks * block + 4 * blocks


def scales_per_row(elements: int, block: int) -> int:
    return -(-elements // block)


def wire_bytes(elements: int, scheme: str, block: int) -> int:
    """Bytes a row of ``elements`` values travels as, packed as ``scheme``."""
    return wire_elements(elements, scheme, block) * (2 if scheme == "bf16" else 1)


def packing_saves(elements: int, element_size: int, scheme: str, block: int) -> bool:
    """Whether a row of ``elements`` values of ``element_size`` bytes is smaller packed: a row much shorter than a
    block is not (its padding and scale outweigh it), nor bf16 values packed as bf16."""
    return wire_bytes(elements, scheme, block) < elements * element_size


def packed_rows_bytes(row: int, rows: int, element_size: int, scheme: str, block: int) -> int | None:
    """Bytes ``rows`` rows of ``row`` values of ``element_size`` bytes travel as, packed as ``scheme`` (each row
    padded to whole blocks, with its scales); None where packing would not make a row smaller (it travels as it
    is). The one pricing of the wire options' bytes: the simulator's per collective, the ledger's per term."""
    if not packing_saves(row, element_size, scheme, block):
        return None
    return rows * wire_bytes(row, scheme, block)


class QuantizedNodes:
    """Emits the packing and unpacking nodes through ``emit(role, target, *args)`` (``lower_collectives``'s
    emitter: every node records its unit and role)."""

    def __init__(self, emit, scheme: str, block: int):
        self.emit, self.scheme, self.block = emit, scheme, block

    def pack(self, rows: fx.Node, shape: tuple[int, int]) -> fx.Node:
        """``rows`` ([r, n] floats) as the flat buffer that travels: bf16, or int8 values and scale bytes per row."""
        emit = self.emit
        if self.scheme == "bf16":
            bf16 = emit("quantize", prims.convert_element_type.default, rows, torch.bfloat16)
            return emit("quantize", aten.view.default, bf16, [-1])
        count, elements = shape
        blocks = scales_per_row(elements, self.block)
        padded = rows
        if blocks * self.block != elements:
            padded = emit("quantize", aten.constant_pad_nd.default, rows, [0, blocks * self.block - elements])
        grid = emit("quantize", aten.view.default, padded, [count, blocks, self.block])
        largest = emit("quantize", aten.amax.default, emit("quantize", aten.abs.default, grid), [2], True)
        # an all-zero block gets the least normal scale: its values quantize to 0 either way, and nothing is 0 / 0.
        # Clamped after the division: the least normal float divided by 127 or 448 is a denormal, which a process
        # that flushes denormals (torch.set_flush_denormal) reads as 0
        scale = emit("quantize", aten.div.Tensor, largest, _LARGEST[self.scheme])
        scale = emit("quantize", aten.clamp_min.default, scale, torch.finfo(torch.float32).tiny)
        scaled = emit("quantize", aten.div.Tensor, grid, scale)
        if self.scheme == "int8":
            rounded = emit("quantize", aten.round.default, scaled)  # clamp_min / clamp_max: Inductor lowers them
            scaled = emit("quantize", aten.clamp_max.default, emit("quantize", aten.clamp_min.default, rounded, -127), 127)
        values = emit("quantize", prims.convert_element_type.default, scaled, _WIRE[self.scheme])
        if self.scheme == "fp8":
            values = emit("quantize", aten.view.dtype, values, torch.int8)
        values = emit("quantize", aten.view.default, values, [count, blocks * self.block])
        scale_bytes = emit("quantize", aten.view.dtype,
                           emit("quantize", prims.convert_element_type.default,
                                emit("quantize", aten.view.default, scale, [count, blocks]), torch.float32),
                           torch.int8)
        packed = emit("quantize", aten.cat.default, [values, scale_bytes], 1)
        return emit("quantize", aten.view.default, packed, [-1])

    def unpack(self, received: fx.Node, shape: tuple[int, int], dtype: torch.dtype) -> fx.Node:
        """The [r, n] values in ``dtype`` that ``received`` (r packed rows, as ``pack`` made them) carries."""
        emit = self.emit
        count, elements = shape
        if self.scheme == "bf16":
            rows = emit("dequantize", aten.view.default, received, [count, elements])
            return emit("dequantize", prims.convert_element_type.default, rows, dtype)
        blocks = scales_per_row(elements, self.block)
        rows = emit("dequantize", aten.view.default, received, [count, blocks * self.block + 4 * blocks])
        values = emit("dequantize", aten.slice.Tensor, rows, 1, 0, blocks * self.block)
        scale_bytes = emit("dequantize", aten.clone.default,
                           emit("dequantize", aten.slice.Tensor, rows, 1, blocks * self.block, None))
        scale = emit("dequantize", aten.view.dtype, scale_bytes, torch.float32)
        if self.scheme == "fp8":
            values = emit("dequantize", aten.view.dtype, values, torch.float8_e4m3fn)
        grid = emit("dequantize", aten.view.default,
                    emit("dequantize", prims.convert_element_type.default, values, torch.float32),
                    [count, blocks, self.block])
        scaled = emit("dequantize", aten.mul.Tensor, grid, emit("dequantize", aten.view.default, scale,
                                                                 [count, blocks, 1]))
        return self._unpadded(scaled, shape, dtype)

    def _unpadded(self, grid: fx.Node, shape: tuple[int, int], dtype: torch.dtype) -> fx.Node:
        """The [r, n] values of ``grid`` ([r, blocks, block] fp32) in ``dtype``, the last block's padding dropped, a
        tensor of its own. Not a view of the grid as [r, blocks x block] sliced to n: Inductor (torch 2.13, 2.15)
        compiles that crop of a merged view into a loop over whole blocks only (n // block of them), and the rest of
        each row is never written. The whole blocks and the last one's values are cut apart and joined instead."""
        emit = self.emit

        def as_dtype(values: fx.Node) -> fx.Node:
            return values if dtype == torch.float32 else emit("dequantize", prims.convert_element_type.default,
                                                              values, dtype)

        count, elements = shape
        blocks = scales_per_row(elements, self.block)
        whole = (blocks - 1) * self.block
        if whole + self.block == elements:
            return as_dtype(emit("dequantize", aten.view.default, grid, [count, elements]))
        last = emit("dequantize", aten.slice.Tensor, emit("dequantize", aten.select.int, grid, 1, blocks - 1),
                    1, 0, elements - whole)
        if blocks == 1:  # a strided slice: copied
            return emit("dequantize", prims.convert_element_type.default, last, dtype)
        before = emit("dequantize", aten.view.default,
                      emit("dequantize", aten.slice.Tensor, grid, 1, 0, blocks - 1), [count, whole])
        return as_dtype(emit("dequantize", aten.cat.default, [before, last], 1))


def packing_nodes(scheme: str, block: int, rows: int, elements: int, received_rows: int, dtype: torch.dtype,
                  unpacked_dtype: torch.dtype) -> list[fx.Node]:
    """The nodes that pack ``rows`` x ``elements`` values of ``dtype`` and unpack ``received_rows`` such packed rows
    into ``unpacked_dtype``, as ``lower_collectives`` emits them, on a graph of their own, each carrying
    ``meta["val"]`` (a meta tensor) and its role (``quantize`` or ``dequantize``): what an option's packing costs a
    graph compiled without it."""
    graph = fx.Graph()

    def emit(role, target, *args, name=None):
        node = graph.call_function(target, args)
        node.meta["val"] = computed_value(target, args)
        node.meta["fxshard"] = {"role": role}
        return node

    def placeholder(name: str, value: torch.Tensor) -> fx.Node:
        node = graph.placeholder(name)
        node.meta["val"] = value
        return node

    quantized = QuantizedNodes(emit, scheme, block)
    quantized.pack(placeholder("rows", torch.empty(rows, elements, dtype=dtype, device="meta")), (rows, elements))
    wire_dtype = torch.bfloat16 if scheme == "bf16" else torch.int8
    received = placeholder("received", torch.empty(received_rows * wire_elements(elements, scheme, block),
                                                   dtype=wire_dtype, device="meta"))
    quantized.unpack(received, (received_rows, elements), unpacked_dtype)
    return [node for node in graph.nodes if node.op == "call_function"]

