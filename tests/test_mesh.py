"""Hybrid sharding on a 2-D mesh: 4 gloo ranks as 2 replicas of 2-rank shard groups.

Stages 1-3 shard over the "shard" dimension and average each gradient shard over the "replicate" dimension after
the reduce-scatter; stage 0 all-reduces over all four ranks. Every stage trains like one process on the global
batch; the ledger names both dimensions and equals the measured bytes.
"""

import json

import pytest
import sympy
import torch
from torch.distributed.device_mesh import init_device_mesh

import fxshard
import scenarios
from fxshard import budget
from fxshard.__main__ import main as cli
from fxshard.runtime.param import spec_of
from fxshard.testing import assert_graph_snapshot, fake_process_group
from test_numerics import STEPS, assert_matches_reference

MESH = (2, 2)  # (replicas, shard group size)
STAGES = [0, 1, 2, 3]


@pytest.fixture(scope="module")
def sgd_runs(pools):
    return {stage: pools(4).run(scenarios.train_against_reference, "gpt", "sgd", STEPS, stage=stage,
                                mesh_shape=MESH) for stage in STAGES}


@pytest.mark.parametrize("stage", STAGES)
def test_hybrid_mesh_trains_like_a_single_process(sgd_runs, stage):
    for result in sgd_runs[stage]:
        assert_matches_reference(result, "sgd")
        assert result["compiled_graphs"] == [(0, "backward"), (0, "forward"), (0, "joint")]


def test_hybrid_stage_3_with_adamw(pools):
    for result in pools(4).run(scenarios.train_against_reference, "gpt", "adamw", STEPS, stage=3, mesh_shape=MESH):
        assert_matches_reference(result, "adamw")


@pytest.mark.parametrize("stage", [2, 3])
def test_hybrid_stages_equal_stage_1_bit_for_bit(sgd_runs, stage):
    # every sharded stage averages over the shard group, then over the replicas, in the same order; stage 0 on a
    # mesh is one all-reduce over every rank: another order of the same sums
    reference = sgd_runs[1][0]["final"]
    for name, value in sgd_runs[stage][0]["final"].items():
        assert torch.equal(value, reference[name]), name


def test_each_rank_ends_with_the_same_model(sgd_runs):
    for stage in STAGES:
        first = sgd_runs[stage][0]["final"]
        for result in sgd_runs[stage][1:]:
            assert all(torch.equal(result["final"][k], v) for k, v in first.items()), stage


def test_hybrid_collectives_split_over_the_two_dimensions(sgd_runs):
    shards = MESH[1]
    for stage in (1, 2, 3):
        totals = sgd_runs[stage][0]["collectives"]
        # the replicas average what the reduce-scatter left on this rank: a 1/S share of its input, once per call
        assert totals["all_reduce"]["elements"] * shards == totals["reduce_scatter"]["elements"], stage
        assert totals["all_reduce"]["calls"] == totals["reduce_scatter"]["calls"], stage
    flat = sgd_runs[0][0]["collectives"]
    assert flat.keys() == {"all_reduce"}
    assert flat["all_reduce"]["elements"] == sgd_runs[1][0]["collectives"]["all_reduce"]["elements"] * shards \
        - _padding(sgd_runs[1][0]), "stage 0 all-reduces every gradient element over all ranks once"


def _padding(result) -> int:
    """Elements the flat shards of stage 1 add for padding (a shard group of 2: one per odd-sized parameter)."""
    return sum(-v.numel() % MESH[1] for v in result["final"].values() if v.is_floating_point())


@pytest.fixture(scope="module")
def measured_on_mesh(pools):
    return pools(4).run(scenarios.ledger_against_measurement, "chain", mesh_shape=MESH)


def test_ledger_equals_measured_bytes_on_a_mesh(measured_on_mesh):
    for rank_result in measured_on_mesh:
        for stage, result in rank_result.items():
            assert result["ledger"] == result["measured"], f"stage {stage}"


@pytest.fixture(scope="module")
def hybrid_stage_3():
    return scenarios.compiled_model("chain", 3, mesh_shape=MESH, bucket="layer")


def test_ledger_names_both_dimensions(hybrid_stage_3):
    ledger = budget.ledger(hybrid_stage_3)
    b = sympy.Symbol("b", positive=True)
    across = ledger.closed_form(ledger.communicated("all_reduce", moved=True).subs(budget.B_GRAD, b))
    assert sympy.simplify(across - 2 * b * budget.PSI / budget.N * (budget.R - 1) / budget.R) == 0, across
    within = ledger.closed_form(ledger.communicated(moved=True, ranks=budget.N).subs(
        {budget.B_PARAM: b, budget.B_GRAD: b}))
    assert sympy.simplify(within - 3 * b * budget.PSI * (budget.N - 1) / budget.N) == 0, within
    memory = ledger.closed_form(ledger.resident())
    assert budget.R not in memory.free_symbols, "replicas hold the same shards: memory depends on S alone"
    report = hybrid_stage_3.report()
    assert "N=2, R=2" in report and "all_reduce over replicas sent (ring)" in report


