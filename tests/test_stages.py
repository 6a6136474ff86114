"""ZeRO stages 0-3: the same numbers, the collectives and the resident memory each stage promises."""

import pytest
import torch

import scenarios
from test_numerics import STEPS, assert_matches_reference

STAGES = [0, 1, 2, 3]


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("model", ["gpt", "mlp_uneven"])
def test_stage_matches_single_process_at_world_3(pools, stage, model):
    # stage 3 runs these cases in test_numerics.py; world size 2 and AdamW below
    for result in pools(3).run(scenarios.train_against_reference, model, "sgd", STEPS, stage=stage):
        assert_matches_reference(result, "sgd")
        assert result["compiled_graphs"] == [(0, "backward"), (0, "forward"), (0, "joint")]


@pytest.fixture(scope="module")
def gpt_runs_world2(pools):
    return {s: pools(2).run(scenarios.train_against_reference, "gpt", "adamw", STEPS, stage=s)[0] for s in STAGES}


@pytest.mark.parametrize("stage", STAGES)
def test_stage_matches_single_process_with_adamw_at_world_2(gpt_runs_world2, stage):
    assert_matches_reference(gpt_runs_world2[stage], "adamw")
    assert gpt_runs_world2[stage]["compiled_graphs"] == [(0, "backward"), (0, "forward"), (0, "joint")]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stages_equal_stage_0_bit_for_bit_at_world_2(gpt_runs_world2, stage):
    # Two ranks' gradients are summed in the same order by every stage (tied weights: merge_tied_grads_pass),
    # and AdamW on a flat shard does the same elementwise arithmetic as on the full tensor.
    reference = gpt_runs_world2[0]["final"]
    for name, value in gpt_runs_world2[stage]["final"].items():
        assert torch.equal(value, reference[name]), name


def test_uncompiled_stages_match_single_process(pools):
    for stage in [0, 1, 2]:
        for result in pools(2).run(scenarios.train_against_reference, "gpt", "sgd", STEPS, compiled=False,
                                   stage=stage):
            assert_matches_reference(result, "sgd")


@pytest.fixture(scope="module")
def gpt_steps(gpt_runs_world2):
    """Each stage's last AdamW step: the collectives it ran and the state each rank held."""
    return {s: {**run["state_bytes"], "collectives": run["collectives"], "world_size": run["world_size"]}
            for s, run in gpt_runs_world2.items()}


def test_stage_0_all_reduces_every_gradient_once(gpt_steps):
    result = gpt_steps[0]
    assert result["collectives"].keys() == {"all_reduce"}
    assert result["collectives"]["all_reduce"]["elements"] == result["psi"]  # ring all-reduce moves 2 * that


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_and_2_reduce_scatter_and_all_gather_psi(gpt_steps, stage):
    result = gpt_steps[stage]
    totals, world = result["collectives"], result["world_size"]
    assert totals.keys() == {"reduce_scatter", "all_gather"}
    assert totals["reduce_scatter"]["elements"] == result["psi_padded"]
    assert totals["all_gather"]["elements"] * world == result["psi_padded"]  # each rank contributes its shard


def test_stage_1_communicates_at_the_step_and_stage_2_per_unit_in_backward(gpt_steps):
    # in optimizer.step(): the GPT's 28 gradients (the tied embedding's once) fit one step bucket (25 MiB)
    assert gpt_steps[1]["collectives"]["reduce_scatter"]["calls"] == 1
    units = 3  # the default grouping ("auto"): blocks.0, blocks.1 and the model itself (embeddings, ln_f, head)
    assert gpt_steps[2]["collectives"]["reduce_scatter"]["calls"] == units  # in the backward graph


def test_stage_3_gathers_per_unit_twice_and_reduce_scatters_once(gpt_steps):
    totals = gpt_steps[3]["collectives"]
    # the default grouping ("auto"): blocks.0, blocks.1 and the model itself (embeddings, the tied head, ln_f).
    # Forward gathers each unit once, backward each again (every unit holds a weight its backward reads); one
    # reduce-scatter per unit. Per layer (bucket="layer"): tests/test_bucket.py and tests/test_graphs.py.
    assert totals["all_gather"]["calls"] == 3 + 3
    assert totals["reduce_scatter"]["calls"] == 3
    assert totals["reduce_scatter"]["elements"] == gpt_steps[3]["psi_padded"]


def test_resident_memory_per_stage(gpt_steps):
    psi, shard = gpt_steps[0]["psi_bytes"], gpt_steps[0]["shard_bytes"]
    expected = {  # (params, resident copies, grads after backward, optimizer params, optimizer state (m, v))
        0: (psi, 0, psi, psi, 2 * psi),
        1: (psi, 0, psi, shard, 2 * shard),  # the optimizer's params are the fp32 master shards
        2: (shard, psi, shard, shard, 2 * shard),
        3: (shard, 0, shard, shard, 2 * shard),
    }
    for stage, want in expected.items():
        r = gpt_steps[stage]
        got = (r["params"], r["resident_copies"], r["grads_after_backward"], r["optimizer_params"], r["optimizer_state"])
        assert got == want, f"stage {stage}"


@pytest.fixture(scope="module")
def accumulation_runs(pools):
    return {s: pools(2).run(scenarios.accumulate_against_reference, s, 3)[0] for s in STAGES}


@pytest.mark.parametrize("stage", STAGES)
def test_gradient_accumulation_matches_the_big_batch(accumulation_runs, stage):
    result = accumulation_runs[stage]
    assert_matches_reference(result, "sgd")
    # no_sync is a guard Dynamo checks: stage 0 compiles one graph pair for it and never needed the synced one
    assert result["compiled_graphs"] == [(0, "backward"), (0, "forward"), (0, "joint")]


def test_gradient_accumulation_communicates_as_each_stage_promises(accumulation_runs):
    calls = {s: {kind: t["calls"] for kind, t in r["collectives"].items()} for s, r in accumulation_runs.items()}
    units, micro_batches = 3, 3  # the default grouping: two blocks and the model itself
    assert calls[0] == {"all_reduce": 1}  # once per step, at optimizer.step(): one step bucket
    assert calls[1] == {"reduce_scatter": 1, "all_gather": 1}  # once per step: one step bucket each
    assert calls[2] == {"reduce_scatter": micro_batches * units, "all_gather": 1}  # every micro-batch
    assert calls[3] == {"all_gather": micro_batches * 2 * units, "reduce_scatter": micro_batches * units}
