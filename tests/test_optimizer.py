"""The optimizer prepare returns: clipping across shards, checkpoints, and refusing optimizers that would train
silently wrong."""

import pytest
import torch

import fxshard
import scenarios
from examples.models import MLP
from fxshard.runtime.param import prepared_param, spec_of
from fxshard.runtime.optimizer_record import updating_optimizer
from fxshard.runtime.sharding import shard_of
from fxshard.testing import fake_process_group, graph_summary
from snapshots import assert_fxshard_snapshot
from test_numerics import STEPS, assert_matches_reference


@pytest.mark.parametrize("clip_with, stage", [(clip_with, stage) for clip_with in ("backend", "torch")
                                              for stage in (0, 1, 2, 3)])
def test_clip_grad_norm_is_the_whole_models_norm(pools, clip_with, stage):
    # max_norm below every step's gradient norm, so every step clips: a per-rank (shard) norm would clip by a
    # different factor on each rank and the parameters would leave the reference. torch's own clip_grad_norm_ over
    # model.parameters() takes the whole model's norm too, as it does under DDP. The model has a 0-d parameter: a
    # plain tensor beside the DTensors of stages 2 and 3.
    for result in pools(2).run(scenarios.train_against_reference, "mlp_temperature", "sgd", STEPS, stage=stage,
                               clip=0.05,
                               clip_with=clip_with):
        assert all(norm > 0.05 for norm in result["reference_norms"])
        assert result["norms"] == pytest.approx(result["reference_norms"], rel=1e-6)
        assert_matches_reference(result, "sgd")


def test_torchs_clip_grad_norm_after_no_sync_averages_the_kept_gradients_first(pools):
    for result in pools(2).run(scenarios.accumulate_against_reference, 0, clip=0.05):
        assert all(norm > 0.05 for norm in result["reference_norms"])
        assert result["norms"] == pytest.approx(result["reference_norms"], rel=1e-6)
        assert_matches_reference(result, "sgd")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_weight_decay_groups_by_ndim_over_the_prepared_model_match_one_process(pools, stage):
    # the `p.ndim >= 2` rule sees the model's shapes at every stage (stage 3's leaves are DTensors of this rank's
    # rows), so the same tensors decay as on one process; with every leaf 1-D nothing would decay, and SGD's
    # decay of 0.5 moves the weights far beyond the tolerance
    for result in pools(2).run(scenarios.decay_groups_by_ndim, stage):
        assert result["decayed"] == result["expected_decayed"] and result["decayed"]
        assert result["grads_shaped"]
        # stage 1 frees the full gradients at the step (the memory ZeRO-1 saves); the others keep them, as DDP does
        assert result["grads_kept"] == (stage != 1)
        if stage != 1:  # stage 1's gradients are each rank's own until the step averages them
            assert result["grad_norms"] == pytest.approx(result["reference_grad_norms"], rel=1e-5)
        assert_matches_reference(result, "sgd")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_an_lr_scheduler_built_before_prepare_schedules_the_training(pools, stage):
    # LambdaLR over the user's optimizer, then prepare: the LR halves every step, as on one process, because
    # prepare lays the shards out in the same optimizer object the scheduler holds
    for result in pools(2).run(scenarios.train_against_reference, "mlp", "adamw", STEPS, stage=stage,
                               halve_lr_each_step=True):
        assert result["prepare_kept_the_optimizer"]
        assert_matches_reference(result, "adamw")


@pytest.mark.parametrize("stage", [1, 3])
def test_sharded_optimizer_state_dict_resumes_training_exactly(pools, stage):
    results = pools(2).run(scenarios.resume_from_checkpoint, stage)
    for rank, result in enumerate(results):
        for name, value in result["uninterrupted"].items():
            assert torch.equal(result["resumed"][name], value), name
    # each rank saved its rows of every state (DTensors), not full tensors: together exactly the full elements
    assert sum(r["saved_exp_avg_elements"] for r in results) == results[0]["full_elements"]
    assert all(r["saved_exp_avg_elements"] < r["full_elements"] for r in results)


