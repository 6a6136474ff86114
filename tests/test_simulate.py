"""fxshard.simulate: the alpha-beta timeline of the scheduled graphs (graph-only, fake process group)."""

import pytest

import fxshard
import scenarios
from fxshard.simulate import Machine, collective_seconds, simulate


@pytest.fixture(scope="module")
def stage3():
    return {prefetch: scenarios.compiled_chain(3, prefetch=prefetch) for prefetch in (0, 1)}


SLOW_NET = Machine(flops_per_s=1e6, memory_bandwidth=1e7, bandwidth=1e5, latency=1e-4)


def test_free_network_exposes_nothing(stage3):
    timeline = simulate(stage3[1], 8, bandwidth=1e30, latency=0.0)
    assert timeline.exposed_comm == pytest.approx(0.0, abs=1e-12)
    assert timeline.step_time == pytest.approx(timeline.compute_time)


def test_step_time_is_compute_plus_exposed_comm_and_grows_with_world(stage3):
    times = [simulate(stage3[0], n, machine=SLOW_NET) for n in (2, 16, 1024)]
    for t in times:
        assert t.step_time == pytest.approx(t.compute_time + t.exposed_comm)
        assert 0.0 <= t.exposed_comm <= t.comm_time + 1e-12
    assert times[0].step_time < times[1].step_time < times[2].step_time  # (N-1) latency hops per collective


def test_prefetch_hides_gathers_that_no_prefetch_exposes(stage3):
    balanced = Machine(flops_per_s=1e6, memory_bandwidth=1e7, bandwidth=1e6, latency=1e-5)
    without, with_prefetch = (simulate(stage3[p], 2, machine=balanced) for p in (0, 1))
    assert with_prefetch.exposed_comm < without.exposed_comm
    assert with_prefetch.comm_time == pytest.approx(without.comm_time)  # same collectives, other order


def test_ring_costs():
    machine = Machine(bandwidth=1e9, latency=1e-5)
    assert collective_seconds("all_gather", 1e9, 4, machine) == pytest.approx(3e-5 + 0.75)
    assert collective_seconds("all_reduce", 1e9, 4, machine) == pytest.approx(2 * (3e-5 + 0.75))
    assert collective_seconds("reduce_scatter", 1e9, 1, machine) == 0.0


def test_stage_1_adds_the_optimizer_steps_collectives_unhidden():
    timeline = simulate(scenarios.compiled_chain(1), 2, machine=SLOW_NET)
    step_events = [e for e in timeline.events if e.graph == "optimizer step"]
    assert {e.node for e in step_events} == {"all_gather", "reduce_scatter"}
    assert timeline.exposed_comm >= sum(e.end - e.start for e in step_events) - 1e-12


def test_bad_input_says_what_to_do():
    with pytest.raises(fxshard.FxShardError, match="positive number of ranks"):
        simulate(object(), 0)
    with pytest.raises(fxshard.FxShardError, match="takes a backend that ran a step"):
        simulate(object(), 2)
