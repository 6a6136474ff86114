"""The gloo worker pool the distributed tests share."""

import pytest

import scenarios


def test_a_rank_killed_by_a_signal_is_retried_once_on_a_fresh_pool(pools, tmp_path):
    with pytest.warns(UserWarning, match="exited with code -6; the pool was restarted"):
        assert pools(2).run(scenarios.die_once, str(tmp_path / "died")) == [0, 1]
