"""Helpers the passes share (``fxshard.passes.fx_utils``)."""

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxshard.passes.fx_utils import computed_value, refresh_fake_values, replace_value


def _scaled_sums(x):
    return (x * 2).sum(0), x + 1


def _fake_traced(fn, *shape):
    gm = fx.symbolic_trace(fn)
    FakeTensorProp(gm, mode=FakeTensorMode()).propagate(torch.randn(*shape))
    return gm, [n for n in gm.graph.nodes if n.op != "output"]


def test_refresh_fake_values_computes_new_nodes_and_readers_of_a_changed_layout_and_keeps_the_rest():
    gm, (x, mul, total, plus) = _fake_traced(_scaled_sums, 4, 6)
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


def _doubled_twice_read(x):
    doubled = x * 2
    return doubled.sum(0), doubled + 1


def _inserted_after(gm, anchor, target, *args):
    with gm.graph.inserting_after(anchor):
        node = gm.graph.call_function(target, args)
    node.meta["val"] = computed_value(target, args)
    return node


def test_a_node_a_pass_inserts_gets_its_value_in_the_graphs_fake_mode():
    gm, (x, *_) = _fake_traced(_scaled_sums, 4, 6)
    transposed = _inserted_after(gm, x, torch.ops.aten.t.default, x)
    assert transposed.meta["val"].shape == (6, 4)
    assert transposed.meta["val"].fake_mode is x.meta["val"].fake_mode


def test_a_value_replaced_by_one_laid_out_alike_keeps_its_readers_values():
    gm, (x, doubled, total, plus) = _fake_traced(_doubled_twice_read, 4, 6)
    kept = total.meta["val"], plus.meta["val"]
    tripled = _inserted_after(gm, doubled, torch.ops.aten.mul.Tensor, x, 3)
    replace_value(doubled, tripled)
    gm.graph.erase_node(doubled)
    gm.recompile()
    refresh_fake_values(gm)
    assert (total.meta["val"], plus.meta["val"]) == kept


def test_a_value_replaced_by_one_laid_out_otherwise_has_its_readers_recomputed():
    gm, (x, doubled, total, plus) = _fake_traced(_doubled_twice_read, 4, 6)
    transposed = _inserted_after(gm, doubled, torch.ops.aten.t.default, x)
    replace_value(doubled, transposed)
    gm.graph.erase_node(doubled)
    gm.recompile()
    refresh_fake_values(gm)
    assert total.meta["val"].shape == (4,)
    assert plus.meta["val"].shape == (6, 4)
