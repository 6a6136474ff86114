"""Tensor parallelism beside fxshard: a model made tensor-parallel over the "tp" dimension of a (dp=2, tp=2) mesh of
4 gloo ranks (``parallelize_module``, Colwise into a block and Rowwise out of it) and prepared over "dp" trains like
one process on the whole batch at every stage, in one graph with both kinds of collectives; its checkpoints move
to and from FSDP2 + TP."""

import pytest
import torch
from torch import nn

import fxshard
import tensor_parallel_scenarios
from fxshard.testing import fake_process_group
from snapshots import assert_fxshard_snapshot
from test_mixed_precision import MIXED_PRECISION_TOLERANCE
from test_numerics import SGD_TOLERANCE, assert_matches_reference, relative_error

STAGES = [0, 1, 2, 3]
ONE_GRAPH_EACH = [(0, "backward"), (0, "forward"), (0, "joint")]


@pytest.fixture(scope="module")
def mlp_runs(pools):
    return {stage: pools(4).run(tensor_parallel_scenarios.train_against_reference, "mlp", "sgd", stage, clip=1.0)
            for stage in STAGES}


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_trains_like_one_process_with_the_gradient_norm_over_both_dimensions(mlp_runs, stage):
    for result in mlp_runs[stage]:
        assert_matches_reference(result, "sgd")
        assert result["compiled_graphs"] == ONE_GRAPH_EACH  # fullgraph, no graph break
        # DTensor's collectives run on a one-worker gloo group (fxshard's twin of the tp group): torch 2.13's gloo
        # frees a buffer twice when two collectives of a two-worker group finish together
        assert result["dtensor_collective_threads"] == [1]
        # fc2's bias is Replicate over tp: counted once in the norm, not once per tp rank
        assert all(relative_error(torch.tensor(got), torch.tensor(want)) <= SGD_TOLERANCE
                   for got, want in zip(result["norms"], result["reference_norms"], strict=True))


@pytest.fixture(scope="module")
def fsdp2_runs(pools):
    """FSDP2 + TP (``fully_shard`` over "dp", eager) on the runs below: the Llama with SGD, the MLP with AdamW."""
    return {(model, optimizer): pools(4).run(tensor_parallel_scenarios.train_against_reference, model, optimizer, None)
            for model, optimizer in (("llama_lp", "sgd"), ("mlp", "adamw"))}


def _assert_trains_as(result: dict, fsdp2: dict) -> None:
    assert result["final"].keys() == fsdp2["final"].keys()
    for name, value in fsdp2["final"].items():
        assert relative_error(result["final"][name], value) <= SGD_TOLERANCE, name
    assert any(not torch.equal(result["final"][name], value) for name, value in result["initial"].items())


@pytest.fixture(scope="module")
def llama_runs(pools):
    return pools(4).run(tensor_parallel_scenarios.train_against_reference, "llama_lp", "sgd", 3)


# torchtitan's Llama plan with sequence parallelism (the norms and the residual stream split by sequence: DTensor's
# all-gathers and reduce-scatters over tp) and loss parallelism (the logits split by vocabulary into the loss)
def test_attention_and_mlp_blocks_under_sequence_and_loss_parallelism(llama_runs, fsdp2_runs):
    for result, fsdp2 in zip(llama_runs, fsdp2_runs["llama_lp", "sgd"], strict=True):
        assert_matches_reference(result, "sgd")
        _assert_trains_as(result, fsdp2)
        assert result["compiled_graphs"] == ONE_GRAPH_EACH
        assert result["ledger"] == result["measured"]


def test_prefetch_issues_the_next_blocks_gather_across_tp_collectives(llama_runs):
    order = llama_runs[0]["forward_collectives"]
    issued, waited = order.index("all_gather_layers_1"), order.index("wait_layers_1")
    # layers.1's dp gather is in flight across DTensor's collectives of layers.0 (sequence parallelism's
    # reduce-scatter of its MLP's output is waited for in between)
    assert any(not name.startswith(("all_gather_layers", "wait_layers")) for name in order[issued + 1 : waited])


@pytest.fixture(scope="module")
def adamw_runs(pools):
    return {stage: pools(4).run(tensor_parallel_scenarios.train_against_reference, "mlp", "adamw", stage)
            for stage in STAGES}


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_with_adamw_trains_as_one_process_and_as_fsdp2_with_tensor_parallelism(adamw_runs, fsdp2_runs,
                                                                                            stage):
    for result, fsdp2 in zip(adamw_runs[stage], fsdp2_runs["mlp", "adamw"], strict=True):
        assert_matches_reference(result, "adamw")
        _assert_trains_as(result, fsdp2)
        assert result["compiled_graphs"] == ONE_GRAPH_EACH


