"""Mixed precision (``param_dtype``, ``reduce_dtype``): compute in bf16, keep fp32 masters and optimizer state,
reduce gradients in the dtype asked for."""

import pytest
import torch

import fxshard
import scenarios
from examples.models import MLP
from fxshard.report import collectives
from fxshard.testing import fake_process_group
from test_numerics import relative_error

# The reference applies the same casts on one process (an fp32 master, a bf16 copy per rank's slice, gradients
# cast to the reduce dtype and averaged), so the only freedom left is the order in which the ranks' gradients are
# summed: at world size 2 there is one order, and every stage measured bit-identical. The tolerance leaves room
# for a kernel that sees a different memory layout; a lost cast (fp32 compute, or bf16 averaging) moves the
# parameters by 1e-3 relative or more.
MIXED_PRECISION_TOLERANCE = 1e-6


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_compute_fp32_reduce_matches_same_casts_reference(pools, stage):
    for result in pools(2).run(scenarios.train_mixed_precision_against_reference, "gpt", stage):
        for name, want in result["expected"].items():
            got = result["final"][name]
            assert got.dtype == torch.float32, name  # state_dict holds the fp32 masters, full shape
            assert relative_error(got, want) <= MIXED_PRECISION_TOLERANCE, name
        assert result["loss_dtype"] == torch.bfloat16
        assert result["updated_dtypes"] == ["torch.float32"]  # the optimizer updates fp32 masters...
        assert result["state_dtypes"] == ["torch.float32"]  # ... with fp32 state
        # what forward reads between steps: stage 1 keeps its full parameters, stage 2 its resident copies in bf16
        assert result["leaf_dtypes"] == (["torch.bfloat16"] if stage == 1 else ["torch.float32"])
        assert result["resident_dtypes"] == (["torch.bfloat16"] if stage == 2 else [])


@pytest.mark.parametrize("mode", ["eager", "compiled step", "compiled loss"])
def test_eager_model_and_compiled_step_match_the_same_casts_reference(pools, mode):
    stages = [1, 2, 3] if mode == "compiled step" else [0, 1, 2, 3]  # stage 0's step has nothing to publish
    for stage in stages:
        for result in pools(2).run(scenarios.train_mixed_precision_against_reference, "mlp", stage, mode=mode):
            for name, want in result["expected"].items():
                assert relative_error(result["final"][name], want) <= MIXED_PRECISION_TOLERANCE, (stage, name)
            assert result["updated_dtypes"] == ["torch.float32"], stage
            if mode == "compiled loss":  # the inputs' cast traced inside the one graph (fullgraph=True), not apart
                assert "inference" not in result["graphs"] and result["graphs"].count("forward") == 1, stage


def test_reduce_dtype_none_averages_in_the_compute_dtype(pools):
    for result in pools(2).run(scenarios.train_mixed_precision_against_reference, "mlp", 3, torch.bfloat16, None):
        for name, want in result["expected"].items():
            assert relative_error(result["final"][name], want) <= MIXED_PRECISION_TOLERANCE, name


def test_shards_are_cast_before_they_travel_and_gradients_reduced_in_reduce_dtype():
    with fake_process_group(2):
        torch._dynamo.reset()
        backend = fxshard.backend(compiler="eager", stage=3, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model, _ = backend.prepare(MLP())
        out = torch.compile(model, backend=backend, fullgraph=True)(torch.randn(4, 8))
        out.sum().backward()
    assert out.dtype == torch.bfloat16
    assert [r.kind for r in backend.graphs] == ["joint", "forward", "backward"]  # the input cast is no graph
    graphs = {r.kind: r.final for r in backend.graphs if r.kind != "joint"}
    forward_gathers = [r for r in collectives(graphs["forward"]) if r["kind"] == "all_gather"]
    assert [r["input_bytes"] for r in forward_gathers] == [2 * 72, 2 * 51]  # bf16 shards: 2 bytes per element
    reduces = [n for n in graphs["backward"].graph.nodes if n.meta.get("fxshard", {}).get("role") == "reduce_scatter"]
    assert [n.args[0].meta["val"].dtype for n in reduces] == [torch.float32, torch.float32]
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
