"""Behind Inductor (``compiler="inductor"``, the default): Inductor compiles the lowered forward and backward graphs
with their collectives, and training still matches a single process that sees the whole global batch at every
stage (gloo, world 2). The other tests pin ``compiler="eager"``: they test the passes' graphs, which are the same
either way, without compiling each of them with Inductor."""

import collections
import re

import pytest
import torch

from torch._inductor.utils import run_and_get_code

import fxshard
import scenarios
from fxshard.testing import rank_and_world
from test_numerics import assert_matches_reference

STEPS = 5
COLLECTIVE = re.compile(r"_c10d_functional\.(all_gather_into_tensor|all_to_all_single|wait_tensor)\.default\(")


def train_with_inductor(model_name: str) -> dict:
    """``train_against_reference`` behind Inductor, plus the collectives in each module Inductor generated."""
    result, modules = run_and_get_code(scenarios.train_against_reference, model_name, "sgd", STEPS, compiler="inductor")
    result["collectives"] = [collections.Counter(COLLECTIVE.findall(code)) for code in modules]
    return result


# The MLP only: the example GPT passes this test too, but Inductor compiles ~35 C++ kernels for it, about two
# minutes more on a cold cache on a 2-core machine.
def test_inductor_compiled_mlp_matches_single_process(pools):
    for result in pools(2).run(train_with_inductor, "mlp"):
        assert_matches_reference(result, "sgd")
        assert result["compiled_graphs"] == [(0, "backward"), (0, "forward"), (0, "joint")]
        # its two layers' segments differ: nothing to reuse, so each graph is compiled whole
        assert result["segments"] == {"forward": (0, 0), "backward": (0, 0)}
        # One generated module per graph, forward first (AOT compiles the backward at the first backward call):
        # the forward gathers, the backward re-gathers and reduce-scatters (on gloo: all-to-alls, then a sum), and
        # every collective is waited on.
        forward, backward = result["collectives"]
        assert forward["all_gather_into_tensor"] > 0 and forward["all_to_all_single"] == 0
        assert backward["all_to_all_single"] > 0
        for module in (forward, backward):
            assert module["wait_tensor"] == module["all_gather_into_tensor"] + module["all_to_all_single"]


def test_inductor_is_the_default_compiler():
    # measured faster than the eager compiler at stages 0, 1 and 3 and tied at stage 2, with less peak memory
    # (docs/benchmark.md); torch.compile's own default backend is Inductor too
    assert fxshard.backend(stage=3).compiler == "inductor"


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_inductor_trains_the_other_stages_like_a_single_process(pools, stage):
    for result in pools(2).run(scenarios.train_against_reference, "mlp", "sgd", STEPS, stage=stage,
                               compiler="inductor"):
        assert_matches_reference(result, "sgd")
        assert result["compiled_graphs"] == [(0, "backward"), (0, "forward"), (0, "joint")]


def int8_training(compiler: str) -> dict:
    """Stage 3 SGD on the MLP with int8 weights and gradients compiled by ``compiler`` (blocks of 32: its rows pack
    smaller, and end in a partial block): the losses, how many packing nodes its graphs hold, and how many modules
    Inductor generated."""
    def train() -> dict:
        torch._dynamo.reset()
        rank, world = rank_and_world()
        backend = fxshard.backend(stage=3, compiler=compiler, quantize_weights="int8", quantize_grads="int8",
                                  quantize_block=32)
        model = scenarios.build_model("mlp")
        model, opt = backend.prepare(model, scenarios.make_optimizer("sgd", model.parameters()))
        run = torch.compile(model, backend=backend, fullgraph=True)
        generator, losses = torch.Generator().manual_seed(1), []
        for _ in range(STEPS):
            batch = scenarios.global_batch("mlp", world * scenarios.PER_RANK_BATCH, generator)
            local = tuple(t[rank * scenarios.PER_RANK_BATCH:(rank + 1) * scenarios.PER_RANK_BATCH] for t in batch)
            loss = scenarios.loss_of("mlp", run, local)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        quantizing = sum(node.meta.get("fxshard", {}).get("role") == "quantize"
                      for record in backend.graphs if record.final is not None for node in record.final.graph.nodes)
        return {"losses": losses, "quantize_nodes": quantizing}

    if compiler != "inductor":
        return {**train(), "generated_modules": 0}
    result, modules = run_and_get_code(train)
    return {**result, "generated_modules": len(modules)}


def test_inductor_compiles_int8_packing_and_trains_as_the_graphs_run_op_by_op(pools):
    pool = pools(2)
    for eager, inductor in zip(pool.run(int8_training, "eager"), pool.run(int8_training, "inductor"), strict=True):
        assert eager["quantize_nodes"] > 0 and inductor["quantize_nodes"] > 0
        assert inductor["generated_modules"] == 2  # Inductor compiled forward and backward, packing inside them
        # Inductor fuses the packing into its neighbours; the values it packs and unpacks are the op-by-op ones
        assert inductor["losses"] == pytest.approx(eager["losses"], rel=1e-5)


def test_inductor_compiles_each_repeated_segment_once_and_trains_like_a_single_process(pools):
    # Thirty-two identical residual blocks at stage 3: the compute between one block's collectives and the next's
    # repeats, so each graph runs as segments between its collectives, a repeated segment compiled once
    for result in pools(2).run(scenarios.train_against_reference, "mlp_stack", "sgd", STEPS, compiler="inductor"):
        assert_matches_reference(result, "sgd")
        for kind in ("forward", "backward"):
            segments, distinct = result["segments"][kind]
            assert 0 < distinct < segments / 4, kind
