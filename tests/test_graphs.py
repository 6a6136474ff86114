"""The rewritten graphs, locked in as snapshots (a fake process group: runs in any CI, one process)."""

import collections

import pytest
import torch

import fxshard
from examples.models import GPT, MLP
from fxshard.runtime.ops import REDUCE_GRAD, UNSHARD
from fxshard.report import collectives
from fxshard.testing import assert_graph_snapshot, fake_process_group


def compile_and_step(model, *inputs, stage=3, **options):
    """Prepare under a fake world of 2, run one compiled forward + backward, return the backend."""
    torch._dynamo.reset()
    backend = fxshard.backend(stage=stage, **{"compiler": "eager", **options})
    model, _ = backend.prepare(model)
    torch.compile(model, backend=backend, fullgraph=True)(*inputs).sum().backward()
    return backend


def final_graphs(backend) -> dict:
    return {record.kind: record.final for record in backend.graphs if record.kind != "joint"}


@pytest.fixture
def mlp_graphs():
    with fake_process_group(2):
        torch.manual_seed(0)
        yield final_graphs(compile_and_step(MLP(), torch.randn(4, 8)))


def test_mlp_forward_snapshot(mlp_graphs):
    # One all-gather per layer; what forward returns after addmm_1 is saved for backward: shards and
    # activations only, never a full-shape weight.
    assert_graph_snapshot(mlp_graphs["forward"], """\
primals_1: f32[64]
primals_2: f32[8]
primals_3: f32[4,8]
primals_4: f32[48]
primals_5: f32[3]
cat_default = aten.cat([primals_1, primals_2]) -> f32[72]  # fc1 copy_in
all_gather_fc1 = c10d.all_gather_into_tensor(cat_default) -> f32[144]  # fc1 all_gather
wait_fc1 = c10d.wait_tensor(all_gather_fc1) -> f32[144]  # fc1 wait
view_default = aten.view(wait_fc1) -> f32[2,72]  # fc1 copy_out
split_with_sizes_default = aten.split_with_sizes(view_default) -> (f32[2,64], f32[2,8])  # fc1 copy_out
getitem = getitem(split_with_sizes_default) -> f32[2,64]  # fc1 copy_out
clone_default = aten.clone(getitem) -> f32[2,64]  # fc1 copy_out
fc1_weight = aten.view(clone_default) -> f32[16,8]  # fc1 copy_out
t = aten.t(fc1_weight) -> f32[8,16]  # recomputed
getitem_1 = getitem(split_with_sizes_default) -> f32[2,8]  # fc1 copy_out
clone_default_1 = aten.clone(getitem_1) -> f32[2,8]  # fc1 copy_out
fc1_bias = aten.view(clone_default_1) -> f32[16]  # fc1 copy_out
addmm = aten.addmm(fc1_bias, primals_3, t) -> f32[4,16]
relu = aten.relu(addmm) -> f32[4,16]
cat_default_1 = aten.cat([primals_4, primals_5]) -> f32[51]  # fc2 copy_in
all_gather_fc2 = c10d.all_gather_into_tensor(cat_default_1) -> f32[102]  # fc2 all_gather
wait_fc2 = c10d.wait_tensor(all_gather_fc2) -> f32[102]  # fc2 wait
view_default_1 = aten.view(wait_fc2) -> f32[2,51]  # fc2 copy_out
split_with_sizes_default_1 = aten.split_with_sizes(view_default_1) -> (f32[2,48], f32[2,3])  # fc2 copy_out
getitem_2 = getitem(split_with_sizes_default_1) -> f32[2,48]  # fc2 copy_out
clone_default_2 = aten.clone(getitem_2) -> f32[2,48]  # fc2 copy_out
view_default_2 = aten.view(clone_default_2) -> f32[96]  # fc2 copy_out
slice_tensor = aten.slice(view_default_2) -> f32[80]  # fc2 copy_out
fc2_weight = aten.view(slice_tensor) -> f32[5,16]  # fc2 copy_out
t_1 = aten.t(fc2_weight) -> f32[16,5]  # recomputed
getitem_3 = getitem(split_with_sizes_default_1) -> f32[2,3]  # fc2 copy_out
clone_default_3 = aten.clone(getitem_3) -> f32[2,3]  # fc2 copy_out
view_default_3 = aten.view(clone_default_3) -> f32[6]  # fc2 copy_out
slice_tensor_1 = aten.slice(view_default_3) -> f32[5]  # fc2 copy_out
fc2_bias = aten.view(slice_tensor_1) -> f32[5]  # fc2 copy_out
addmm_1 = aten.addmm(fc2_bias, relu, t_1) -> f32[4,5]
return addmm_1:f32[4,5], primals_3:f32[4,8], primals_4:f32[48], relu:f32[4,16]""")


