"""Sharded checkpoints through torch.distributed.checkpoint: the layout, resuming at the same and at another world
size and stage, FSDP2 in both directions, misuse refused before anything changes, the memory a save takes, and
train_gpt.py resuming bit-exactly after a rank was killed in the middle of a save.

The checkpoints are saved once per world size (2 and 3: a module fixture, one pool run each) at stages 0 to 3;
the tests of one world size's checkpoints assert on that run, those that reshard load them at the other world size."""

import math
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
from torch.distributed.tensor import Shard

import checkpoint_scenarios
import scenarios

# Resuming at another world size or stage: the global batch's rows are summed in another order, and AdamW divides by
# the square root of a second moment that is tiny after two steps, so the losses agree to float32 rounding only.
RESHARDED_TOLERANCE = 1e-5
ROOT = pathlib.Path(__file__).resolve().parents[1]
WORLDS = [2, 3]
MLP_SHAPES = {"fc1.weight": (16, 8), "fc1.bias": (16,), "fc2.weight": (5, 16), "fc2.bias": (5,)}


def _close(got: list[float], want: list[float]) -> bool:
    return all(math.isclose(g, w, rel_tol=RESHARDED_TOLERANCE) for g, w in zip(got, want, strict=True))


def _other(world: int) -> int:
    return 5 - world  # the checkpoints of world 2 load at world 3 and the other way round


def _local_rows(rows: int, world: int, rank: int) -> int:
    """The rows ``rank`` holds under Shard(0): torch.chunk's split, ranks past the last chunk holding none."""
    chunks = torch.arange(rows).chunk(world)
    return chunks[rank].numel() if rank < len(chunks) else 0


@pytest.fixture(scope="module")
def saved(pools, tmp_path_factory):
    """``saved(world)``: the directory of the checkpoints saved at that world size and every rank's results of
    ``save_and_continue`` (stage 3), with ``save_at_stages``'s (stages 0, 1, 2) under ``"stages"``."""
    made = {}

    def at(world: int):
        if world not in made:
            directory = tmp_path_factory.mktemp(f"checkpoints_world_{world}")
            at_stage_3 = pools(world).run(checkpoint_scenarios.save_and_continue, str(directory))
            at_stages = pools(world).run(checkpoint_scenarios.save_at_stages, str(directory))
            made[world] = directory, [{**a, "stages": b} for a, b in zip(at_stage_3, at_stages, strict=True)]
        return made[world]

    return at


def test_local_rows_follow_torch_chunk():
    assert [_local_rows(16, 3, r) for r in range(3)] == [6, 6, 4]
    assert [_local_rows(5, 3, r) for r in range(3)] == [2, 2, 1]
    assert [_local_rows(4, 3, r) for r in range(3)] == [2, 2, 0]


@pytest.mark.parametrize("world", WORLDS)
def test_each_rank_holds_dtensors_of_the_full_shape_split_by_rows(saved, world):
    _, results = saved(world)
    for rank, result in enumerate(results):
        for name, shape in MLP_SHAPES.items():
            # shards hold whole rows: always a view of the flat shard, even where the rows split unevenly
            want = {"type": "DTensor", "shape": shape, "placements": (Shard(0),), "mesh_size": world,
                    "local_shape": (_local_rows(shape[0], world, rank), *shape[1:]), "view_of_shard": True}
            assert result["model_layout"][name] == want, (rank, name)
            for kind in ("exp_avg", "exp_avg_sq"):
                assert result["optim_layout"][f"{name}.{kind}"] == want, (rank, name, kind)
            assert result["optim_layout"][f"{name}.step"] == {"type": "Tensor", "shape": ()}, (rank, name)
        assert result["model_layout"].keys() == MLP_SHAPES.keys()
        assert result["same_as_torch"]  # torch's get_state_dict gives what fxshard.checkpoint.get_state_dict gives
    full_elements = sum(v.numel() for v in results[0]["full_model"].values())
    assert sum(r["local_model_elements"] for r in results) == full_elements  # every element on exactly one rank


@pytest.mark.parametrize("world", WORLDS)
def test_resume_at_the_same_world_size_and_stage_is_bit_exact(saved, world):
    for result in saved(world)[1]:
        assert result["state_after_template"] == 0  # a fresh optimizer's template adds no state of its own ...
        for way in ("resumed_plain", "resumed_torch_api", "resumed_saved"):  # ... and still loads the saved state
            assert result[way] == result["after"], way
        assert result["extra"] == {"step": checkpoint_scenarios.STEPS_BEFORE}
        assert sorted(result["stages"]) == [0, 1, 2]
        for stage, runs in result["stages"].items():  # model/opt.state_dict() and torch's get/set_state_dict
            assert runs["resumed_plain"] == runs["after"], (stage, runs)
            assert runs["resumed_named"] == runs["after"], (stage, runs)
            assert runs["same_as_ours"], stage  # torch's get_state_dict = fxshard.checkpoint's, stage 1 included


