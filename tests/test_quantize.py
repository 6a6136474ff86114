"""The packing of quantized collectives (passes/quantize.py): every scheme's error within the bound its docstring
states, on rows that do not fill whole blocks, with an all-zero block, from fp32 and bf16."""

import pytest
import torch
from torch import fx

from fxshard.passes.quantize import QuantizedNodes, wire_elements


def _round_trip(values: torch.Tensor, scheme: str, block: int, dtype=torch.float32):
    """``values`` ([rows, n]) packed as a collective would send them and unpacked in ``dtype``, and the packed
    buffer's length, run as an FX graph of the nodes the lowering inserts."""
    graph = fx.Graph()
    rows = graph.placeholder("rows")
    nodes = QuantizedNodes(lambda role, target, *args: graph.call_function(target, args), scheme, block)
    packed = nodes.pack(rows, tuple(values.shape))
    graph.output((nodes.unpack(packed, tuple(values.shape), dtype), packed))
    unpacked, wire = fx.GraphModule(torch.nn.Module(), graph)(values)
    return unpacked, wire


def _rows(dtype=torch.float32):
    torch.manual_seed(0)
    values = torch.randn(3, 1000) * torch.logspace(-3, 2, 1000)  # blocks of very different magnitudes
    values[1, :256] = 0  # an all-zero block
    return values.to(dtype)


@pytest.mark.parametrize("block", [256, 100])
def test_int8_is_within_half_a_step_of_each_blocks_grid(block):
    values = _rows()
    unpacked, wire = _round_trip(values, "int8", block)
    assert wire.dtype == torch.int8 and wire.numel() == 3 * wire_elements(1000, "int8", block)
    blocks = -(-1000 // block)
    padded = torch.nn.functional.pad(values, (0, blocks * block - 1000)).view(3, blocks, block)
    step = padded.abs().amax(2, keepdim=True) / 127
    error = (torch.nn.functional.pad(unpacked - values, (0, blocks * block - 1000))).view(3, blocks, block).abs()
    assert bool((error <= step / 2 * (1 + 1e-6)).all())
    assert bool((unpacked[1, :256] == 0).all())


def test_fp8_keeps_four_bits_of_each_value():
    values = _rows()
    unpacked, wire = _round_trip(values, "fp8", 256)
    assert wire.dtype == torch.int8 and wire.numel() == 3 * wire_elements(1000, "fp8", 256)
    padded = torch.nn.functional.pad(values, (0, 24)).view(3, 4, 256)
    scale = (padded.abs().amax(2, keepdim=True) / 448).expand_as(padded).reshape(3, -1)[:, :1000]
    error = (unpacked - values).abs()
    assert bool((error <= torch.maximum(values.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_halves_the_bytes_within_half_a_unit_in_the_last_place(dtype):
    values = _rows(dtype)
    unpacked, wire = _round_trip(values, "bf16", 256, dtype)
    assert wire.dtype == torch.bfloat16 and wire.numel() == values.numel()
    assert bool(((unpacked - values).abs() <= values.abs() * 2**-8).all())


def test_bf16_gradients_are_unpacked_into_the_dtype_they_are_summed_in():
    unpacked, _ = _round_trip(_rows(torch.bfloat16), "int8", 256, torch.float32)
    assert unpacked.dtype == torch.float32


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_an_all_zero_block_stays_zero_where_denormals_are_flushed(scheme):
    # the least normal float divided by the grid's largest value is a denormal: a process that flushes denormals
    # (torch.set_flush_denormal(True), as benchmark scripts set) would read a scale of 0, and the block 0 / 0
    values = _rows()
    expected, _ = _round_trip(values, scheme, 256)
    assert torch.set_flush_denormal(True)  # x86 with SSE3: every machine the suite runs on
    try:
        unpacked, _ = _round_trip(values, scheme, 256)
    finally:
        torch.set_flush_denormal(False)
    assert bool((unpacked[1, :256] == 0).all())
    assert torch.equal(unpacked, expected)