def test_mlp_backward_snapshot(mlp_graphs):
    # fc2's weight is gathered again (fc1's input gradient is not needed), then one reduce-scatter per layer.
    assert_graph_snapshot(mlp_graphs["backward"], """\
primals_3: f32[4,8]
primals_4: f32[48]
relu: f32[4,16]
tangents_1: f32[4,5]
all_gather_fc2 = c10d.all_gather_into_tensor(primals_4) -> f32[96]  # fc2 all_gather
wait_fc2 = c10d.wait_tensor(all_gather_fc2) -> f32[96]  # fc2 wait
slice_tensor = aten.slice(wait_fc2) -> f32[80]  # fc2 copy_out
fc2_weight = aten.view(slice_tensor) -> f32[5,16]  # fc2 copy_out
t_1 = aten.t(fc2_weight) -> f32[16,5]  # recomputed
t_2 = aten.t(t_1) -> f32[5,16]  # recomputed
mm = aten.mm(tangents_1, t_2) -> f32[4,16]
t_3 = aten.t(tangents_1) -> f32[5,4]
mm_1 = aten.mm(t_3, relu) -> f32[5,16]
t_4 = aten.t(mm_1) -> f32[16,5]
sum_1 = aten.sum(tangents_1) -> f32[1,5]
view = aten.view(sum_1) -> f32[5]
constant_pad_nd_default = aten.constant_pad_nd(view) -> f32[6]  # fc2 copy_in
view_default = aten.view(constant_pad_nd_default) -> f32[2,3]  # fc2 copy_in
t_5 = aten.t(t_4) -> f32[5,16]
view_default_1 = aten.view(t_5) -> f32[80]  # fc2 copy_in
constant_pad_nd_default_1 = aten.constant_pad_nd(view_default_1) -> f32[96]  # fc2 copy_in
view_default_2 = aten.view(constant_pad_nd_default_1) -> f32[2,48]  # fc2 copy_in
cat_default = aten.cat([view_default, view_default_2]) -> f32[2,51]  # fc2 copy_in
view_default_3 = aten.view(cat_default) -> f32[102]  # fc2 copy_in
reduce_scatter_fc2 = c10d.reduce_scatter_tensor(view_default_3) -> f32[51]  # fc2 reduce_scatter
detach = aten.detach(relu) -> f32[4,16]
detach_1 = aten.detach(detach) -> f32[4,16]
threshold_backward = aten.threshold_backward(mm, detach_1) -> f32[4,16]
t_6 = aten.t(threshold_backward) -> f32[16,4]
mm_2 = aten.mm(t_6, primals_3) -> f32[16,8]
t_7 = aten.t(mm_2) -> f32[8,16]
sum_2 = aten.sum(threshold_backward) -> f32[1,16]
view_1 = aten.view(sum_2) -> f32[16]
view_default_4 = aten.view(view_1) -> f32[2,8]  # fc1 copy_in
t_8 = aten.t(t_7) -> f32[16,8]
wait_fc2_1 = c10d.wait_tensor(reduce_scatter_fc2) -> f32[51]  # fc2 wait
split_with_sizes_default = aten.split_with_sizes(wait_fc2_1) -> (f32[3], f32[48])  # fc2 copy_out
fc2_bias_grad = getitem(split_with_sizes_default) -> f32[3]  # fc2 copy_out
fc2_weight_grad = getitem(split_with_sizes_default) -> f32[48]  # fc2 copy_out
view_default_5 = aten.view(t_8) -> f32[128]  # fc1 copy_in
view_default_6 = aten.view(view_default_5) -> f32[2,64]  # fc1 copy_in
cat_default_1 = aten.cat([view_default_4, view_default_6]) -> f32[2,72]  # fc1 copy_in
view_default_7 = aten.view(cat_default_1) -> f32[144]  # fc1 copy_in
reduce_scatter_fc1 = c10d.reduce_scatter_tensor(view_default_7) -> f32[72]  # fc1 reduce_scatter
wait_fc1 = c10d.wait_tensor(reduce_scatter_fc1) -> f32[72]  # fc1 wait
split_with_sizes_default_1 = aten.split_with_sizes(wait_fc1) -> (f32[8], f32[64])  # fc1 copy_out
fc1_bias_grad = getitem(split_with_sizes_default_1) -> f32[8]  # fc1 copy_out
fc1_weight_grad = getitem(split_with_sizes_default_1) -> f32[64]  # fc1 copy_out
return fc1_weight_grad:f32[64], fc1_bias_grad:f32[8], -, fc2_weight_grad:f32[48], fc2_bias_grad:f32[3]""")