def test_lowered_backward_graph_with_the_two_groups(hybrid_stage_3):
    backward = next(r.final for r in hybrid_stage_3.graphs if r.kind == "backward")
    replicas = [n for n in backward.graph.nodes if n.meta.get("fxshard", {}).get("across") == "replicate"]
    assert [n.name for n in replicas] == [f"all_reduce_replicas_layers_{i}" for i in (2, 1, 0)]
    assert all(n.meta["fxshard"]["ranks"] == MESH[0] for n in replicas)
    assert_graph_snapshot(backward, """\
primals_1: f32[42]
primals_2: f32[4,7]
primals_3: f32[77]
primals_4: f32[39]
tanh: f32[4,11]
tanh_1: f32[4,13]
tangents_1: f32[4,5]
all_gather_layers_2 = c10d.all_gather_into_tensor(primals_4) -> f32[78]  # layers.2 all_gather
t_3 = aten.t(tangents_1) -> f32[5,4]
mm_3 = aten.mm(t_3, tanh_1) -> f32[5,13]
t_4 = aten.t(mm_3) -> f32[13,5]
wait_layers_2 = c10d.wait_tensor(all_gather_layers_2) -> f32[78]  # layers.2 wait
slice_tensor = aten.slice(wait_layers_2) -> f32[65]  # layers.2 copy_out
layers_2_weight = aten.view(slice_tensor) -> f32[5,13]  # layers.2 copy_out
t_2 = aten.t(layers_2_weight) -> f32[13,5]  # recomputed
t_5 = aten.t(t_2) -> f32[5,13]  # recomputed
mm_4 = aten.mm(tangents_1, t_5) -> f32[4,13]
t_6 = aten.t(t_4) -> f32[5,13]
view_default = aten.view(t_6) -> f32[65]  # layers.2 copy_in
constant_pad_nd_default = aten.constant_pad_nd(view_default) -> f32[78]  # layers.2 copy_in
reduce_scatter_layers_2 = c10d.reduce_scatter_tensor(constant_pad_nd_default) -> f32[39]  # layers.2 reduce_scatter
wait_layers_3 = c10d.wait_tensor(reduce_scatter_layers_2) -> f32[39]  # layers.2 wait
all_reduce_replicas_layers_2 = c10d.all_reduce(wait_layers_3) -> f32[39]  # layers.2 all_reduce
detach_1 = aten.detach(tanh_1) -> f32[4,13]
detach_2 = aten.detach(detach_1) -> f32[4,13]
tanh_backward = aten.tanh_backward(mm_4, detach_2) -> f32[4,13]
t_7 = aten.t(tanh_backward) -> f32[13,4]
mm_5 = aten.mm(t_7, tanh) -> f32[13,11]
t_8 = aten.t(mm_5) -> f32[11,13]
wait_replicas_layers_2 = c10d.wait_tensor(all_reduce_replicas_layers_2) -> f32[39]  # layers.2 wait
all_gather_layers_1 = c10d.all_gather_into_tensor(primals_3) -> f32[154]  # layers.1 all_gather
wait_layers_1 = c10d.wait_tensor(all_gather_layers_1) -> f32[154]  # layers.1 wait
slice_tensor_1 = aten.slice(wait_layers_1) -> f32[143]  # layers.1 copy_out
layers_1_weight = aten.view(slice_tensor_1) -> f32[13,11]  # layers.1 copy_out
t_1 = aten.t(layers_1_weight) -> f32[11,13]  # recomputed
t_9 = aten.t(t_1) -> f32[13,11]  # recomputed
mm_6 = aten.mm(tanh_backward, t_9) -> f32[4,11]
t_10 = aten.t(t_8) -> f32[13,11]
view_default_1 = aten.view(t_10) -> f32[143]  # layers.1 copy_in
constant_pad_nd_default_1 = aten.constant_pad_nd(view_default_1) -> f32[154]  # layers.1 copy_in
reduce_scatter_layers_1 = c10d.reduce_scatter_tensor(constant_pad_nd_default_1) -> f32[77]  # layers.1 reduce_scatter
wait_layers_4 = c10d.wait_tensor(reduce_scatter_layers_1) -> f32[77]  # layers.1 wait
all_reduce_replicas_layers_1 = c10d.all_reduce(wait_layers_4) -> f32[77]  # layers.1 all_reduce
detach = aten.detach(tanh) -> f32[4,11]
detach_3 = aten.detach(detach) -> f32[4,11]
tanh_backward_1 = aten.tanh_backward(mm_6, detach_3) -> f32[4,11]
wait_replicas_layers_1 = c10d.wait_tensor(all_reduce_replicas_layers_1) -> f32[77]  # layers.1 wait
all_gather_layers_0 = c10d.all_gather_into_tensor(primals_1) -> f32[84]  # layers.0 all_gather
t_11 = aten.t(tanh_backward_1) -> f32[11,4]
mm_7 = aten.mm(t_11, primals_2) -> f32[11,7]
t_12 = aten.t(mm_7) -> f32[7,11]
wait_layers_0 = c10d.wait_tensor(all_gather_layers_0) -> f32[84]  # layers.0 wait
slice_tensor_2 = aten.slice(wait_layers_0) -> f32[77]  # layers.0 copy_out
layers_0_weight = aten.view(slice_tensor_2) -> f32[11,7]  # layers.0 copy_out
t = aten.t(layers_0_weight) -> f32[7,11]  # recomputed
t_13 = aten.t(t) -> f32[11,7]  # recomputed
mm_8 = aten.mm(tanh_backward_1, t_13) -> f32[4,7]
t_14 = aten.t(t_12) -> f32[11,7]
view_default_2 = aten.view(t_14) -> f32[77]  # layers.0 copy_in
constant_pad_nd_default_2 = aten.constant_pad_nd(view_default_2) -> f32[84]  # layers.0 copy_in
reduce_scatter_layers_0 = c10d.reduce_scatter_tensor(constant_pad_nd_default_2) -> f32[42]  # layers.0 reduce_scatter
wait_layers_5 = c10d.wait_tensor(reduce_scatter_layers_0) -> f32[42]  # layers.0 wait
all_reduce_replicas_layers_0 = c10d.all_reduce(wait_layers_5) -> f32[42]  # layers.0 all_reduce
wait_replicas_layers_0 = c10d.wait_tensor(all_reduce_replicas_layers_0) -> f32[42]  # layers.0 wait
return wait_replicas_layers_0:f32[42], mm_8:f32[4,7], wait_replicas_layers_1:f32[77], wait_replicas_layers_2:f32[39]""")


