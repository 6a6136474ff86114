"""The optimizer prepare returns: clipping across shards, checkpoints, and refusing optimizers that would train
silently wrong."""

import pytest
import torch

import fxshard
import scenarios
from examples.models import MLP
from fxshard.prepare import MASTER_OF, spec_of
from fxshard.sharding import shard_of
from fxshard.testing import fake_process_group
from test_numerics import STEPS, assert_matches_reference


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_clip_grad_norm_is_the_whole_models_norm(pools, stage):
    # max_norm below every step's gradient norm, so every step clips: a per-rank (shard) norm would clip by a
    # different factor on each rank and the parameters would leave the reference.
    for result in pools(2).run(scenarios.train_against_reference, "mlp", "sgd", STEPS, stage=stage, clip=0.05):
        assert all(norm > 0.05 for norm in result["reference_norms"])
        assert result["norms"] == pytest.approx(result["reference_norms"], rel=1e-6)
        assert_matches_reference(result, "sgd")


@pytest.mark.parametrize("stage", [1, 3])
def test_sharded_optimizer_state_dict_resumes_training_exactly(pools, stage):
    for rank, result in enumerate(pools(2).run(scenarios.resume_from_checkpoint, stage)):
        for name, value in result["uninterrupted"].items():
            assert torch.equal(result["resumed"][name], value), name
        assert result["saved_exp_avg_elements"] == result["shard_elements"]  # this rank's shards, not full tensors


@pytest.mark.parametrize("stage", [1, 2])
def test_stepping_another_optimizer_over_a_prepared_model_is_refused(stage):
    with fake_process_group(2):
        model, _ = fxshard.backend(stage=stage).prepare(MLP())
        with pytest.raises(fxshard.FxShardError, match="not the one backend.prepare returned"):
            torch.optim.SGD(model.parameters(), lr=0.1).step()


def test_an_optimizer_over_the_parameters_prepare_replaced_is_refused():
    with fake_process_group(2):
        model = MLP()
        stale = torch.optim.SGD(model.parameters(), lr=0.1)  # built before prepare, and not passed to it
        fxshard.backend(stage=3).prepare(model)
        with pytest.raises(fxshard.FxShardError, match="replaced by its shard"):
            stale.step()
        torch.optim.SGD(model.parameters(), lr=0.1).step()  # stage 3's shard leaves need nothing from the step


@pytest.mark.parametrize("stage", [0, 1])
def test_load_state_dict_of_full_parameter_stages(stage):
    with fake_process_group(2, rank=1):
        model, _ = fxshard.backend(stage=stage).prepare(MLP())
        replacement = {k: torch.full_like(v, float(i)) for i, (k, v) in enumerate(model.state_dict().items())}
        model.load_state_dict(replacement)
        for name, value in model.state_dict().items():
            assert torch.equal(value, replacement[name]), name
        if stage == 1:  # the master shards the optimizer updates follow the load
            for name, param in model.named_parameters():
                master = MASTER_OF[param]
                assert torch.equal(master, shard_of(replacement[name], spec_of(master))), name