def test_no_marker_survives_lowering(mlp_graphs):
    for gm in mlp_graphs.values():
        assert not gm.graph.find_nodes(op="call_function", target=UNSHARD)
        assert not gm.graph.find_nodes(op="call_function", target=REDUCE_GRAD)


def test_tied_embedding_is_one_shard_gathered_per_use_site_and_reduced_once():
    with fake_process_group(2):
        torch.manual_seed(0)
        model = GPT()
        idx = torch.randint(0, model.config.vocab_size, (2, model.config.block_size))
        backend = compile_and_step(model, idx, idx, bucket="layer")
        assert model.tok_emb._parameters["weight"] is model.lm_head._parameters["weight"]
        graphs = final_graphs(backend)
    forward = [(r["kind"], r["unit"]) for r in collectives(graphs["forward"])]
    assert forward.count(("all_gather", "tok_emb")) == 1 and forward.count(("all_gather", "lm_head")) == 1
    # every module that owns parameters is gathered exactly once in forward
    units = collections.Counter(unit for kind, unit in forward)
    assert set(units.values()) == {1} and len(units) == 2 + 2 * 6 + 2  # embeddings, 6 units a block, ln_f, head
    # backward: the two use sites' gradients are summed first and reduced once (merge_tied_grads_pass)
    tied = [r for r in collectives(graphs["backward"]) if r["kind"] == "reduce_scatter" and "lm_head.weight" in r["params"]]
    assert [(r["unit"], r["params"]) for r in tied] == [("tok_emb", ["lm_head.weight", "tok_emb.weight"])]


def test_inference_graph_is_lowered():
    with fake_process_group(2):
        torch._dynamo.reset()
        backend = fxshard.backend(compiler="eager", stage=3)
        model, _ = backend.prepare(MLP())
        with torch.no_grad():
            torch.compile(model, backend=backend, fullgraph=True)(torch.randn(4, 8))
    (inference,) = [r.final for r in backend.graphs if r.kind == "inference"]
    assert [(r["kind"], r["unit"]) for r in collectives(inference)] == [("all_gather", "fc1"), ("all_gather", "fc2")]
    assert not inference.graph.find_nodes(op="call_function", target=UNSHARD)


def test_passes_can_be_dropped():
    with fake_process_group(2):
        torch.manual_seed(0)
        backend = compile_and_step(MLP(), torch.randn(4, 8), passes=[])
    graphs = final_graphs(backend)
    # Without lowering, the markers stay and run their eager collectives: correct, just not rewritten.
    assert len(graphs["forward"].graph.find_nodes(op="call_function", target=UNSHARD)) == 4
    assert all(not collectives(gm) for gm in graphs.values())


