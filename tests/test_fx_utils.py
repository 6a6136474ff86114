"""Helpers the passes share (``fxshard.passes.fx_utils``)."""

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxshard.passes.fx_utils import refresh_fake_values


def _scaled_sums(x):
    return (x * 2).sum(0), x + 1


def test_refresh_fake_values_computes_new_nodes_and_readers_of_a_changed_layout_and_keeps_the_rest():
    gm = fx.symbolic_trace(_scaled_sums)
    mode = FakeTensorMode()
    FakeTensorProp(gm, mode=mode).propagate(torch.randn(4, 6))
    x, mul, total, plus = (n for n in gm.graph.nodes if n.op != "output")
    kept = plus.meta["val"]
    with gm.graph.inserting_after(x):  # a new node, and mul rewired to read it
        transposed = gm.graph.call_function(torch.t, (x,))
    mul.replace_input_with(x, transposed)
    del mul.meta["val"]  # the pass changed what mul computes
    gm.recompile()
    refresh_fake_values(gm)
    assert transposed.meta["val"].shape == (6, 4)
    assert mul.meta["val"].shape == (6, 4)
    assert total.meta["val"].shape == (4,)  # read a value whose layout changed: recomputed
    assert plus.meta["val"] is kept  # untouched