@pytest.mark.parametrize("world", WORLDS)
def test_the_full_state_dict_is_gathered_to_the_first_rank_only(saved, world):
    first, *others = saved(world)[1]
    assert len(others) == world - 1
    for other in others:
        assert other["full_model"] == {} and other["full_optim"] == {}
        assert other["initial_full_model"] == {}
    # before training: exactly the single-process model prepare was given
    assert first["initial_full_model"].keys() == first["single_process_initial"].keys() == MLP_SHAPES.keys()
    for name, want in first["single_process_initial"].items():
        assert torch.equal(first["initial_full_model"][name], want), name
    # after training: every parameter exactly as gathered straight from the flat shards (on every rank)
    assert first["full_model"].keys() == MLP_SHAPES.keys()
    for name, value in first["full_model"].items():
        assert type(value) is torch.Tensor and tuple(value.shape) == MLP_SHAPES[name], name
        for result in saved(world)[1]:
            assert torch.equal(value, result["gathered_model"][name]), name
    assert first["full_optim"]["state"].keys() == first["every_rank_full_optim"]["state"].keys() == MLP_SHAPES.keys()
    for name, state in first["every_rank_full_optim"]["state"].items():
        assert first["full_optim"]["state"][name].keys() == state.keys()
        for kind, value in state.items():
            assert torch.equal(first["full_optim"]["state"][name][kind], value), (name, kind)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_at_another_world_size_and_stage(saved, pools, world, stage):
    directory, results = saved(world)
    for result in pools(_other(world)).run(checkpoint_scenarios.resume_at_stage, str(directory), stage):
        # the stage-3 checkpoints, and those saved at another of the stages 0-2
        assert _close(result["through_load"], results[0]["after"]), (result, results[0]["after"])
        assert _close(result["through_plain"], results[0]["after"]), (result, results[0]["after"])
        source = result["source"]
        assert source != stage
        assert _close(result["named_from_stage"], results[0]["stages"][source]["after"]), (result, source)
        assert _close(result["plain_from_stage"], results[0]["stages"][source]["after"]), (result, source)


@pytest.mark.parametrize("stage", [1, 3])
def test_resume_on_a_hybrid_mesh(saved, pools, stage):
    # the world-2 checkpoint loads onto 2 replicas of 2-rank shard groups; a checkpoint saved there (each replica
    # group writes the same rows) resumes bit-exactly on the same mesh
    directory, results = saved(2)
    mesh_results = pools(4).run(checkpoint_scenarios.resume_on_a_mesh, str(directory), stage, (2, 2))
    for result in mesh_results:
        assert _close(result["resharded"], results[0]["after"]), (result, results[0]["after"])
        assert result["resumed"] == result["continued"]
    # the full state dict reaches the mesh's first rank only, gathered by its shard group (ranks 0 and 1) alone
    assert [r["full_state_dict"] for r in mesh_results] == ["exact", "empty", "empty", "empty"]
    assert [r["gathers"] > 0 for r in mesh_results] == [True, True, False, False]


@pytest.mark.parametrize("world", WORLDS)
def test_checkpoints_move_between_fsdp2_and_fxshard(saved, pools, world):
    directory, results = saved(world)
    for result in pools(_other(world)).run(checkpoint_scenarios.fsdp2_interop, str(directory)):
        assert sorted(result["fxshard_from_fsdp2"]) == [0, 1, 2, 3]
        for stage, losses in result["fxshard_from_fsdp2"].items():  # FSDP2 -> fxshard at every stage
            assert _close(losses, result["fsdp2_after"]), (stage, result)
        assert sorted(result["fsdp2_from_fxshard"]) == [1, 2, 3]
        for stage, losses in result["fsdp2_from_fxshard"].items():  # fxshard at stages 1, 2, 3 -> FSDP2
            want = results[0]["after"] if stage == 3 else results[0]["stages"][stage]["after"]
            assert _close(losses, want), (stage, result)


MISUSES = {  # what each misuse's FxShardError says (docs/checkpointing.md's table)
    "other model": "not a checkpoint of this model and optimizer: "
                   "model.fc1.weight has shape [11, 7] there, [16, 8] here",
    "other state dict": "the model state dict is not this model's: shapes fc1.weight [11, 7] (the model: [16, 8])",
    "other optimizer state dict": "the state dict holds [11, 7], the parameter fc1.weight has shape [16, 8]",
    "missing shard": "shard file __1_0.distcp is missing",
    "truncated shard": "shard file __1_0.distcp is ",
    "partial": "step_000002.partial is not a complete checkpoint (no .metadata)",
    "no such directory": "step_000099 is not a complete checkpoint (no .metadata)",
    "save into an existing path": "saved exists; save each checkpoint into a new directory",
    "broadcast_from_rank0": "StateDictOptions(broadcast_from_rank0=True) is not supported",
}