@pytest.mark.parametrize("stage", STAGES)
def test_the_ledger_counts_dtensors_collectives_over_tp_and_equals_the_measured_bytes(adamw_runs, stage):
    for result in adamw_runs[stage]:
        assert result["ledger"] == result["measured"]
        assert "all_reduce over tp" in result["report"] and "T=2" in result["report"]


@pytest.mark.parametrize("stage", [3])
def test_a_3d_mesh_of_replicas_shards_and_tp_trains_like_one_process(pools, stage):
    # (replicate, shard, tp) = (1, 2, 2) on the 4 ranks the suite has; examples/tensor_parallel.py --mesh 2x2x2
    # runs 8 ranks (docs/tensor-parallel.md)
    for result in pools(4).run(tensor_parallel_scenarios.train_against_reference, "mlp", "sgd", stage, clip=1.0,
                               mesh_shape=(1, 2, 2)):
        assert_matches_reference(result, "sgd")
        assert result["compiled_graphs"] == ONE_GRAPH_EACH
        assert result["norms"] == pytest.approx(result["reference_norms"], rel=SGD_TOLERANCE)


def test_a_model_born_on_the_meta_device_is_initialised_piece_by_piece_as_one_process_would(pools):
    for result in pools(4).run(tensor_parallel_scenarios.train_against_reference, "mlp", "sgd", 3, born="meta"):
        assert_matches_reference(result, "sgd")


def test_gradient_accumulation_under_no_sync_trains_like_the_big_batch(pools):
    # stage 0, the one no_sync changes: gradients stay local until the last micro-batch all-reduces them
    for result in pools(4).run(tensor_parallel_scenarios.train_against_reference, "mlp", "sgd", 0, micro_batches=2):
        assert_matches_reference(result, "sgd")


@pytest.mark.parametrize("stage", [3])
def test_mixed_precision_computes_as_fsdp2_with_tensor_parallelism_does(pools, stage):
    # bf16 compute and gathers, fp32 masters and reductions; FSDP2 under the MixedPrecisionPolicy of the same dtypes
    runs = {framework: pools(4).run(tensor_parallel_scenarios.train_against_reference, "mlp", "sgd", framework,
                                    param_dtype=torch.bfloat16) for framework in (None, stage)}
    for result, fsdp2 in zip(runs[stage], runs[None], strict=True):
        for name, value in fsdp2["final"].items():
            assert result["final"][name].dtype == torch.float32, name
            assert relative_error(result["final"][name], value) <= MIXED_PRECISION_TOLERANCE, name


def test_state_dicts_hold_each_shard_on_both_dimensions_as_fsdp2_does(mlp_runs):
    # fc1 (16 x 8) is Colwise: tp splits its rows, then dp splits each tp rank's 8 rows (_StridedShard); fc2
    # (5 x 16) is Rowwise: dp splits rows, tp columns; fc2's bias is Replicate over tp and split by dp (3 + 2)
    sharded = {
        "fc1.weight": (("_S(0, 2)", "S(0)"), ("dp", "tp"), (4, 8)),
        "fc1.bias": (("_S(0, 2)", "S(0)"), ("dp", "tp"), (4,)),
        "fc2.weight": (("S(0)", "S(1)"), ("dp", "tp"), (3, 8)),
        "fc2.bias": (("S(0)", "R"), ("dp", "tp"), (3,)),
    }
    whole_over_dp = {
        "fc1.weight": (("S(0)",), ("tp",), (8, 8)),
        "fc1.bias": (("S(0)",), ("tp",), (8,)),
        "fc2.weight": (("S(1)",), ("tp",), (5, 8)),
        "fc2.bias": (("R",), ("tp",), (5,)),
    }
    for stage in STAGES:
        first_rank = mlp_runs[stage][0]
        assert first_rank["model_layout"] == (sharded if stage >= 2 else whole_over_dp), stage
        state_layout = sharded["fc1.weight"] if stage >= 1 else whole_over_dp["fc1.weight"]
        assert first_rank["optimizer_layout"] == {"momentum_buffer": state_layout}, stage


