"""The gloo worker pool the distributed tests share."""

import pytest

import scenarios
from fxshard.testing import WorkerError, rank_and_world


def test_a_rank_killed_by_a_signal_fails_the_run_naming_rank_signal_and_last_output(pools):
    with pytest.raises(WorkerError) as failure:
        pools(2).run(scenarios.rank_one_dies, "SIGABRT")
    assert failure.value.deaths == {1: "SIGABRT"}
    message = str(failure.value)
    assert "rank_one_dies: rank(s) [1] died" in message
    assert "rank 1 died (SIGABRT)" in message and "rank 1: last words before the signal" in message
    survived, rank0_error = failure.value.outcomes[0]  # the survivor's own error follows from the death
    assert not survived and "Connection" in rank0_error, rank0_error
    assert pools(2).run(rank_and_world) == [(0, 2), (1, 2)]  # the next run gets fresh ranks