def test_full_optimizer_state_dict_moves_across_world_sizes_and_stages(pools, tmp_path):
    # saved at world 2 from stage 3, laid out again at world 3 for stages 0, 1 and 3 (padding differs: the GPT's
    # sizes are not all divisible by 2 or 3); gathered back, every tensor must be the one saved, bit for bit
    path = str(tmp_path / "optimizer.pt")
    saved = pools(2).run(scenarios.save_full_optimizer_state, 3, path)[0]
    adam_kinds = {"step", "exp_avg", "exp_avg_sq"}
    full_elements = sum(s["exp_avg"].numel() for s in saved["state"].values())
    assert all(set(kinds) == adam_kinds for kinds in saved["state"].values()) and saved["state"]
    for stage in (0, 1, 3):
        for result in pools(3).run(scenarios.reload_full_optimizer_state, stage, path):
            again = result["regathered"]
            assert again["param_groups"] == saved["param_groups"], stage
            assert again["state"].keys() == saved["state"].keys(), stage
            for name, kinds in saved["state"].items():
                for kind, value in kinds.items():
                    assert torch.equal(again["state"][name][kind], value), (stage, name, kind)
            held = result["exp_avg_elements_held"]
            assert held == full_elements if stage == 0 else held < full_elements / 2, stage  # a third, padded


def test_full_optimizer_state_dict_of_another_model_is_refused():
    with fake_process_group(2):
        backend = fxshard.backend(compiler="eager", stage=3)
        model = MLP()
        _, opt = backend.prepare(model, torch.optim.AdamW(model.parameters()))
        names = [spec_of(p).name for p in opt.param_groups[0]["params"]]
        with pytest.raises(fxshard.FxShardError, match="saved from the same model"):
            backend.load_full_optimizer_state_dict({"state": {}, "param_groups": [{"lr": 1.0, "params": ["w"]}]})
        wrong_shape = {names[0]: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3)}}
        with pytest.raises(fxshard.FxShardError, match=f"{names[0]}: exp_avg has shape \\[3\\]"):
            backend.load_full_optimizer_state_dict({"state": wrong_shape, "param_groups": [{"params": names}]})
        assert opt.param_groups[0]["lr"] != 1.0 and not opt.state  # refused before anything changed
    with pytest.raises(fxshard.FxShardError, match="full_optimizer_state_dict needs the optimizer"):
        fxshard.backend(compiler="eager", stage=3).full_optimizer_state_dict()


@pytest.mark.parametrize("stage", [1, 2])
def test_stepping_another_optimizer_over_a_prepared_model_is_refused(stage):
    with fake_process_group(2):
        model, _ = fxshard.backend(compiler="eager", stage=stage).prepare(MLP())
        with pytest.raises(fxshard.FxShardError, match="not the one backend.prepare returned"):
            torch.optim.SGD(model.parameters(), lr=0.1).step()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_param_group_added_after_prepare_is_refused_and_the_groups_stay(stage):
    with fake_process_group(2):
        model = MLP()
        model, opt = fxshard.backend(compiler="eager", stage=stage).prepare(
            model, torch.optim.SGD(model.parameters(), lr=0.1))
        groups = [list(group["params"]) for group in opt.param_groups]
        with pytest.raises(fxshard.FxShardError, match=f"add_param_group on the optimizer backend.prepare returned "
                                                       f"\\(stage {stage}\\)"):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
        assert [list(group["params"]) for group in opt.param_groups] == groups


def test_an_optimizer_over_the_parameters_prepare_replaced_is_refused():
    with fake_process_group(2):
        model = MLP()
        stale = torch.optim.SGD(model.parameters(), lr=0.1)  # built before prepare, and not passed to it
        fxshard.backend(compiler="eager", stage=3).prepare(model)
        with pytest.raises(fxshard.FxShardError, match="replaced by its shard"):
            stale.step()
        torch.optim.SGD(model.parameters(), lr=0.1).step()  # stage 3's shard leaves need nothing from the step


