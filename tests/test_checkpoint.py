"""Sharded checkpoints through torch.distributed.checkpoint: the layout, resuming at the same and at another world
size and stage, FSDP2 in both directions, misuse refused before anything changes, the memory a save takes, and
train_gpt.py resuming bit-exactly after a rank was killed in the middle of a save.

One world-2 run saves the checkpoints (module fixture); the world-3 tests load them."""

import math
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import checkpoint_scenarios

# Resuming at another world size or stage: the global batch's rows are summed in another order, and AdamW divides by
# the square root of a second moment that is tiny after two steps, so the losses agree to float32 rounding only.
RESHARDED_TOLERANCE = 1e-5
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _close(got: list[float], want: list[float]) -> bool:
    return all(math.isclose(g, w, rel_tol=RESHARDED_TOLERANCE) for g, w in zip(got, want, strict=True))


@pytest.fixture(scope="module")
def saved(pools, tmp_path_factory):
    directory = tmp_path_factory.mktemp("checkpoints")
    return directory, pools(2).run(checkpoint_scenarios.save_and_continue, str(directory))


def test_each_rank_holds_dtensors_of_the_full_shape_split_by_rows(saved):
    _, results = saved
    for rank, result in enumerate(results):
        # fc1's 16 rows split evenly (a view of the flat shard); fc2's 5 rows as torch.chunk splits them: 3 and 2
        assert result["layouts"]["fc1.weight"] == ("DTensor", (16, 8), 8)
        assert result["layouts"]["fc2.weight"] == ("DTensor", (5, 16), 3 - rank)
        assert result["same_as_torch"]  # torch's get_state_dict gives what fxshard.checkpoint.get_state_dict gives
    full_elements = sum(v.numel() for v in results[0]["full_model"].values())
    assert sum(r["local_model_elements"] for r in results) == full_elements  # every element on exactly one rank


def test_resume_at_the_same_world_size_and_stage_is_bit_exact(saved):
    for result in saved[1]:
        assert result["state_after_template"] == 0  # a fresh optimizer's template adds no state of its own ...
        for way in ("resumed_plain", "resumed_torch_api", "resumed_saved"):  # ... and still loads the saved state
            assert result[way] == result["after"], way
        assert result["extra"] == {"step": checkpoint_scenarios.STEPS_BEFORE}


def test_the_full_state_dict_is_gathered_to_the_first_rank_only(saved):
    first, second = saved[1]
    assert second["full_model"] == {} and second["full_optim"] == {}
    assert first["full_model"]["fc1.weight"].shape == (16, 8)
    for name, state in first["every_rank_full_optim"]["state"].items():
        for kind, value in state.items():
            assert torch.equal(first["full_optim"]["state"][name][kind], value), (name, kind)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_at_another_world_size_and_stage(saved, pools, stage):
    directory, results = saved
    for result in pools(3).run(checkpoint_scenarios.resume_at_stage, str(directory), stage):
        assert _close(result["through_load"], results[0]["after"]), (result, results[0]["after"])
        assert _close(result["through_plain"], results[0]["after"]), (result, results[0]["after"])


@pytest.mark.parametrize("stage", [1, 3])
def test_resume_on_a_hybrid_mesh(saved, pools, stage):
    # the world-2 checkpoint loads onto 2 replicas of 2-rank shard groups; a checkpoint saved there (each replica
    # group writes the same rows) resumes bit-exactly on the same mesh
    directory, results = saved
    mesh_results = pools(4).run(checkpoint_scenarios.resume_on_a_mesh, str(directory), stage, (2, 2))
    for result in mesh_results:
        assert _close(result["resharded"], results[0]["after"]), (result, results[0]["after"])
        assert result["resumed"] == result["continued"]
    # the full state dict reaches the mesh's first rank only, gathered by its shard group (ranks 0 and 1) alone
    assert [r["full_state_dict"] for r in mesh_results] == ["exact", "empty", "empty", "empty"]
    assert [r["gathers"] > 0 for r in mesh_results] == [True, True, False, False]


def test_checkpoints_move_between_fsdp2_and_fxshard(saved, pools):
    directory, results = saved
    for result in pools(3).run(checkpoint_scenarios.fsdp2_interop, str(directory)):
        assert _close(result["fxshard_from_fsdp2"], result["fsdp2_after"]), result  # FSDP2 -> fxshard stage 1
        assert _close(result["fsdp2_from_fxshard"], results[0]["after"]), result  # fxshard stage 3 -> FSDP2


def test_misuse_is_refused_before_anything_changes(saved, pools):
    directory, _ = saved
    for result in pools(2).run(checkpoint_scenarios.misuse_is_refused, str(directory)):
        errors = result["errors"]
        assert "is not a checkpoint of this model and optimizer" in errors["other model"], errors
        assert "fc1.weight" in errors["other state dict"], errors
        assert "shard file __1_0.distcp is missing" in errors["missing shard"], errors
        assert result["unchanged"]


def test_a_stage_3_save_gathers_one_parameter_at_a_time(pools, tmp_path):
    for result in pools(2).run(checkpoint_scenarios.peak_during_save, str(tmp_path)):
        # Every weight's rows split unevenly over 2 ranks: the weight and its two AdamW states are each gathered to
        # cut this rank's rows out, one after the other, each dropped before the next is gathered.
        assert result["gathered"] == result["uneven_tensors"] == 24, result
        assert result["most_gathered_at_once"] == 1, result
        # The allocator's view (docs/checkpointing.md has the figures: the copies of this rank's rows plus 1.4 to 10
        # weights' worth, some gather buffers freed late outside fxshard) stays below gathering it all at once.
        assert result["peak"] < result["local"] + result["full"], result


def _train_gpt(directory: pathlib.Path, *flags: str, script: pathlib.Path = ROOT / "examples" / "train_gpt.py",
               torchrun: bool = False):
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] if torchrun else []
    command = [sys.executable, *launcher, str(script), "--eager", "--steps", "4", "--checkpoint-every", "1",
               "--checkpoint-dir", str(directory), *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def _losses(stdout: str) -> dict[int, str]:
    return {int(step): loss for step, loss in re.findall(r"^step\s+(\d+)\s+loss (\S+)", stdout, re.MULTILINE)}


def test_train_gpt_resumes_bit_exactly_after_a_kill_in_the_middle_of_a_save(tmp_path):
    # the uninterrupted run under torchrun (env://), the others spawning their own ranks: the same numbers either way
    whole = _train_gpt(tmp_path / "whole", torchrun=True)
    assert whole.returncode == 0, whole.stderr
    killed = _train_gpt(tmp_path / "killed", script=pathlib.Path(__file__).with_name("kill_during_save.py"))
    assert killed.returncode != 0, killed.stdout
    left = sorted(p.name for p in (tmp_path / "killed").iterdir())
    assert left == ["step_000001", "step_000002.partial"], left  # rank 1 died while step 2 was being written
    resumed = _train_gpt(tmp_path / "killed", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and "step_000001 at step 1" in resumed.stdout, resumed.stdout
    after = _losses(resumed.stdout)
    assert sorted(after) == [1, 2, 3]
    assert after == {step: loss for step, loss in _losses(whole.stdout).items() if step >= 1}
