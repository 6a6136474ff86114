"""Ranks that compiled different collective schedules fail at compile time with FxShardError on every rank,
naming the first collective that differs, instead of deadlocking or exchanging the wrong tensors."""

import time

import consistency_scenarios
import scenarios
from fxshard.compiler.consistency import ScheduledCollective, collective_schedule, first_difference
from fxshard.testing import WorkerPool


def test_a_forward_that_branches_on_the_rank_fails_to_compile_on_every_rank(pools):
    errors = pools(2).run(consistency_scenarios.compile_a_forward_that_branches_on_the_rank)
    for rank, error in enumerate(errors):
        assert error.startswith(f"rank {rank}: the ranks compiled different collective schedules for their "
                                "forward graph 0"), error
        assert ("collective #1 differs (rank 0: all_gather of unit 'fc2' (fc2.weight, fc2.bias), 51 float32 "
                "elements; rank 1: all_gather of unit 'extra' (extra.weight, extra.bias), 136 float32 elements); "
                "collectives per rank: rank 0: 2, rank 1: 3") in error, error


def test_a_rank_that_compiles_alone_fails_within_the_timeout_with_fxshard_error():
    pool = WorkerPool(2)  # its own ranks: their checks are out of step after it
    try:
        started = time.monotonic()
        errors = pool.run(consistency_scenarios.only_rank_1_compiles)
        seconds = time.monotonic() - started
    finally:
        pool.close()
    assert errors[0] == "rank 0 compiled nothing"
    assert errors[1].startswith("rank 1 compiled its forward graph 0 and waited for the other ranks to compare "
                                "collective schedules, but they did not take part"), errors[1]
    assert seconds < 60, seconds  # collective_timeout_s=2, plus compiling


def test_shard_groups_of_a_hybrid_mesh_that_compiled_different_graphs_fail_on_every_rank(pools):
    errors = pools(4).run(consistency_scenarios.compile_a_forward_that_branches_between_shard_groups)
    for rank, error in enumerate(errors):
        assert error.startswith(f"rank {rank}: the ranks compiled different collective schedules"), error
        assert "rank 0: all_gather of unit 'fc2'" in error and "rank 2: all_gather of unit 'extra'" in error, error


def test_a_collective_of_the_users_over_groups_of_one_mesh_dimension_is_the_same_schedule_on_every_rank(pools):
    # the pairs (0, 1) and (2, 3) are groups of other names: compared by shape, they are the same collective
    assert pools(4).run(consistency_scenarios.compile_a_forward_with_a_collective_over_rank_pairs) == [
        "compiled and ran without an error"] * 4


def test_the_schedule_is_the_lowered_graphs_collectives_in_issue_order():
    backend = scenarios.compiled_model("mlp", stage=3)  # fake group: nothing is compared, the graphs are real
    backward = next(r.final for r in backend.graphs if r.kind == "backward")
    assert [(c.kind, c.unit, c.params, c.numel) for c in collective_schedule(backward)] == [
        ("all_gather", "fc2", ("fc2.weight",), "48"),  # stage 3 gathers the weight (not the bias) again
        ("reduce_scatter", "fc2", ("fc2.bias", "fc2.weight"), "102"),  # 5 rows over 2 ranks: 3 rows each
        ("reduce_scatter", "fc1", ("fc1.bias", "fc1.weight"), "144"),
    ]


def test_ranks_compiling_different_kinds_of_graph_are_named():
    gather = ScheduledCollective("all_gather", "fc1", ("fc1.weight",), "float32", "64", "g")
    assert first_difference(["forward", "backward"], [[gather], [gather]], [0, 1]) == (
        "they compiled different graphs at the same time: rank 0 a forward graph, rank 1 a backward graph")
