"""Every misuse raises FxShardError saying what to do, never a hang or a silent wrong result."""

import pytest
import torch
from torch import nn

import fxshard
from examples.models import MLP
from fxshard.passes.context import PassContext
from fxshard.runtime.groups import COLLECTIVE_TIMEOUT_S
from fxshard.testing import fake_process_group


@pytest.fixture
def fake_world():
    torch._dynamo.reset()
    with fake_process_group(2):
        yield


@pytest.mark.parametrize("stage", [-1, 4, "3", None])
def test_stage_outside_0_to_3(stage):
    with pytest.raises(fxshard.FxShardError, match="stage must be one of 0, 1, 2, 3"):
        fxshard.backend(compiler="eager", stage=stage)


def test_unknown_compiler():
    with pytest.raises(fxshard.FxShardError, match="compiler must be one of"):
        fxshard.backend(stage=3, compiler="tvm")


def test_regional_is_a_bool():
    with pytest.raises(fxshard.FxShardError, match=r"regional must be True .* or False .*, got 'yes'"):
        fxshard.backend(stage=3, regional="yes")


@pytest.mark.parametrize("options, message", [
    ({"prefech": 2}, r"unknown backend option\(s\) \['prefech'\]; the options are .*prefetch"),
    ({"bucket": "model"}, 'bucket must be "layer", "block", "auto" or a positive byte cap, got .model.'),
    ({"bucket": "block"}, 'bucket="block" needs blocks='),
    ({"prefetch": -1}, "prefetch must be an int >= 0"),
    ({"max_inflight_gathers": 0}, "max_inflight_gathers must be an int >= 1"),
    ({"param_dtype": torch.int8}, "param_dtype must be a floating torch.dtype"),
    ({"reduce_dtype": "fp32"}, "reduce_dtype must be a floating torch.dtype"),
    ({"schedule": "prefetch-all"}, "schedule must be a function"),
    ({"memory_budget": 0}, "memory_budget must be a positive number of bytes"),
    ({"collective_timeout_s": 0}, "collective_timeout_s must be a positive number of seconds, got 0"),
    ({"collective_timeout_s": True}, "collective_timeout_s must be a positive number of seconds, got True"),
])
def test_bad_backend_options(options, message):
    with pytest.raises(fxshard.FxShardError, match=message):
        fxshard.backend(stage=3, **{"compiler": "eager", **options})


def test_a_rank_waits_30_seconds_for_its_peers_unless_told_otherwise():
    assert COLLECTIVE_TIMEOUT_S == 30
    assert PassContext.__dataclass_fields__["collective_timeout_s"].default == COLLECTIVE_TIMEOUT_S


def test_prepare_without_process_group():
    assert not torch.distributed.is_initialized()
    with pytest.raises(fxshard.FxShardError, match="init_process_group"):
        fxshard.backend(compiler="eager", stage=3).prepare(MLP())


def test_compiling_an_unprepared_model(fake_world):
    compiled = torch.compile(MLP(), backend=fxshard.backend(compiler="eager", stage=3), fullgraph=True)
    with pytest.raises(fxshard.FxShardError, match=r"did not shard \(L\['self'\]._modules\['fc1'\]"):
        compiled(torch.randn(4, 8))


def test_parameter_replaced_after_prepare_compiled(fake_world):
    backend = fxshard.backend(compiler="eager", stage=3)
    model, _ = backend.prepare(MLP())
    model.fc2.weight = nn.Parameter(torch.randn(5, 16))
    with pytest.raises(fxshard.FxShardError, match=r"_modules\['fc2'\]._parameters\['weight'\].*backend.prepare"):
        torch.compile(model, backend=backend, fullgraph=True)(torch.randn(4, 8))


def test_parameter_replaced_after_prepare_eager(fake_world):
    model, _ = fxshard.backend(compiler="eager", stage=3).prepare(MLP())
    model.fc1.weight = nn.Parameter(torch.randn(16, 8))
    with pytest.raises(fxshard.FxShardError, match="fc1.weight was replaced after prepare"):
        model(torch.randn(4, 8))


class GrowingMLP(MLP):
    """An MLP whose forward also uses a head that the user may attach later."""

    def forward(self, x):
        y = super().forward(x)
        return self.head(y) if hasattr(self, "head") else y


def test_layer_added_after_prepare(fake_world):
    backend = fxshard.backend(compiler="eager", stage=3)
    model, _ = backend.prepare(GrowingMLP())
    model.head = nn.Linear(5, 3)
    with pytest.raises(fxshard.FxShardError, match=r"_modules\['head'\]"):
        torch.compile(model, backend=backend, fullgraph=True)(torch.randn(4, 8))