@pytest.mark.parametrize("stage", [1, 2])  # full parameters and master shards; parameter shards (as stage 3)
def test_checkpoints_move_between_fxshard_and_fsdp2_with_tensor_parallelism(pools, tmp_path, stage):
    result = pools(4).run(tensor_parallel_scenarios.checkpoints_between_fxshard_and_fsdp2, "mlp", stage,
                          str(tmp_path))[0]
    for direction in ("fxshard_from_fsdp2", "fsdp2_from_fxshard"):
        resumed, went_on = result[direction]
        assert resumed.keys() == went_on.keys()
        for name, value in went_on.items():
            assert relative_error(resumed[name], value) <= SGD_TOLERANCE, (direction, name)
    moved = [name for name, value in result["at_save"].items() if not torch.equal(value, went_on[name])]
    assert moved == list(result["at_save"]), "the steps after the save train every parameter"


@pytest.mark.parametrize("stage", [3])
def test_checkpoints_reshard_between_tensor_parallel_and_plain_data_parallel_layouts(pools, tmp_path, stage):
    # (dp=2, tp=2) -> (dp=4, no tp) -> (dp=2, tp=2): DCP reads each rank's rows of the other layout
    result = pools(4).run(tensor_parallel_scenarios.checkpoints_between_tensor_parallel_and_plain, stage,
                          str(tmp_path))[0]
    for saved, loaded in ((result["saved"], result["loaded_plain"]), (result["trained_plain"], result["loaded_back"])):
        for part_saved, part_loaded in zip(saved, loaded, strict=True):
            assert part_saved.keys() == part_loaded.keys() and part_saved
            assert all(torch.equal(value, part_loaded[key]) for key, value in part_saved.items())
    assert not torch.equal(result["trained_plain"][0]["fc1.weight"], result["saved"][0]["fc1.weight"])


# -- layouts fxshard does not compose with: refused at prepare, before anything changes ----------------------------
@pytest.fixture
def world_of_4():
    torch._dynamo.reset()
    with fake_process_group(4):
        from torch.distributed.device_mesh import init_device_mesh

        yield init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _tensor_parallel_mlp(mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from examples.models import MLP

    return parallelize_module(MLP(), mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})


def _refused(model, backend, match):
    before = list(model.named_parameters())
    with pytest.raises(fxshard.FxShardError, match=match):
        backend.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    after = list(model.named_parameters())
    assert [n for n, _ in after] == [n for n, _ in before] and all(a is b for (_, a), (_, b) in zip(after, before))
    assert not fxshard.runtime.prepare.is_prepared(model)


def test_a_tensor_parallel_model_needs_the_mesh_dimension_to_shard_over(world_of_4):
    _refused(_tensor_parallel_mlp(world_of_4), fxshard.backend(stage=3),
             r"parameter 'fc1.weight' is a DTensor with placements \(Shard\(dim=0\),\) over mesh dimensions "
             r"\('tp',\); give the backend the mesh dimension\(s\) to shard over.*mesh=mesh\[\"dp\"\]")


def test_a_dtensor_on_fxshards_own_dimension_is_refused(world_of_4):
    from torch.distributed.fsdp import fully_shard

    from examples.models import MLP

    model = fully_shard(MLP(), mesh=world_of_4["dp"])
    _refused(model, fxshard.backend(stage=3, mesh=world_of_4["dp"]),
             r"parameter 'fc1.weight' is a DTensor with placements \(Shard\(dim=0\),\) over mesh dimensions "
             r"\('dp',\), which is not a dimension of the mesh fxshard shards over beside its own")


def test_a_dtensor_over_two_mesh_dimensions_is_refused(world_of_4):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from examples.models import MLP

    model = MLP()
    model.fc1.weight = nn.Parameter(distribute_tensor(model.fc1.weight.detach(), world_of_4, [Replicate(), Shard(0)]))
    _refused(model, fxshard.backend(stage=3, mesh=world_of_4["dp"]),
             r"parameter 'fc1.weight' is a DTensor with placements \(Replicate\(\), Shard\(dim=0\)\) over mesh "
             r"dimensions \('dp', 'tp'\); fxshard composes with one tensor-parallel mesh dimension")


