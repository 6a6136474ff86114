"""What prepare does to a model and an optimizer."""

import pytest
import torch
from torch import nn

import fxshard
import scenarios
from examples.models import GPT, MLP
from torch.distributed.tensor import DTensor, Shard

from fxshard.runtime.param import prepared_param, spec_of
from fxshard.report import collectives
from fxshard.testing import fake_process_group


def test_parameters_keep_their_names_and_shapes_and_hold_this_ranks_rows_of_a_padded_flat_shard():
    with fake_process_group(3, rank=2):
        model = MLP(d_in=7, d_hidden=11, d_out=5)
        original = {n: p.detach().clone() for n, p in model.named_parameters()}
        model, _ = fxshard.backend(compiler="eager", stage=3).prepare(model)
        params = dict(model.named_parameters())
        assert list(params) == list(original)
        # what a script reads of a parameter is the model's (the weight-decay rule `p.ndim < 2` groups rightly)
        assert {n: (p.shape, p.ndim, p.numel()) for n, p in params.items()} == {
            n: (v.shape, v.ndim, v.numel()) for n, v in original.items()}
        weight = params["fc1.weight"]
        assert isinstance(weight, DTensor) and weight.placements == (Shard(0),)
        # 11 rows of 7 over 3 ranks: 4 rows (28 elements) per rank; the last rank holds rows 8-10 and one row of
        # padding, in the flat shard its rows are a view of
        spec = spec_of(weight)
        assert (spec.full_shape, spec.chunk, spec.padding, spec.rank) == ((11, 7), 28, 7, 2)
        assert torch.equal(weight.to_local(), original["fc1.weight"][8:])  # its rows, as Shard(0) splits them
        flat = prepared_param(weight).flat
        assert flat.shape == (28,) and weight.to_local().data_ptr() == flat.data_ptr()
        assert flat[21:].eq(0).all()  # padding is zero, so it adds nothing to norms or updates


def test_state_dict_is_full_and_unpadded_and_loads_full_tensors(pools):
    for rank, result in enumerate(pools(3).run(scenarios.state_dict_round_trip)):
        for name, value in result["original"].items():
            assert torch.equal(result["gathered"][name], value), name
            assert torch.equal(result["reloaded"][name], result["replacement"][name]), name
        rows = result["shards"]["fc2.bias"]  # 5 elements over 3 ranks: 2, 2, 1 (+ 1 of padding in the flat shard)
        assert torch.equal(rows, result["replacement"]["fc2.bias"][2 * rank : 2 * rank + 2])


def test_tied_parameter_is_one_shard():
    with fake_process_group(2):
        model, _ = fxshard.backend(compiler="eager", stage=3).prepare(GPT())
        assert model.tok_emb._parameters["weight"] is model.lm_head._parameters["weight"]
        assert len(list(model.parameters())) == len({id(p) for p in model.parameters()})


def test_buffers_stay_replicated():
    with fake_process_group(2):
        model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
        running_mean = model[1].running_mean
        model, _ = fxshard.backend(compiler="eager", stage=3).prepare(model)
        assert model[1].running_mean is running_mean and running_mean.shape == (6,)


def test_frozen_parameters_are_sharded_and_get_no_reduce_scatter():
    with fake_process_group(2):
        torch._dynamo.reset()
        model = MLP()
        model.fc1.requires_grad_(False)
        backend = fxshard.backend(compiler="eager", stage=3)
        model, _ = backend.prepare(model)
        assert model.fc1._parameters["weight"].to_local().shape == (8, 8)  # 16 rows over 2 ranks
        assert not model.fc1._parameters["weight"].requires_grad
        torch.compile(model, backend=backend, fullgraph=True)(torch.randn(4, 8)).sum().backward()
        assert model.fc1._parameters["weight"].grad is None
    backward = next(r.final for r in backend.graphs if r.kind == "backward")
    assert [(r["kind"], r["unit"]) for r in collectives(backward) if r["kind"] == "reduce_scatter"] == [
        ("reduce_scatter", "fc2")
    ]