def test_pipeline_records_each_pass():
    with fake_process_group(2):
        torch.manual_seed(0)
        backend = compile_and_step(MLP(), torch.randn(4, 8))
    forward = next(r for r in backend.graphs if r.kind == "forward")
    names = [p.name for p in forward.passes]
    assert names == [p.__name__ for p in fxshard.default_passes()]
    lowering = forward.passes[names.index("lower_collectives_pass")]
    assert lowering.before.graph.find_nodes(op="call_function", target=UNSHARD)
    assert not lowering.after.graph.find_nodes(op="call_function", target=UNSHARD)


def stage_graphs(stage: int) -> dict:
    with fake_process_group(2):
        torch.manual_seed(0)
        return final_graphs(compile_and_step(MLP(), torch.randn(4, 8), stage=stage))


def test_stage_0_snapshot():
    # DDP: the forward reads the full parameters as they are; backward all-reduces the gradients in one bucket
    # (the default 25 MiB cap holds the whole MLP), after the last of them is ready.
    graphs = stage_graphs(0)
    assert_graph_snapshot(graphs["forward"], """\
primals_1: f32[16,8]
primals_2: f32[16]
primals_3: f32[4,8]
primals_4: f32[5,16]
primals_5: f32[5]
t = aten.t(primals_1) -> f32[8,16]
addmm = aten.addmm(primals_2, primals_3, t) -> f32[4,16]
relu = aten.relu(addmm) -> f32[4,16]
t_1 = aten.t(primals_4) -> f32[16,5]
addmm_1 = aten.addmm(primals_5, relu, t_1) -> f32[4,5]
t_2 = aten.t(t_1) -> f32[5,16]
return addmm_1:f32[4,5], primals_3:f32[4,8], relu:f32[4,16], t_2:f32[5,16]""")
    assert_graph_snapshot(graphs["backward"], """\
primals_3: f32[4,8]
relu: f32[4,16]
t_2: f32[5,16]
tangents_1: f32[4,5]
mm = aten.mm(tangents_1, t_2) -> f32[4,16]
t_3 = aten.t(tangents_1) -> f32[5,4]
mm_1 = aten.mm(t_3, relu) -> f32[5,16]
t_4 = aten.t(mm_1) -> f32[16,5]
sum_1 = aten.sum(tangents_1) -> f32[1,5]
view = aten.view(sum_1) -> f32[5]
t_5 = aten.t(t_4) -> f32[5,16]
view_default = aten.view(t_5) -> f32[80]  # bucket0 copy_in
detach = aten.detach(relu) -> f32[4,16]
detach_1 = aten.detach(detach) -> f32[4,16]
threshold_backward = aten.threshold_backward(mm, detach_1) -> f32[4,16]
t_6 = aten.t(threshold_backward) -> f32[16,4]
mm_2 = aten.mm(t_6, primals_3) -> f32[16,8]
t_7 = aten.t(mm_2) -> f32[8,16]
sum_2 = aten.sum(threshold_backward) -> f32[1,16]
view_1 = aten.view(sum_2) -> f32[16]
t_8 = aten.t(t_7) -> f32[16,8]
view_default_1 = aten.view(t_8) -> f32[128]  # bucket0 copy_in
cat_default = aten.cat([view, view_default, view_1, view_default_1]) -> f32[229]  # bucket0 copy_in
all_reduce_bucket0 = c10d.all_reduce(cat_default) -> f32[229]  # bucket0 all_reduce
wait_bucket0 = c10d.wait_tensor(all_reduce_bucket0) -> f32[229]  # bucket0 wait
split_with_sizes_default = aten.split_with_sizes(wait_bucket0) -> (f32[5], f32[80], f32[16], f32[128])  # bucket0 copy_out
getitem = getitem(split_with_sizes_default) -> f32[5]  # bucket0 copy_out
fc2_bias_grad = aten.view(getitem) -> f32[5]  # bucket0 copy_out
getitem_1 = getitem(split_with_sizes_default) -> f32[80]  # bucket0 copy_out
fc2_weight_grad = aten.view(getitem_1) -> f32[5,16]  # bucket0 copy_out
getitem_2 = getitem(split_with_sizes_default) -> f32[16]  # bucket0 copy_out
fc1_bias_grad = aten.view(getitem_2) -> f32[16]  # bucket0 copy_out
getitem_3 = getitem(split_with_sizes_default) -> f32[128]  # bucket0 copy_out
fc1_weight_grad = aten.view(getitem_3) -> f32[16,8]  # bucket0 copy_out
return fc1_weight_grad:f32[16,8], fc1_bias_grad:f32[16], -, fc2_weight_grad:f32[5,16], fc2_bias_grad:f32[5]""")