def test_the_compiled_step_holds_fxshards_dp_collectives_and_dtensors_tp_collective_in_one_graph():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from examples.models import MLP

    torch._dynamo.reset()
    # dimension names of its own: after an earlier test in this process made an equal mesh (the refusals above),
    # Dynamo lifts the DeviceMesh as two graph inputs instead of one
    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "tensor"))
        model = parallelize_module(MLP(), mesh["tensor"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        backend = fxshard.backend(stage=3, compiler="eager", mesh=mesh["data"])
        model, _ = backend.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        torch.compile(model, backend=backend, fullgraph=True)(torch.randn(4, 8)).sum().backward()
    graphs = {r.kind: r.final for r in backend.graphs}
    # forward: each unit's dp gather of its tp rank's pieces (fc1: 16 x 8 Colwise, 8 x 8 here; fc2: 5 x 16
    # Rowwise, 5 x 8 here), DTensor's all_reduce of fc2's partial output over tp; backward: fc2 gathered again,
    # both units' gradients reduce-scattered over dp (on gloo an all-to-all: here, a fake group, reduce_scatter)
    assert_fxshard_snapshot(graphs["forward"], """\
primals_1: f32[4,8]
primals_2: DeviceMesh
primals_3: f32[32]
primals_4: f32[4]
primals_5: f32[24]
primals_6: f32[3]
view = aten.view(primals_1) -> f32[4,8]
cat_default = aten.cat([primals_3, primals_4]) -> f32[36]  # fc1 copy_in
all_gather_fc1 = c10d.all_gather_into_tensor(cat_default) -> f32[72]  # fc1 all_gather
wait_fc1 = c10d.wait_tensor(all_gather_fc1) -> f32[72]  # fc1 wait
view_default = aten.view(wait_fc1) -> f32[2,36]  # fc1 copy_out
split_with_sizes_default = aten.split_with_sizes(view_default) -> (f32[2,32], f32[2,4])  # fc1 copy_out
getitem = getitem(split_with_sizes_default) -> f32[2,32]  # fc1 copy_out
clone_default = aten.clone(getitem) -> f32[2,32]  # fc1 copy_out
fc1_weight = aten.view(clone_default) -> f32[8,8]  # fc1 copy_out
view_1 = aten.view(fc1_weight) -> f32[8,8]  # recomputed
getitem_1 = getitem(split_with_sizes_default) -> f32[2,4]  # fc1 copy_out
clone_default_1 = aten.clone(getitem_1) -> f32[2,4]  # fc1 copy_out
fc1_bias = aten.view(clone_default_1) -> f32[8]  # fc1 copy_out
view_2 = aten.view(fc1_bias) -> f32[8]  # recomputed
t = aten.t(view_1) -> f32[8,8]  # recomputed
addmm = aten.addmm(view_2, view, t) -> f32[4,8]
view_3 = aten.view(addmm) -> f32[4,8]
relu = aten.relu(view_3) -> f32[4,8]
cat_default_1 = aten.cat([primals_5, primals_6]) -> f32[27]  # fc2 copy_in
all_gather_fc2 = c10d.all_gather_into_tensor(cat_default_1) -> f32[54]  # fc2 all_gather
view_4 = aten.view(relu) -> f32[4,8]
wait_fc2 = c10d.wait_tensor(all_gather_fc2) -> f32[54]  # fc2 wait
view_default_1 = aten.view(wait_fc2) -> f32[2,27]  # fc2 copy_out
split_with_sizes_default_1 = aten.split_with_sizes(view_default_1) -> (f32[2,24], f32[2,3])  # fc2 copy_out
getitem_2 = getitem(split_with_sizes_default_1) -> f32[2,24]  # fc2 copy_out
clone_default_2 = aten.clone(getitem_2) -> f32[2,24]  # fc2 copy_out
view_default_2 = aten.view(clone_default_2) -> f32[48]  # fc2 copy_out
slice_tensor = aten.slice(view_default_2) -> f32[40]  # fc2 copy_out
fc2_weight = aten.view(slice_tensor) -> f32[5,8]  # fc2 copy_out
view_5 = aten.view(fc2_weight) -> f32[5,8]  # recomputed
getitem_3 = getitem(split_with_sizes_default_1) -> f32[2,3]  # fc2 copy_out
clone_default_3 = aten.clone(getitem_3) -> f32[2,3]  # fc2 copy_out
view_default_3 = aten.view(clone_default_3) -> f32[6]  # fc2 copy_out
slice_tensor_1 = aten.slice(view_default_3) -> f32[5]  # fc2 copy_out
fc2_bias = aten.view(slice_tensor_1) -> f32[5]  # fc2 copy_out
view_6 = aten.view(fc2_bias) -> f32[5]  # recomputed
t_1 = aten.t(view_5) -> f32[8,5]  # recomputed
div = aten.div(view_6) -> f32[5]
addmm_1 = aten.addmm(div, view_4, t_1) -> f32[4,5]
all_reduce = c10d.all_reduce(addmm_1) -> f32[4,5]
wait_tensor = c10d.wait_tensor(all_reduce) -> f32[4,5]
view_7 = aten.view(wait_tensor) -> f32[4,5]
return view_7:f32[4,5], primals_5:f32[24], primals_6:f32[3], view:f32[4,8], relu:f32[4,8]""")
    assert_fxshard_snapshot(graphs["backward"], """\
primals_5: f32[24]
primals_6: f32[3]
view: f32[4,8]
relu: f32[4,8]
tangents_1: f32[4,5]
all_gather_fc2 = c10d.all_gather_into_tensor(primals_5) -> f32[48]  # fc2 all_gather
view_8 = aten.view(tangents_1) -> f32[4,5]
wait_fc2 = c10d.wait_tensor(all_gather_fc2) -> f32[48]  # fc2 wait
slice_tensor = aten.slice(wait_fc2) -> f32[40]  # fc2 copy_out
fc2_weight = aten.view(slice_tensor) -> f32[5,8]  # fc2 copy_out
view_5 = aten.view(fc2_weight) -> f32[5,8]  # recomputed
t_1 = aten.t(view_5) -> f32[8,5]  # recomputed
t_2 = aten.t(t_1) -> f32[5,8]  # recomputed
mm = aten.mm(view_8, t_2) -> f32[4,8]
t_3 = aten.t(view_8) -> f32[5,4]
view_4 = aten.view(relu) -> f32[4,8]
mm_1 = aten.mm(t_3, view_4) -> f32[5,8]
t_4 = aten.t(mm_1) -> f32[8,5]
sum_1 = aten.sum(view_8) -> f32[1,5]
view_9 = aten.view(sum_1) -> f32[5]
constant_pad_nd_default = aten.constant_pad_nd(view_9) -> f32[6]  # fc2 copy_in
view_default = aten.view(constant_pad_nd_default) -> f32[2,3]  # fc2 copy_in
t_5 = aten.t(t_4) -> f32[5,8]
view_default_1 = aten.view(t_5) -> f32[40]  # fc2 copy_in
constant_pad_nd_default_1 = aten.constant_pad_nd(view_default_1) -> f32[48]  # fc2 copy_in
view_default_2 = aten.view(constant_pad_nd_default_1) -> f32[2,24]  # fc2 copy_in
cat_default = aten.cat([view_default, view_default_2]) -> f32[2,27]  # fc2 copy_in
view_default_3 = aten.view(cat_default) -> f32[54]  # fc2 copy_in
reduce_scatter_fc2 = c10d.reduce_scatter_tensor(view_default_3) -> f32[27]  # fc2 reduce_scatter
detach = aten.detach(relu) -> f32[4,8]
detach_1 = aten.detach(detach) -> f32[4,8]
threshold_backward = aten.threshold_backward(mm, detach_1) -> f32[4,8]
view_10 = aten.view(threshold_backward) -> f32[4,8]
t_6 = aten.t(view_10) -> f32[8,4]
mm_2 = aten.mm(t_6, view) -> f32[8,8]
t_7 = aten.t(mm_2) -> f32[8,8]
sum_2 = aten.sum(view_10) -> f32[1,8]
view_11 = aten.view(sum_2) -> f32[8]
view_default_4 = aten.view(view_11) -> f32[2,4]  # fc1 copy_in
t_8 = aten.t(t_7) -> f32[8,8]
wait_fc2_1 = c10d.wait_tensor(reduce_scatter_fc2) -> f32[27]  # fc2 wait
split_with_sizes_default = aten.split_with_sizes(wait_fc2_1) -> (f32[3], f32[24])  # fc2 copy_out
fc2_bias_grad = getitem(split_with_sizes_default) -> f32[3]  # fc2 copy_out
fc2_weight_grad = getitem(split_with_sizes_default) -> f32[24]  # fc2 copy_out
view_default_5 = aten.view(t_8) -> f32[64]  # fc1 copy_in
view_default_6 = aten.view(view_default_5) -> f32[2,32]  # fc1 copy_in
cat_default_1 = aten.cat([view_default_4, view_default_6]) -> f32[2,36]  # fc1 copy_in
view_default_7 = aten.view(cat_default_1) -> f32[72]  # fc1 copy_in
reduce_scatter_fc1 = c10d.reduce_scatter_tensor(view_default_7) -> f32[36]  # fc1 reduce_scatter
wait_fc1 = c10d.wait_tensor(reduce_scatter_fc1) -> f32[36]  # fc1 wait
split_with_sizes_default_1 = aten.split_with_sizes(wait_fc1) -> (f32[4], f32[32])  # fc1 copy_out
fc1_bias_grad = getitem(split_with_sizes_default_1) -> f32[4]  # fc1 copy_out
fc1_weight_grad = getitem(split_with_sizes_default_1) -> f32[32]  # fc1 copy_out
return -, -, fc1_weight_grad:f32[32], fc1_bias_grad:f32[4], fc2_weight_grad:f32[24], fc2_bias_grad:f32[3]""")