@pytest.mark.parametrize("stage", [2, 3])
def test_a_parameter_frozen_after_prepare_gets_no_gradient_and_no_update(stage):
    with fake_process_group(2):
        torch._dynamo.reset()
        backend = fxshard.backend(compiler="eager", stage=stage)
        model = MLP()
        model, opt = backend.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        run = torch.compile(model, backend=backend, fullgraph=True)
        run(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        model.fc1.requires_grad_(False)  # as a script freezes a layer to fine-tune the rest
        frozen = prepared_param(model.fc1._parameters["weight"]).flat
        before = frozen.detach().clone()
        for forward in (run, model):  # compiled (a new graph: Dynamo guards on it) and eager
            forward(torch.randn(4, 8)).sum().backward()
            assert model.fc1._parameters["weight"].grad is None and model.fc2._parameters["weight"].grad is not None
            opt.step()
            opt.zero_grad()
        assert torch.equal(frozen.detach(), before)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_dropped_prepared_model_and_optimizer_free_their_tensors(stage):
    import gc
    import weakref

    with fake_process_group(2):
        model = MLP()
        backend = fxshard.backend(compiler="eager", stage=stage)
        model, opt = backend.prepare(model, torch.optim.AdamW(model.parameters()))
        leaf = model.fc1._parameters["weight"]
        record = prepared_param(leaf)
        held = [weakref.ref(t) for t in (leaf, record.flat, record.master) if t is not None]
        del record
        del model, opt, leaf, backend
        gc.collect()
        assert [ref() for ref in held] == [None] * len(held)


def test_optimizer_keeps_class_groups_and_hyperparameters():
    with fake_process_group(2):
        model = MLP()
        opt = torch.optim.AdamW(
            [{"params": model.fc1.parameters(), "lr": 0.1}, {"params": model.fc2.parameters()}],
            lr=0.01, betas=(0.8, 0.9), weight_decay=0.3,
        )
        model, sharded = fxshard.backend(compiler="eager", stage=3).prepare(model, opt)
    assert type(sharded) is torch.optim.AdamW
    assert [g["lr"] for g in sharded.param_groups] == [0.1, 0.01]
    assert all(g["betas"] == (0.8, 0.9) and g["weight_decay"] == 0.3 for g in sharded.param_groups)
    assert sharded.param_groups[0]["params"] == [model.fc1._parameters["weight"], model.fc1._parameters["bias"]]


def test_existing_optimizer_state_is_sharded_not_lost():
    with fake_process_group(2, rank=1):
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
        momentum = opt.state[model.fc2.weight]["momentum_buffer"].clone()
        model, sharded = fxshard.backend(compiler="eager", stage=3).prepare(model, opt)
        shard_state = sharded.state[model.fc2._parameters["weight"]]["momentum_buffer"]
    # rank 1 of 2 holds rows 3 and 4 of the (5, 16) weight, then one row of padding: the flat shard the update runs on
    assert torch.equal(shard_state[:32], momentum[3:].flatten()) and shard_state[32:].eq(0).all()


def test_registered_backend_name():
    with fake_process_group(2):
        torch._dynamo.reset()
        model, _ = fxshard.backend(compiler="eager", stage=3).prepare(MLP())
        out = torch.compile(model, backend="fxshard", options={"stage": 3}, fullgraph=True)(torch.randn(4, 8))
        assert out.shape == (4, 5)


class _BreakThenNoParameters(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        torch._dynamo.graph_break()
        return (y * 2).tanh().sum()  # a graph of its own that reads no parameter


def test_registered_backend_compiles_the_graphs_after_a_graph_break_with_the_preparing_backend():
    records, reports = {}, {}
    for how in ("backend=backend", 'backend="fxshard"'):
        with fake_process_group(2):
            torch._dynamo.reset()
            backend = fxshard.backend(compiler="eager", stage=3)
            model, _ = backend.prepare(_BreakThenNoParameters())
            compiled = torch.compile(model, backend=backend) if how == "backend=backend" else \
                torch.compile(model, backend="fxshard", options={"compiler": "eager"})
            compiled(torch.randn(4, 8)).backward()
            records[how] = [(r.graph_id, r.kind) for r in backend.graphs]
            reports[how] = backend.report().split("fxshard's compile time:")[0]  # all but the seconds it took
    assert records["backend=backend"] == records['backend="fxshard"']
    assert len({graph_id for graph_id, _ in records['backend="fxshard"']}) == 2  # both graphs of the break
    assert reports["backend=backend"] == reports['backend="fxshard"']


def test_the_report_gives_fxshards_own_compile_time_by_phase():
    backend = scenarios.compiled_model("chain", 3)
    report = backend.report()
    section = report[report.index("fxshard's compile time:"):].splitlines()
    phases = {line.split()[0]: float(line.split()[-1]) for line in section[3:]}
    # every pass of the pipeline, the copies of the pass history, the simulator's trials of the knobs (a chain
    # has no repeated block: one grouping, no trial) and the check that every rank compiled the same collectives
    assert {p.__name__ for p in backend.passes} | {"pass", "consistency"} <= set(phases), phases
    total = float(section[0].split(": ")[1].split()[0])
    assert total == pytest.approx(sum(phases.values()), abs=0.01 * len(phases))
    graphs = [r for r in backend.graphs if r.seconds]
    assert f"over {len(graphs)} graphs" in section[0]
