"""Runs that do not die, and die clearly when a peer does: fxshard's collectives run on a one-thread gloo group
(torch 2.13's gloo races between its worker threads: docs/known-issues.md), and a rank whose peer died or raised
ends with an FxShardError within the collective timeout."""

import pytest

import scenarios
from fxshard.testing import WorkerError, rank_and_world


def test_fxshard_communicates_on_a_gloo_group_with_one_worker_thread(pools):
    # Removing the workaround (collectives on the user's two-thread group) fails here: the race is too rare to test.
    assert pools(2).run(scenarios.worker_threads_of_groups) == [{"user": 2, "fxshard": 1}] * 2


def test_a_rank_killed_mid_forward_fails_the_pools_run_by_name_and_its_peer_at_once(pools):
    with pytest.raises(WorkerError) as failure:
        pools(2).run(scenarios.peer_fault, "sigkill_mid_forward", 5.0)
    # the pool names the dead rank, its signal and its last output lines, and never runs the function again
    assert failure.value.deaths == {1: "SIGKILL"}
    assert "peer_fault: rank(s) [1] died" in str(failure.value)
    assert "rank 1 died (SIGKILL)" in str(failure.value) and "rank 1: last words before SIGKILL" in str(failure.value)
    # the survivor's collective fails as soon as the dead rank's sockets close, with an error that says why
    survived, outcome = failure.value.outcomes[0]
    assert survived and outcome["step"] == 2, outcome
    assert outcome["error"].startswith("FxShardError: rank 0: a collective in the forward graph failed"), outcome
    assert "Another rank died" in outcome["error"] and outcome["seconds"] < 5.0  # not the timeout
    assert pools(2).run(rank_and_world) == [(0, 2), (1, 2)]  # the next run gets fresh ranks


def test_an_exception_in_one_ranks_loss_ends_its_peer_within_the_collective_timeout(pools):
    try:
        with pytest.raises(WorkerError) as failure:
            pools(2).run(scenarios.peer_fault, "raise_in_loss", 2.0)
    finally:
        pools(2).close()  # the ranks stopped in different places of one step: the next test gets fresh ones
    assert "ValueError: rank 1's loss could not be computed" in failure.value.outcomes[1][1]
    survived, outcome = failure.value.outcomes[0]
    assert survived and outcome["step"] == 2, outcome
    assert outcome["error"].startswith("FxShardError: rank 0: a collective in the backward graph failed"), outcome
    assert "Timed out" in outcome["error"] and "collective_timeout_s" in outcome["error"]
    assert 2.0 <= outcome["seconds"] < 10.0