@pytest.mark.parametrize("stage", [0, 1])
def test_load_state_dict_of_full_parameter_stages(stage):
    with fake_process_group(2, rank=1):
        model, _ = fxshard.backend(compiler="eager", stage=stage).prepare(MLP())
        replacement = {k: torch.full_like(v, float(i)) for i, (k, v) in enumerate(model.state_dict().items())}
        model.load_state_dict(replacement)
        for name, value in model.state_dict().items():
            assert torch.equal(value, replacement[name]), name
        if stage == 1:  # the master shards the optimizer updates follow the load
            for name, param in model.named_parameters():
                master = prepared_param(param).master
                assert torch.equal(master, shard_of(replacement[name], spec_of(master))), name


def test_step_buckets_pack_parameters_in_order_up_to_the_cap():
    from fxshard.runtime.optim import sharded_step_of

    with fake_process_group(2):
        shards = {}
        for cap, param_dtype in ((1 << 20, None), (300, None), (1 << 20, torch.bfloat16)):
            backend = fxshard.backend(compiler="eager", stage=2, step_bucket_bytes=cap, param_dtype=param_dtype)
            model = MLP()
            model.fc2.bias.data = model.fc2.bias.data.double()  # a second dtype: a bucket holds one
            _, opt = backend.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
            step = sharded_step_of(opt)
            buckets = step.buckets("all_gather", step.shards())
            shards[cap, param_dtype] = [[spec_of(s).name for s in bucket] for bucket in buckets]
    # full buffers in f32: fc1.weight 256 B, fc1.bias 64, fc2.weight 320; fc2.bias is f64
    assert shards[1 << 20, None] == [["fc1.weight", "fc1.bias", "fc2.weight"], ["fc2.bias"]]
    assert shards[300, None] == [["fc1.weight"], ["fc1.bias"], ["fc2.weight"], ["fc2.bias"]]
    # in bf16 every full copy has one dtype: one bucket
    assert shards[1 << 20, torch.bfloat16] == [["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_compiled_optimizer_step_trains_like_the_eager_one(pools, stage):
    eager, compiled = (
        pools(2).run(scenarios.train_against_reference, "mlp", "adamw", 3, stage=stage, compile_step=compile_step)[0]
        for compile_step in (False, True)
    )
    assert_matches_reference(compiled, "adamw")
    kinds = [{kind for _, kind in run["compiled_graphs"]} for run in (eager, compiled)]
    assert "optimizer" in kinds[1] and "optimizer" not in kinds[0]
    gathers = [run["collectives"].get("all_gather", {}) for run in (eager, compiled)]
    if stage in (1, 2):
        # the eager step packs the MLP's 4 updated parameters into one bucket (step_bucket_bytes); the compiled
        # step gathers once per module (2 layers, the graphs' `bucket="layer"`), the same elements, and the eager
        # hook does not gather them again
        assert gathers[0]["calls"] == 1 and gathers[1]["calls"] == 2
        assert gathers[0]["elements"] == gathers[1]["elements"]
    else:
        assert gathers[0] == gathers[1]  # stage 3 gathers in forward/backward only; stage 0 never


def _optimizer_graphs(stage: int):
    with fake_process_group(2):
        torch._dynamo.reset()
        backend = fxshard.backend(compiler="eager", stage=stage)
        model = MLP()
        model, opt = backend.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        torch.compile(model, backend=backend, fullgraph=True)(torch.randn(4, 8)).sum().backward()
        torch.compile(opt.step, backend=backend)()
    return {r.kind: r for r in backend.graphs if r.graph_id == 1}


def test_optimizer_graph_snapshot_stage_2():
    graphs = _optimizer_graphs(2)
    rewritten = graphs["optimizer"].passes[0]  # shard_optimizer_pass on the Dynamo graph of the step
    assert rewritten.name == "shard_optimizer_pass"
    assert_fxshard_snapshot(rewritten.after, """\
l_self_param_groups_0_params_0_grad: f32[64]
l_self_param_groups_0_params_1_grad: f32[8]
l_self_param_groups_0_params_2_grad: f32[48]
l_self_param_groups_0_params_3_grad: f32[3]
p = get_attr() -> f32[64]  # fc1 updated_shard
x = get_attr() -> f32[8]  # fc1 updated_shard
x_1 = get_attr() -> f32[48]  # fc2 updated_shard
x_2 = get_attr() -> f32[3]  # fc2 updated_shard
add_ = .add_(p, l_self_param_groups_0_params_0_grad) -> f32[64]
add__1 = .add_(x, l_self_param_groups_0_params_1_grad) -> f32[8]
add__2 = .add_(x_1, l_self_param_groups_0_params_2_grad) -> f32[48]
add__3 = .add_(x_2, l_self_param_groups_0_params_3_grad) -> f32[3]
_fxshard_publish_0 = get_attr() -> -  # fc1 publish
unshard_default = fxshard.unshard(x) -> -  # fc1 publish
copy__default = aten.copy_(_fxshard_publish_0, unshard_default) -> -  # fc1 publish
_fxshard_publish_1 = get_attr() -> -  # fc1 publish
unshard_default_1 = fxshard.unshard(p) -> -  # fc1 publish
copy__default_1 = aten.copy_(_fxshard_publish_1, unshard_default_1) -> -  # fc1 publish
_fxshard_publish_2 = get_attr() -> -  # fc2 publish
unshard_default_2 = fxshard.unshard(x_2) -> -  # fc2 publish
copy__default_2 = aten.copy_(_fxshard_publish_2, unshard_default_2) -> -  # fc2 publish
_fxshard_publish_3 = get_attr() -> -  # fc2 publish
unshard_default_3 = fxshard.unshard(x_1) -> -  # fc2 publish
copy__default_3 = aten.copy_(_fxshard_publish_3, unshard_default_3) -> -  # fc2 publish
return """)
    assert_fxshard_snapshot(graphs["inference"].final, """\
arg0_1: f32[64]
arg1_1: f32[8]
arg2_1: f32[48]
arg3_1: f32[3]
arg4_1: f32[16]
arg5_1: f32[16,8]
arg6_1: f32[5]
arg7_1: f32[5,16]
arg8_1: f32[64]
arg9_1: f32[8]
arg10_1: f32[48]
arg11_1: f32[3]
add = aten.add(arg0_1, arg8_1) -> f32[64]
add_1 = aten.add(arg1_1, arg9_1) -> f32[8]
cat_default = aten.cat([add_1, add]) -> f32[72]  # fc1 copy_in
all_gather_fc1 = c10d.all_gather_into_tensor(cat_default) -> f32[144]  # fc1 all_gather
add_2 = aten.add(arg2_1, arg10_1) -> f32[48]
add_3 = aten.add(arg3_1, arg11_1) -> f32[3]
cat_default_1 = aten.cat([add_3, add_2]) -> f32[51]  # fc2 copy_in
all_gather_fc2 = c10d.all_gather_into_tensor(cat_default_1) -> f32[102]  # fc2 all_gather
wait_fc1 = c10d.wait_tensor(all_gather_fc1) -> f32[144]  # fc1 wait
view_default = aten.view(wait_fc1) -> f32[2,72]  # fc1 copy_out
split_with_sizes_default = aten.split_with_sizes(view_default) -> (f32[2,8], f32[2,64])  # fc1 copy_out
getitem = getitem(split_with_sizes_default) -> f32[2,8]  # fc1 copy_out
clone_default = aten.clone(getitem) -> f32[2,8]  # fc1 copy_out
fc1_bias = aten.view(clone_default) -> f32[16]  # fc1 copy_out
copy = aten.copy(arg4_1, fc1_bias) -> f32[16]
getitem_1 = getitem(split_with_sizes_default) -> f32[2,64]  # fc1 copy_out
clone_default_1 = aten.clone(getitem_1) -> f32[2,64]  # fc1 copy_out
fc1_weight = aten.view(clone_default_1) -> f32[16,8]  # fc1 copy_out
copy_1 = aten.copy(arg5_1, fc1_weight) -> f32[16,8]
wait_fc2 = c10d.wait_tensor(all_gather_fc2) -> f32[102]  # fc2 wait
view_default_1 = aten.view(wait_fc2) -> f32[2,51]  # fc2 copy_out
split_with_sizes_default_1 = aten.split_with_sizes(view_default_1) -> (f32[2,3], f32[2,48])  # fc2 copy_out
getitem_2 = getitem(split_with_sizes_default_1) -> f32[2,3]  # fc2 copy_out
clone_default_2 = aten.clone(getitem_2) -> f32[2,3]  # fc2 copy_out
view_default_2 = aten.view(clone_default_2) -> f32[6]  # fc2 copy_out
slice_tensor = aten.slice(view_default_2) -> f32[5]  # fc2 copy_out
fc2_bias = aten.view(slice_tensor) -> f32[5]  # fc2 copy_out
copy_2 = aten.copy(arg6_1, fc2_bias) -> f32[5]
getitem_3 = getitem(split_with_sizes_default_1) -> f32[2,48]  # fc2 copy_out
clone_default_3 = aten.clone(getitem_3) -> f32[2,48]  # fc2 copy_out
view_default_3 = aten.view(clone_default_3) -> f32[96]  # fc2 copy_out
slice_tensor_1 = aten.slice(view_default_3) -> f32[80]  # fc2 copy_out
fc2_weight = aten.view(slice_tensor_1) -> f32[5,16]  # fc2 copy_out
copy_3 = aten.copy(arg7_1, fc2_weight) -> f32[5,16]
return add:f32[64], add_1:f32[8], add_2:f32[48], add_3:f32[3], copy:f32[16], copy_1:f32[16,8], copy_2:f32[5], copy_3:f32[5,16]""")


def test_optimizer_graph_snapshot_stage_0():
    # full parameters, already averaged gradients: the update alone, no collective
    assert_fxshard_snapshot(_optimizer_graphs(0)["inference"].final, """\
arg0_1: f32[16,8]
arg1_1: f32[16]
arg2_1: f32[5,16]
arg3_1: f32[5]
arg4_1: f32[16,8]
arg5_1: f32[16]
arg6_1: f32[5,16]
arg7_1: f32[5]
add = aten.add(arg0_1, arg4_1) -> f32[16,8]
add_1 = aten.add(arg1_1, arg5_1) -> f32[16]
add_2 = aten.add(arg2_1, arg6_1) -> f32[5,16]
add_3 = aten.add(arg3_1, arg7_1) -> f32[5]
return add:f32[16,8], add_1:f32[16], add_2:f32[5,16], add_3:f32[5]""")


def test_optimizer_graph_of_stage_1_is_stage_2s():
    # stage 1 updates master shards and gathers them into the full parameters, stage 2 updates shard leaves and
    # gathers them into the resident copies: the same graph over different tensors
    graphs = [graph_summary(_optimizer_graphs(stage)["inference"].final) for stage in (1, 2)]
    assert graphs[0] == graphs[1] and "all_gather" in graphs[0]


def test_optimizer_graph_snapshot_stage_3():
    # shard leaves with reduce-scattered gradients: the update alone, no collective
    assert_fxshard_snapshot(_optimizer_graphs(3)["inference"].final, """\
arg0_1: f32[64]
arg1_1: f32[8]
arg2_1: f32[48]
arg3_1: f32[3]
arg4_1: f32[64]
arg5_1: f32[8]
arg6_1: f32[48]
arg7_1: f32[3]
add = aten.add(arg0_1, arg4_1) -> f32[64]
add_1 = aten.add(arg1_1, arg5_1) -> f32[8]
add_2 = aten.add(arg2_1, arg6_1) -> f32[48]
add_3 = aten.add(arg3_1, arg7_1) -> f32[3]
return add:f32[64], add_1:f32[8], add_2:f32[48], add_3:f32[3]""")


def test_a_stage_1_optimizer_holds_the_model_parameters_and_steps_their_masters():
    # What torch's get_state_dict / set_state_dict and LR schedulers rely on: the groups hold the model's own
    # parameters, each state is named through them; the update runs on the fp32 master shards (the states' layout).
    from torch.distributed.checkpoint.state_dict import get_state_dict

    with fake_process_group(2):
        model = MLP()
        model, opt = fxshard.backend(compiler="eager", stage=1).prepare(model, torch.optim.AdamW(model.parameters()))
        assert [p for g in opt.param_groups for p in g["params"]] == list(model.parameters())
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
        masters_before = [prepared_param(p).master.clone() for p in model.parameters()]
        model(torch.randn(4, model.fc1.in_features)).sum().backward()
        opt.step()
        scheduler.step()
        assert all(p.grad is None and prepared_param(p).master.grad is None for p in model.parameters())
        assert not all(torch.equal(prepared_param(p).master, m) for p, m in zip(model.parameters(), masters_before))
        for param in model.parameters():
            assert opt.state[param]["exp_avg"].shape == prepared_param(param).master.shape  # this rank's flat shard
        _, optim_sd = get_state_dict(model, opt)
        _, ours = fxshard.checkpoint.get_state_dict(model, opt)
        names = [name for name, _ in model.named_parameters()]
        assert list(optim_sd["state"]) == list(ours["state"]) == names
        assert optim_sd["param_groups"] == ours["param_groups"]
        assert optim_sd["param_groups"][0]["lr"] == pytest.approx(0.5e-3)  # the scheduler's, on the returned groups
        for name, param in model.named_parameters():
            assert optim_sd["state"][name]["exp_avg"].shape == param.shape  # a DTensor of the full shape
        model(torch.randn(4, model.fc1.in_features)).sum().backward()
        opt.step()
        assert updating_optimizer(opt).param_groups[0]["lr"] == pytest.approx(0.5e-3)  # the masters' update took it
        with pytest.raises(fxshard.FxShardError, match="takes no closure"):
            opt.step(lambda: None)


def test_a_stage_1_state_dict_loads_in_the_masters_precision():
    # torch's load_state_dict casts each state to its parameter's dtype (bf16 here); the masters train in fp32.
    def prepared():
        torch.manual_seed(0)
        model = MLP(d_out=4)  # every weight's rows split evenly over 2 ranks: no collective in the state dict
        backend = fxshard.backend(compiler="eager", stage=1, param_dtype=torch.bfloat16)
        return backend.prepare(model, torch.optim.AdamW(model.parameters()))

    with fake_process_group(2):
        model, opt = prepared()
        model(torch.randn(4, model.fc1.in_features)).float().sum().backward()
        opt.step()
        for state in opt.state.values():
            state["exp_avg"].fill_(1 + 2**-12)  # not a bf16 number
        fresh_model, fresh_opt = prepared()
        fresh_opt.load_state_dict(opt.state_dict())
        for param, fresh in zip(model.parameters(), fresh_model.parameters()):
            assert fresh.dtype == torch.bfloat16
            loaded = fresh_opt.state[fresh]
            assert loaded["exp_avg"].dtype == torch.float32
            assert torch.equal(loaded["exp_avg"], opt.state[param]["exp_avg"])
            assert updating_optimizer(fresh_opt).state[prepared_param(fresh).master] is loaded  # the update reads what loaded


@pytest.mark.parametrize("stage, built_after_prepare", [(0, False), (1, False), (2, False), (3, False), (3, True)])
def test_a_rank_that_skips_a_step_is_named_where_the_ranks_next_meet(pools, stage, built_after_prepare):
    # without the check: stages 0 and 3 train on silently apart, stages 1 and 2 meet mismatched collectives
    stepping, skipping = pools(2).run(scenarios.skip_a_step_on_one_rank, stage, built_after_prepare)
    assert stepping["step"] == 1 and skipping["step"] == 2  # rank 0 in step 1's optimizer.step(), rank 1 in step 2
    assert stepping["error"] == skipping["error"]
    assert ("rank 0 starts optimizer.step() after 1 optimizer step; rank 1 starts a forward pass after 1 optimizer "
            "step") in stepping["error"]


@pytest.mark.parametrize("scaler", ["GradScaler", "ShardedGradScaler"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_an_overflow_in_one_ranks_gradients_skips_the_step_on_every_rank(pools, stage, scaler):
    # a plain GradScaler checks this rank's gradients only: fxshard makes the ranks' flags agree
    for result in pools(2).run(scenarios.train_with_grad_scaler, stage, scaler):
        assert result["scales"] == result["reference_scales"] == [512.0, 512.0, 512.0]  # halved once, by the skip
        for name, want in result["expected"].items():
            torch.testing.assert_close(result["final"][name], want, rtol=1e-6, atol=0)