def test_prepare_twice(fake_world):
    backend = fxshard.backend(compiler="eager", stage=3)
    model, _ = backend.prepare(MLP())
    with pytest.raises(fxshard.FxShardError, match="already prepared"):
        backend.prepare(model)


def test_unsupported_optimizer(fake_world):
    model = MLP()
    with pytest.raises(fxshard.FxShardError, match="LBFGS is not supported.*elementwise"):
        fxshard.backend(compiler="eager", stage=3).prepare(model, torch.optim.LBFGS(model.parameters()))


def test_optimizer_over_other_tensors(fake_world):
    model = MLP()
    stray = nn.Parameter(torch.zeros(3))
    with pytest.raises(fxshard.FxShardError, match="not parameters of the prepared model"):
        fxshard.backend(compiler="eager", stage=3).prepare(model, torch.optim.SGD([*model.parameters(), stray], lr=0.1))


@pytest.mark.parametrize("stage", [1, 2])
def test_converting_a_model_after_prepare(fake_world, stage):
    model, opt = fxshard.backend(compiler="eager", stage=stage).prepare(MLP(), None)
    with pytest.raises(fxshard.FxShardError, match="convert the model before backend.prepare"):
        model.double()
    with pytest.raises(fxshard.FxShardError, match="convert the model before backend.prepare"):
        model.fc1.to(torch.float16)  # a submodule too
    assert all(p.dtype == torch.float32 for p in model.parameters())  # refused before anything changed
    assert model.to(torch.float32) is model  # a conversion that changes nothing goes through


def test_compiling_with_another_backend_than_the_one_that_prepared(fake_world):
    preparer, other = fxshard.backend(stage=3), fxshard.backend(stage=3, prefetch=0)
    model, _ = preparer.prepare(MLP())
    compiled = torch.compile(model, backend=other, fullgraph=True)
    with pytest.raises(fxshard.FxShardError, match=rf"fc1.weight was prepared by fxshard.backend\(stage=3\) at "
                                                   rf"{id(preparer):#x} but is compiled with fxshard.backend\(stage=3, "
                                                   rf"prefetch=0\) at {id(other):#x}"):
        compiled(torch.randn(4, 8))
    assert other.graphs == [] and preparer.graphs == []


def test_the_registered_backend_compiles_with_the_backend_that_prepared(fake_world):
    backend = fxshard.backend(compiler="eager", stage=3)
    model, _ = backend.prepare(MLP())
    with pytest.raises(fxshard.FxShardError, match=r"the options contradict it: stage=2 \(prepared with 3\)"):
        torch.compile(model, backend="fxshard", options={"stage": 2}, fullgraph=True)(torch.randn(4, 8))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxshard", options={"stage": 3}, fullgraph=True)
    compiled(torch.randn(4, 8)).sum().backward()
    assert [r.kind for r in backend.graphs] == ["joint", "forward", "backward"]
    assert "all_gather" in backend.report() and "reduce_scatter" in backend.report()
    assert fxshard.report(compiled) == fxshard.report(model) == backend.report()
    with pytest.raises(fxshard.FxShardError, match="this MLP was not prepared by fxshard"):
        fxshard.report(MLP())


def test_a_recursion_error_in_torchs_trace_names_torch_and_the_workaround_documented_in_known_issues():
    import pathlib
    import re
    import sys

    from fxshard.compiler.backend import _torch_recursion_explained
    from fxshard.torch_compat import tree_flatten

    nested = []
    for _ in range(10 * sys.getrecursionlimit()):
        nested = [nested]
    with pytest.raises(fxshard.FxShardError, match=r"inside torch.*dynamic=False") as caught:
        with _torch_recursion_explained():
            tree_flatten(nested)  # torch's pytree recurses: it runs out inside torch
    assert isinstance(caught.value.__cause__, RecursionError)
    with pytest.raises(RecursionError):  # one that ran out in fxshard's own code stays itself
        with _torch_recursion_explained():
            raise RecursionError("maximum recursion depth exceeded")
    page, anchor = re.search(r"docs/(known-issues\.md)#([\w-]+)", str(caught.value)).groups()
    headings = (pathlib.Path(__file__).parents[1] / "docs" / page).read_text().splitlines()
    slugs = {re.sub(r"[^\w\- ]", "", h.lstrip("#").strip().lower()).replace(" ", "-") for h in headings
             if h.startswith("#")}
    assert anchor in slugs