@pytest.mark.parametrize("world", WORLDS)
def test_misuse_is_refused_before_anything_changes(saved, pools, world):
    directory, _ = saved(world)
    results = pools(world).run(checkpoint_scenarios.misuse_is_refused, str(directory))
    for result in results:
        errors = result["errors"]
        assert errors.keys() == MISUSES.keys()
        for misuse, message in MISUSES.items():
            assert errors[misuse] is not None and message in errors[misuse], (misuse, errors[misuse])
            assert result["unchanged"][misuse], misuse  # parameters, optimizer state, hyperparameters
        assert "bytes," in errors["truncated shard"] and "needed" in errors["truncated shard"], errors
        assert result["saved_untouched"]  # the refused save wrote nothing into the existing checkpoint
        assert result["raw_dcp_error"] == "CheckpointException"  # DCP's own recipe: DCP's own error
        assert result["latest"] == "step_000001"  # not the .partial, not the directory without .metadata
    assert all(r["errors"] == results[0]["errors"] for r in results)  # every rank raises the same error


def test_a_stage_3_save_gathers_nothing_even_where_rows_split_unevenly(pools, tmp_path):
    for result in pools(2).run(checkpoint_scenarios.peak_during_save, str(tmp_path)):
        # Every weight's 255 rows split 128 / 127 over 2 ranks: shards hold whole rows, so each state-dict value
        # (the weight and its two AdamW states) is a view of this rank's shard, gathered nowhere
        assert result["gathered"] == result["most_gathered_at_once"] == 0, result
        # DCP copies a view whose storage holds more than it (rank 1's rows, before its padding row) to write it:
        # at most this rank's shards (docs/checkpointing.md has the figures), never a whole parameter beyond them
        assert result["peak"] < result["local"] + result["largest_parameter"], result


TRAIN_GPT_FLAGS = ["--eager", "--steps", "4", "--checkpoint-every", "1"]


def _train_gpt(directory: pathlib.Path, *flags: str, script: pathlib.Path = ROOT / "examples" / "train_gpt.py"):
    command = [sys.executable, str(script), *TRAIN_GPT_FLAGS, "--checkpoint-dir", str(directory), *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def _losses(stdout: str) -> dict[int, str]:
    return {int(step): loss for step, loss in re.findall(r"^step\s+(\d+)\s+loss (\S+)", stdout, re.MULTILINE)}


def test_train_gpt_resumes_bit_exactly_after_a_kill_in_the_middle_of_a_save(pools, tmp_path):
    # the uninterrupted run on the suite's pool, the others spawning their own ranks: the same numbers either way
    whole = pools(2).run(scenarios.example_output, "train_gpt",
                         [*TRAIN_GPT_FLAGS, "--checkpoint-dir", str(tmp_path / "whole")])[0]
    killed = _train_gpt(tmp_path / "killed", script=pathlib.Path(__file__).with_name("kill_during_save.py"))
    assert killed.returncode != 0, killed.stdout
    left = sorted(p.name for p in (tmp_path / "killed").iterdir())
    assert left == ["step_000001", "step_000002.partial"], left  # rank 1 died while step 2 was being written
    resumed = _train_gpt(tmp_path / "killed", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and "step_000001 at step 1" in resumed.stdout, resumed.stdout
    after = _losses(resumed.stdout)
    assert sorted(after) == [1, 2, 3]
    assert after == {step: loss for step, loss in _losses(whole).items() if step >= 1}


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("with_scalar", [False, True])
def test_a_state_dict_taken_on_the_first_rank_only_returns_its_rows_without_communicating(pools, stage, with_scalar):
    # a 0-d parameter has no rows to split: every rank holds it whole (a plain tensor) at stages 2 and 3
    first, second = pools(2).run(scenarios.state_dict_on_the_first_rank_only, stage, 2.0, with_scalar)
    prefix, scalar = ("mlp.", {"temperature": "Tensor"}) if with_scalar else ("", {})
    assert first["saved"] == {**{f"{prefix}{name}": "DTensor" for name in ("fc1.weight", "fc1.bias", "fc2.weight",
                                                                           "fc2.bias")}, **scalar}, first
    assert first["seconds"] < 1.0 and second["saved"] == {}


def test_a_first_rank_only_state_dict_that_gathers_a_0_d_master_fails_naming_state_dict_and_the_right_form(pools):
    # stage 1 under mixed precision saves the fp32 master, and a 0-d one lives on one rank: state_dict() gathers it
    try:
        first, second = pools(2).run(scenarios.state_dict_on_the_first_rank_only, 1, 2.0, True, torch.bfloat16)
    finally:
        pools(2).close()  # rank 0's group timed out: the next test gets fresh ranks
    assert second == {"saved": {}, "seconds": second["seconds"]}
    assert "model.state_dict(), which gathers" in first["error"], first
    assert "full_state_dict=True" in first["error"] and "on every rank" in first["error"], first
    assert 2.0 <= first["seconds"] < 10.0
