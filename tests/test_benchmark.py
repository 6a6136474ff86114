"""The benchmark's bookkeeping (examples/benchmark.py): pure functions only, no processes, no timing."""

from examples.benchmark import CONFIGS, loss_disagreements, peak_of_running_sum, ring_bytes_sent, unsettled


def test_every_fxshard_stage_has_a_prefetch_and_a_no_prefetch_row():
    fxshard_rows = {(c.stage, c.options.get("prefetch")) for c in CONFIGS if c.kind == "fxshard"}
    assert fxshard_rows == {(stage, prefetch) for stage in range(4) for prefetch in (None, 0)}
    assert [c.name for c in CONFIGS[:3]] == ["ddp", "fsdp2", "fsdp2+compile"]


def test_peak_of_running_sum():
    assert peak_of_running_sum([]) == 0
    assert peak_of_running_sum([-5, -3]) == 0  # frees of blocks from before never go below the start
    assert peak_of_running_sum([10, 20, -20, 5, -15]) == 30


def test_ring_bytes_sent():
    # world 2: an all-reduce sends half its buffer twice, an all-gather sends its whole input once
    assert ring_bytes_sent({"AR": [3, 1000], "AG": [2, 400]}, world=2) == 1000 + 400
    assert ring_bytes_sent({"AG": [1, 300]}, world=4) == 900


def test_loss_disagreements_names_the_outlier_against_the_median():
    good = [7.61, 6.0187]
    losses = {"ddp": good, "fsdp2": [7.61, 6.0187 * (1 + 1e-4)], "fxshard-3-prefetch": [7.61, 6.5]}
    problems = loss_disagreements(losses)
    assert list(problems) == ["fxshard-3-prefetch"] and "final loss 6.500000" in problems["fxshard-3-prefetch"]
    assert "first loss" in loss_disagreements({"a": good, "b": good, "c": [7.62, 6.0187]})["c"]


def test_unsettled_compares_the_medians_of_the_two_halves():
    assert unsettled([0.2, 0.21, 0.2, 0.19, 0.2, 0.2]) is None
    assert unsettled([0.2, 0.2, 0.2, 0.3, 0.3, 0.3]) == (0.2, 0.3)
    assert unsettled([0.2, 0.5]) is None  # too few steps to tell