def test_stage_1_snapshot():
    # ZeRO-1: no collective in either graph; gradients stay full until optimizer.step() reduce-scatters them.
    graphs = stage_graphs(1)
    assert_graph_snapshot(graphs["forward"], """\
primals_1: f32[16,8]
primals_2: f32[16]
primals_3: f32[4,8]
primals_4: f32[5,16]
primals_5: f32[5]
t = aten.t(primals_1) -> f32[8,16]
addmm = aten.addmm(primals_2, primals_3, t) -> f32[4,16]
relu = aten.relu(addmm) -> f32[4,16]
t_1 = aten.t(primals_4) -> f32[16,5]
addmm_1 = aten.addmm(primals_5, relu, t_1) -> f32[4,5]
return addmm_1:f32[4,5], primals_3:f32[4,8], primals_4:f32[5,16], relu:f32[4,16]""")
    assert_graph_snapshot(graphs["backward"], """\
primals_3: f32[4,8]
primals_4: f32[5,16]
relu: f32[4,16]
tangents_1: f32[4,5]
t_1 = aten.t(primals_4) -> f32[16,5]
t_2 = aten.t(t_1) -> f32[5,16]
mm = aten.mm(tangents_1, t_2) -> f32[4,16]
t_3 = aten.t(tangents_1) -> f32[5,4]
mm_1 = aten.mm(t_3, relu) -> f32[5,16]
t_4 = aten.t(mm_1) -> f32[16,5]
sum_1 = aten.sum(tangents_1) -> f32[1,5]
view = aten.view(sum_1) -> f32[5]
t_5 = aten.t(t_4) -> f32[5,16]
detach = aten.detach(relu) -> f32[4,16]
detach_1 = aten.detach(detach) -> f32[4,16]
threshold_backward = aten.threshold_backward(mm, detach_1) -> f32[4,16]
t_6 = aten.t(threshold_backward) -> f32[16,4]
mm_2 = aten.mm(t_6, primals_3) -> f32[16,8]
t_7 = aten.t(mm_2) -> f32[8,16]
sum_2 = aten.sum(threshold_backward) -> f32[1,16]
view_1 = aten.view(sum_2) -> f32[16]
t_8 = aten.t(t_7) -> f32[16,8]
return t_8:f32[16,8], view_1:f32[16], -, t_5:f32[5,16], view:f32[5]""")


