"""Stage 3 keeps only shards resident: no full weight is stored, saved for backward, or alive between steps."""

import pytest

import scenarios


@pytest.fixture(scope="module")
def default_run(pools):
    return pools(2).run(scenarios.memory_of_training)


def test_resident_state_is_shards_only(default_run):
    for result in default_run:
        for name, (nbytes, shard_bytes) in result["storage"].items():
            assert nbytes == shard_bytes, name  # the parameter's rows are a view of its padded flat shard, no more
        shard_shapes = set(result["flat_shard_shapes"].values())
        assert all(len(shape) == 1 for shape in shard_shapes)
        assert result["optimizer_state_shapes"] <= shard_shapes  # AdamW's m and v are flat shards too


def test_no_full_weight_alive_between_steps(default_run):
    for result in default_run:
        assert result["alive_full_weights"] == []


def test_forward_saves_no_full_weight_for_backward(default_run):
    for result in default_run:
        assert result["saved_full_weights"] == []


def test_reshard_after_forward_false_keeps_gathered_weights_for_backward(pools):
    # The check above can fail: without resharding (no recompute tags) the partitioner saves gathered weights.
    for result in pools(2).run(scenarios.memory_of_training, reshard_after_forward=False):
        assert "blocks.0.fc.weight" in result["saved_full_weights"]
        assert result["alive_full_weights"] == []  # ... but only from forward to backward
