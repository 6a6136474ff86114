"""Stage 3 keeps only shards resident: no full weight is stored, saved for backward, or alive between steps."""

import weakref

import pytest
import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

import scenarios
from fxshard.passes.fx_utils import storage_lifetimes
from fxshard.torch_compat import boxed_freeing_inputs


@pytest.fixture(scope="module")
def default_run(pools):
    return pools(2).run(scenarios.memory_of_training)


def test_resident_state_is_shards_only(default_run):
    for result in default_run:
        for name, (nbytes, shard_bytes) in result["storage"].items():
            assert nbytes == shard_bytes, name  # the parameter's rows are a view of its padded flat shard, no more
        shard_shapes = set(result["flat_shard_shapes"].values())
        assert all(len(shape) == 1 for shape in shard_shapes)
        assert result["optimizer_state_shapes"] <= shard_shapes  # AdamW's m and v are flat shards too


def test_no_full_weight_alive_between_steps(default_run):
    for result in default_run:
        assert result["alive_full_weights"] == []


def test_forward_saves_no_full_weight_for_backward(default_run):
    for result in default_run:
        assert result["saved_full_weights"] == []


def test_reshard_after_forward_false_keeps_gathered_weights_for_backward(pools):
    # The check above can fail: without resharding (no recompute tags) the partitioner saves gathered weights.
    for result in pools(2).run(scenarios.memory_of_training, reshard_after_forward=False):
        assert "blocks.0.fc.weight" in result["saved_full_weights"]
        assert result["alive_full_weights"] == []  # ... but only from forward to backward


def _saved_then_more_work(saved, incoming):
    scaled = saved * 2
    flat = scaled.view(-1)  # shares scaled's storage: keeps it alive to its own last reader
    summed = flat.sum() + incoming
    return summed * 3, flat


def test_a_tensor_lives_from_its_maker_to_its_last_reader_and_a_returned_one_to_the_output():
    graph = make_fx(_saved_then_more_work)(torch.ones(2, 2), torch.ones(())).graph  # aten ops: views known
    nodes = list(graph.nodes)
    at = {node.name: position for position, node in enumerate(nodes)}
    roots, lifetimes = storage_lifetimes(nodes)
    assert lifetimes[nodes[at["saved_1"]]] == (at["saved_1"], at["mul"])  # an input dies at its last reader
    assert roots[nodes[at["view"]]] is nodes[at["mul"]]
    assert lifetimes[nodes[at["mul"]]] == (at["mul"], at["output"])  # returned through its view
    assert lifetimes[nodes[at["sum_1"]]] == (at["sum_1"], at["add"])


_probed: dict = {}


@fx.wrap
def _first_input_alive(value):
    _probed["alive"] = _probed["first"]() is not None
    return value


def _reads_its_first_input_once(first, second):
    return _first_input_alive(first + 1) * second


def test_the_eager_compiler_frees_a_graph_input_after_its_last_reader():
    # as Inductor's graphs do: a backward's saved activations must not outlive their last reader, or the ledger's
    # peak (which frees them there) would understate the eager compiler's
    run = boxed_freeing_inputs(fx.symbolic_trace(_reads_its_first_input_once))
    args = [torch.ones(4), torch.full((4,), 2.0)]
    _probed["first"] = weakref.ref(args[0])
    assert torch.equal(run(args), torch.full((4,), 4.0))
    assert args == [] and _probed["alive"] is False