def test_budget_command_splits_a_mesh(capsys):
    assert cli(["budget", "--params", "7.5e9", "--mesh", "8x8", "--format", "json"]) == 0
    rows = {row["stage"]: row for row in json.loads(capsys.readouterr().out)["stages"]}
    psi, replicas, shards, grad = 7.5e9, 8, 8, 2
    for stage in (1, 2, 3):
        assert rows[stage]["sent_replicas"] == pytest.approx(2 * grad * psi / shards * (replicas - 1) / replicas)
    assert rows[3]["sent_shard"] == pytest.approx(3 * grad * psi * (shards - 1) / shards)
    assert rows[3]["total"] == pytest.approx(16 * psi / shards)
    assert rows[0]["sent_replicas"] == 0
    assert rows[0]["sent_shard"] == pytest.approx(2 * grad * psi * (64 - 1) / 64)


@pytest.mark.parametrize("mesh_dims, problem", [
    (("dp", "tp"), "named ('replicate', 'shard')"),
    (None, "named ('replicate', 'shard')"),
])
def test_a_mesh_with_other_dimension_names_is_refused(mesh_dims, problem):
    with fake_process_group(4):
        mesh = init_device_mesh("cpu", MESH, mesh_dim_names=mesh_dims)
        with pytest.raises(fxshard.FxShardError, match=problem.replace("(", r"\(").replace(")", r"\)")):
            fxshard.backend(compiler="eager", stage=3, mesh=mesh)


def test_a_mesh_and_a_group_together_or_3_dimensions_are_refused():
    with fake_process_group(8):
        flat = init_device_mesh("cpu", (8,))
        with pytest.raises(fxshard.FxShardError, match="a group or a mesh, not both"):
            fxshard.backend(compiler="eager", stage=3, mesh=flat, group=flat.get_group())
        cube = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
        with pytest.raises(fxshard.FxShardError, match="1-D .* or 2-D"):
            fxshard.backend(compiler="eager", stage=3, mesh=cube)
        with pytest.raises(fxshard.FxShardError, match="DeviceMesh"):
            fxshard.backend(compiler="eager", stage=3, mesh=(2, 4))


def test_a_1d_mesh_is_its_group():
    with fake_process_group(2):
        mesh = init_device_mesh("cpu", (2,))
        backend = fxshard.backend(compiler="eager", stage=3, mesh=mesh)
        model, _ = backend.prepare(scenarios._ledger_model("chain"))
        spec = spec_of(next(model.parameters()))
        assert spec.world_size == 2 and spec.replicate_size == 1 and spec.replicate_group_name == ""


def test_the_simulated_step_defaults_to_the_shard_group(hybrid_stage_3, tmp_path):
    # the gathers and reduce-scatters run over the S ranks of a shard group, not over all R*S ranks
    assert hybrid_stage_3.trace(tmp_path / "step.json").world == MESH[1]


def test_the_cost_model_times_the_replicas_all_reduce_over_r_ranks(hybrid_stage_3):
    from fxshard.passes.cost_model import Machine, node_collective_seconds

    backward = next(r.final for r in hybrid_stage_3.graphs if r.kind == "backward")
    machine = Machine(latency=0.0, replicate_bandwidth=1e9)
    replicas = [n for n in backward.graph.nodes if n.meta.get("fxshard", {}).get("across") == "replicate"]
    assert len(replicas) == 3
    for node in replicas:
        shard_bytes = node.args[0].meta["val"].numel() * 4
        ring = 2 * (MESH[0] - 1) / MESH[0] * shard_bytes  # an all-reduce over R ranks, whatever the world
        assert node_collective_seconds(node, 64, machine) == pytest.approx(ring / machine.replicate_bandwidth)