def test_stage_2_snapshot():
    # ZeRO-2: the forward reads the resident full copies; backward reduce-scatters each layer into its shard.
    graphs = stage_graphs(2)
    assert_graph_snapshot(graphs["forward"], """\
primals_1: f32[16,8]
primals_2: f32[64]
primals_3: f32[16]
primals_4: f32[8]
primals_5: f32[4,8]
primals_6: f32[5,16]
primals_7: f32[48]
primals_8: f32[5]
primals_9: f32[3]
t = aten.t(primals_1) -> f32[8,16]
addmm = aten.addmm(primals_3, primals_5, t) -> f32[4,16]
relu = aten.relu(addmm) -> f32[4,16]
t_1 = aten.t(primals_6) -> f32[16,5]
addmm_1 = aten.addmm(primals_8, relu, t_1) -> f32[4,5]
t_2 = aten.t(t_1) -> f32[5,16]
return addmm_1:f32[4,5], primals_5:f32[4,8], relu:f32[4,16], t_2:f32[5,16]""")
    assert_graph_snapshot(graphs["backward"], """\
primals_5: f32[4,8]
relu: f32[4,16]
t_2: f32[5,16]
tangents_1: f32[4,5]
mm = aten.mm(tangents_1, t_2) -> f32[4,16]
t_3 = aten.t(tangents_1) -> f32[5,4]
mm_1 = aten.mm(t_3, relu) -> f32[5,16]
t_4 = aten.t(mm_1) -> f32[16,5]
sum_1 = aten.sum(tangents_1) -> f32[1,5]
view = aten.view(sum_1) -> f32[5]
constant_pad_nd_default = aten.constant_pad_nd(view) -> f32[6]  # fc2 copy_in
view_default = aten.view(constant_pad_nd_default) -> f32[2,3]  # fc2 copy_in
t_5 = aten.t(t_4) -> f32[5,16]
view_default_1 = aten.view(t_5) -> f32[80]  # fc2 copy_in
constant_pad_nd_default_1 = aten.constant_pad_nd(view_default_1) -> f32[96]  # fc2 copy_in
view_default_2 = aten.view(constant_pad_nd_default_1) -> f32[2,48]  # fc2 copy_in
cat_default = aten.cat([view_default, view_default_2]) -> f32[2,51]  # fc2 copy_in
view_default_3 = aten.view(cat_default) -> f32[102]  # fc2 copy_in
reduce_scatter_fc2 = c10d.reduce_scatter_tensor(view_default_3) -> f32[51]  # fc2 reduce_scatter
detach = aten.detach(relu) -> f32[4,16]
detach_1 = aten.detach(detach) -> f32[4,16]
threshold_backward = aten.threshold_backward(mm, detach_1) -> f32[4,16]
t_6 = aten.t(threshold_backward) -> f32[16,4]
mm_2 = aten.mm(t_6, primals_5) -> f32[16,8]
t_7 = aten.t(mm_2) -> f32[8,16]
sum_2 = aten.sum(threshold_backward) -> f32[1,16]
view_1 = aten.view(sum_2) -> f32[16]
view_default_4 = aten.view(view_1) -> f32[2,8]  # fc1 copy_in
t_8 = aten.t(t_7) -> f32[16,8]
wait_fc2 = c10d.wait_tensor(reduce_scatter_fc2) -> f32[51]  # fc2 wait
split_with_sizes_default = aten.split_with_sizes(wait_fc2) -> (f32[3], f32[48])  # fc2 copy_out
fc2_bias_grad = getitem(split_with_sizes_default) -> f32[3]  # fc2 copy_out
fc2_weight_grad = getitem(split_with_sizes_default) -> f32[48]  # fc2 copy_out
view_default_5 = aten.view(t_8) -> f32[128]  # fc1 copy_in
view_default_6 = aten.view(view_default_5) -> f32[2,64]  # fc1 copy_in
cat_default_1 = aten.cat([view_default_4, view_default_6]) -> f32[2,72]  # fc1 copy_in
view_default_7 = aten.view(cat_default_1) -> f32[144]  # fc1 copy_in
reduce_scatter_fc1 = c10d.reduce_scatter_tensor(view_default_7) -> f32[72]  # fc1 reduce_scatter
wait_fc1 = c10d.wait_tensor(reduce_scatter_fc1) -> f32[72]  # fc1 wait
split_with_sizes_default_1 = aten.split_with_sizes(wait_fc1) -> (f32[8], f32[64])  # fc1 copy_out
fc1_bias_grad = getitem(split_with_sizes_default_1) -> f32[8]  # fc1 copy_out
fc1_weight_grad = getitem(split_with_sizes_default_1) -> f32[64]  # fc1 copy_out
return -, fc1_weight_grad:f32[64], -, fc1_bias_grad:f32[8], -, -, fc2_weight_grad:f32[48], -, fc2_bias_grad:f32[3]""")
