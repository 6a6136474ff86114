"""fxshard.simulate: the alpha-beta timeline of the scheduled graphs (graph-only, fake process group)."""

import dataclasses
import operator

import pytest
import torch

import fxshard
import scenarios
from fxshard.passes.cost_model import node_flops
from fxshard.runtime.collectives import COLLECTIVE_ROLES
from fxshard.runtime.sharding import chunk_size
from fxshard.simulate import Machine, calibrate, simulate
from fxshard.simulate.calibration import (
    _without_collectives, _zeros_for_placeholders, fit_bandwidth, fit_collective_overhead, fit_flops,
    fit_op_overhead, fit_overlap, fit_ring, fit_step, fit_step_overhead, serialized, without_flop_ops,
)
from fxshard.passes.cost_model import GLOO_ON_CPU, collective_seconds, compute_seconds
from fxshard.simulate.simulator import compute_nodes, machine_of


@pytest.fixture(scope="module")
def stage3():
    return {prefetch: scenarios.compiled_model("chain", 3, prefetch=prefetch) for prefetch in (0, 1)}


SLOW_NET = Machine(flops_per_s=1e6, memory_bandwidth=1e7, bandwidth=1e5, latency=1e-4)
WAIT = torch.ops._c10d_functional.wait_tensor.default


def test_free_network_exposes_nothing(stage3):
    timeline = simulate(stage3[1], 8, machine=Machine(bandwidth=1e30, latency=0.0))
    assert timeline.exposed_comm == pytest.approx(0.0, abs=1e-12)
    assert timeline.step_time == pytest.approx(timeline.compute_time)


def test_a_prediction_without_a_machine_runs_on_the_backends_own(stage3, tmp_path):
    # the machine its schedules were chosen on: the one given to fxshard.backend(machine=...), else the device's
    backend = stage3[1]
    assert backend.machine is None and machine_of(backend) is GLOO_ON_CPU
    assert simulate(backend, 2) == simulate(backend, 2, machine=GLOO_ON_CPU)
    backend.machine = SLOW_NET
    try:
        assert simulate(backend, 2) == simulate(backend, 2, machine=SLOW_NET)
        assert backend.trace(tmp_path / "step.json", world=2) == simulate(backend, 2, machine=SLOW_NET)
    finally:
        backend.machine = None


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
    # an all-to-all sends the same bytes, a message to each peer (a latency each), on its own bandwidth where it
    # has one
    assert collective_seconds("all_to_all", 1e9, 4, machine) == pytest.approx(3e-5 + 0.75)
    assert collective_seconds("all_to_all", 1e9, 512, machine) == pytest.approx(511e-5 + 511 / 512)
    exchanging = dataclasses.replace(machine, all_to_all_bandwidth=2e9)
    assert collective_seconds("all_to_all", 1e9, 4, exchanging) == pytest.approx(3e-5 + 0.375)
    assert collective_seconds("all_gather", 1e9, 4, exchanging) == pytest.approx(3e-5 + 0.75)


def test_stage_1_adds_the_optimizer_steps_collectives_unhidden():
    timeline = simulate(scenarios.compiled_model("chain", 1), 2, machine=SLOW_NET)
    step_events = [e for e in timeline.events if e.graph == "optimizer step" and e.stream == "comm"]
    assert {e.node for e in step_events} == {"all_gather", "reduce_scatter"}
    assert timeline.exposed_comm >= sum(e.end - e.start for e in step_events) - 1e-12


def test_the_optimizers_update_writes_master_and_state_of_what_the_rank_updates():
    one_byte_a_second = Machine(memory_bandwidth=1.0)

    def update_bytes(stage: int, world: int) -> float:
        timeline = simulate(scenarios.compiled_model("chain", stage), world, machine=one_byte_a_second)
        return next(e.end - e.start for e in timeline.events if e.node == "update")

    def elements(world: int | None = None) -> int:  # the whole model, or one rank's shards of it (whole rows)
        return sum(p.numel() if world is None else chunk_size(p.shape, world) for p in scenarios.Chain().parameters())

    # AdamW in fp32: master and two states read and written (2 x 12 bytes), the gradient read (4)
    assert update_bytes(0, 2) == pytest.approx(28 * elements())
    assert update_bytes(3, 2) == pytest.approx(28 * elements(2))
    assert update_bytes(3, 4) == pytest.approx(28 * elements(4))


def test_bad_input_says_what_to_do():
    with pytest.raises(fxshard.FxShardError, match="positive number of ranks"):
        simulate(object(), 0)
    with pytest.raises(fxshard.FxShardError, match="takes a backend that ran a step"):
        simulate(object(), 2)


# -- calibration: the fits recover known constants from timings the model itself produced ------------------------

def test_step_overhead_enters_the_step_once_as_compute(stage3):
    base = simulate(stage3[1], 2, machine=SLOW_NET)
    timeline = simulate(stage3[1], 2, machine=dataclasses.replace(SLOW_NET, step_overhead=0.5))
    assert timeline.step_time == pytest.approx(base.step_time + 0.5)
    assert timeline.compute_time == pytest.approx(base.compute_time + 0.5)
    assert timeline.exposed_comm == pytest.approx(base.exposed_comm)
    assert timeline.overhead_time == 0.5
    assert (timeline.events[-1].graph, timeline.events[-1].end) == ("step", pytest.approx(timeline.step_time))


def test_collective_overhead_is_paid_once_per_collective_at_any_world():
    machine = Machine(bandwidth=1e9, latency=1e-5, collective_overhead=1e-3)
    assert collective_seconds("all_gather", 1e9, 4, machine) == pytest.approx(1e-3 + 3e-5 + 0.75)
    assert collective_seconds("all_reduce", 1e9, 4, machine) == pytest.approx(1e-3 + 2 * (3e-5 + 0.75))
    assert collective_seconds("all_gather", 0, 1024, machine) == pytest.approx(1e-3 + 1023e-5)


@pytest.mark.parametrize("world", [2, 4])
def test_fit_ring_recovers_overhead_latency_and_bandwidth(world):
    truth = Machine(bandwidth=5e8, latency=2e-5, collective_overhead=3e-4)
    sizes = [1 << 12, 1 << 16, 1 << 20, 1 << 22]
    gathers = [collective_seconds("all_gather", b, world, truth) for b in sizes]
    all_reduces = [collective_seconds("all_reduce", b, world, truth) for b in sizes]
    assert fit_ring(sizes, gathers, all_reduces, world) == pytest.approx((3e-4, 2e-5, 5e8), rel=1e-6)


def test_fit_ring_holds_a_latency_the_noise_makes_negative_at_zero():
    sizes = [1 << 12, 1 << 20]
    truth = Machine(bandwidth=5e8, latency=0.0, collective_overhead=3e-4)
    gathers = [collective_seconds("all_gather", b, 2, truth) for b in sizes]
    all_reduces = [collective_seconds("all_reduce", b, 2, truth) - 1e-5 for b in sizes]  # faster than a gather + hop
    overhead, latency, bandwidth = fit_ring(sizes, gathers, all_reduces, 2)
    assert latency == 0.0
    assert overhead == pytest.approx(3e-4, rel=0.05) and bandwidth == pytest.approx(5e8, rel=0.05)


def test_fit_bandwidth_recovers_a_collectives_bandwidth_and_refuses_what_it_cannot_fit():
    truth = Machine(bandwidth=5e8, latency=2e-5, collective_overhead=3e-4, all_to_all_bandwidth=9e8)
    sizes = [1 << 12, 1 << 16, 1 << 20, 1 << 22]
    for kind, bandwidth in (("all_gather", 5e8), ("all_to_all", 9e8)):
        seconds = [collective_seconds(kind, b, 4, truth) for b in sizes]
        assert fit_bandwidth(sizes, seconds, 4) == pytest.approx(bandwidth, rel=1e-6)
    with pytest.raises(fxshard.FxShardError, match="does not grow with size"):
        fit_bandwidth([4096, 1 << 20], [5e-4, 1e-4], 2)
    with pytest.raises(fxshard.FxShardError, match="two or more distinct sizes"):
        fit_bandwidth([4096, 4096], [1e-4, 1e-4], 2)


def test_a_collective_holds_the_compute_stream_for_what_it_cannot_overlap(stage3):
    """With no overlap, prefetching hides nothing: the scheduled graphs take as long as the serialized ones."""
    graphs = _graphs(stage3[1])
    for overlap, hides in ((1.0, True), (0.0, False)):
        machine = dataclasses.replace(SLOW_NET, overlap=overlap)
        scheduled = simulate(graphs, 2, machine=machine).step_time
        serial = simulate([serialized(gm) for gm in graphs], 2, machine=machine).step_time
        assert (scheduled < serial - 1e-9) == hides
        if not hides:
            assert scheduled == pytest.approx(serial)


def test_fit_ring_refuses_what_it_cannot_fit():
    with pytest.raises(fxshard.FxShardError, match="two or more distinct sizes.*sizes=\\(small"):
        fit_ring([4096, 4096], [1e-4, 1e-4], [2e-4, 2e-4], 2)
    with pytest.raises(fxshard.FxShardError, match="does not grow with size.*more repeats"):
        fit_ring([4096, 1 << 20], [5e-4, 1e-4], [5e-4, 1e-4], 2)
    with pytest.raises(fxshard.FxShardError, match="world of 2 or more"):
        fit_ring([4096, 1 << 20], [1e-4, 2e-4], [1e-4, 2e-4], 1)
    with pytest.raises(fxshard.FxShardError, match="positive seconds"):
        fit_ring([4096, 1 << 20], [0.0, 2e-4], [1e-4, 2e-4], 2)


def _graphs(backend):
    return [record.final for record in backend.graphs if record.kind in ("forward", "backward")]


def test_fit_step_recovers_the_overheads_and_predicts_another_configuration(stage3):
    """Timings made by a known machine at stage 3 with prefetch: the fits recover its overheads, and the fitted
    machine predicts stage 3 without prefetch and stage 0 as the known one does."""
    truth = dataclasses.replace(SLOW_NET, flops_per_s=SLOW_NET.flops_per_s / 3, op_overhead=2e-5,
                                collective_overhead=7e-4, overlap=0.4, step_overhead=3e-3)
    graphs = _graphs(stage3[1])
    compute_only = sum(compute_seconds(node, truth) for gm in graphs for node in compute_nodes(gm))
    # the FLOP-counted ops left empty: each an op that writes nothing
    without_flops = sum(truth.op_overhead if node_flops(node) else compute_seconds(node, truth)
                        for gm in graphs for node in compute_nodes(gm))
    no_step = dataclasses.replace(truth, step_overhead=0.0)
    serial = simulate([serialized(gm) for gm in graphs], 2, machine=no_step).step_time
    scheduled = simulate(graphs, 2, machine=no_step).step_time
    step = simulate(stage3[1], 2, machine=truth).step_time
    fitted = fit_step(SLOW_NET, stage3[1], 2, compute_only, without_flops, serial, scheduled, step)
    assert fitted.flops_per_s == pytest.approx(truth.flops_per_s, rel=1e-6)
    assert fitted.op_overhead == pytest.approx(2e-5, rel=1e-6)
    assert fitted.collective_overhead == pytest.approx(7e-4, rel=1e-6)
    assert fitted.overlap == pytest.approx(0.4, rel=1e-6)
    assert fitted.step_overhead == pytest.approx(3e-3, rel=1e-6)
    for other in (stage3[0], scenarios.compiled_model("chain", 0)):
        assert simulate(other, 2, machine=fitted).step_time == pytest.approx(
            simulate(other, 2, machine=truth).step_time, rel=1e-6)


def test_fits_clip_at_zero_when_the_model_already_explains_the_time(stage3):
    graphs = _graphs(stage3[1])
    assert fit_op_overhead(graphs, 0.0, SLOW_NET) == 0.0
    # replays that do not tell the FLOP-counted ops apart keep the matmul benchmark's rate
    assert fit_flops(graphs, 1.0, 1.0, SLOW_NET) == SLOW_NET.flops_per_s
    chain = _graphs(scenarios.compiled_model("chain", 3))
    flops = sum(node_flops(node) for gm in chain for node in compute_nodes(gm))
    assert flops > 0 and fit_flops(chain, 2.0, 1.0, SLOW_NET) == flops  # their FLOPs over the 1 s between
    assert fit_collective_overhead(graphs, 2, 1e-9, SLOW_NET) == 0.0
    assert fit_overlap(graphs, 2, 1e-9, SLOW_NET) == 1.0  # faster than full overlap predicts
    assert fit_overlap(graphs, 2, 1e9, SLOW_NET) == 0.0  # slower than none
    assert fit_step_overhead(stage3[1], 2, 1e-9, SLOW_NET) == 0.0


def test_fits_refuse_what_they_cannot_fit(stage3):
    stage1_graphs = _graphs(scenarios.compiled_model("chain", 1))  # stage 1's graphs do not communicate
    with pytest.raises(fxshard.FxShardError, match="needs graphs with collectives.*stage"):
        fit_collective_overhead(stage1_graphs, 2, 1.0, SLOW_NET)
    with pytest.raises(fxshard.FxShardError, match="positive seconds"):
        fit_step_overhead(stage3[1], 2, 0.0, SLOW_NET)
    with pytest.raises(fxshard.FxShardError, match="both backend=.*and step="):
        calibrate(backend=stage3[1])
    with pytest.raises(fxshard.FxShardError, match="repeats and steps must be >= 1"):
        calibrate(repeats=0)


def test_graphs_without_collectives_run_on_one_process(stage3):
    """What calibrate replays to time compute alone: no collective or wait left, and it runs on zeros without a
    process group."""
    for gm in _graphs(stage3[1]):
        compute_only = _without_collectives(gm)
        targets = [node.target for node in compute_only.graph.nodes if node.op == "call_function"]
        assert not [t for t in targets if "_c10d_functional" in str(t)]
        assert len(compute_nodes(compute_only)) == len(compute_nodes(gm)) + sum(
            1 for node in gm.graph.nodes if node.meta.get("fxshard", {}).get("role") in COLLECTIVE_ROLES)
        with torch.no_grad():
            compute_only(*_zeros_for_placeholders(gm))


def test_graphs_without_flop_ops_leave_their_outputs_empty_and_run_on_one_process():
    """What calibrate replays beside the compute to time the matmuls and attention apart: none of them left, one
    empty tensor in place of each of their outputs (attention has two in forward, three in backward)."""
    for gm in (_without_collectives(gm) for gm in _graphs(scenarios.compiled_model("gpt", 3))):
        counted = [node for node in gm.graph.nodes if node.op == "call_function" and node_flops(node)]
        assert counted
        outputs = sum(len([u for u in node.users if u.target is operator.getitem]) or 1 for node in counted)
        left = without_flop_ops(gm)
        assert not [node for node in left.graph.nodes if node.op == "call_function" and node_flops(node)]
        empties = [node for node in left.graph.nodes if node.target is torch.ops.aten.empty_strided.default]
        before = [node for node in gm.graph.nodes if node.target is torch.ops.aten.empty_strided.default]
        assert len(empties) - len(before) == outputs
        with torch.no_grad():
            left(*_zeros_for_placeholders(gm))


PHASES = set("BEXiIbneSTpFsftPNODCMRc")  # the Trace Event Format's phase letters
METADATA_NAMES = {"process_name", "process_labels", "process_sort_index", "thread_name", "thread_sort_index"}


def trace_event_format_errors(trace: dict) -> list[str]:
    """What in ``trace`` breaks the Chrome Trace Event Format (JSON object form) that Perfetto reads."""
    errors = [] if isinstance(trace.get("traceEvents"), list) else ["no traceEvents list"]
    for i, event in enumerate(trace.get("traceEvents", [])):
        where = f"event {i} ({event.get('name')!r})"
        if event.get("ph") not in PHASES:
            errors.append(f"{where}: phase {event.get('ph')!r}")
        if not isinstance(event.get("name"), str) or not all(isinstance(event.get(k), (int, str)) for k in ("pid", "tid")):
            errors.append(f"{where}: name must be a string, pid and tid ints or strings")
        if event.get("ph") == "M":
            named = event["name"] not in ("process_name", "thread_name") or "name" in event.get("args", {})
            if event["name"] not in METADATA_NAMES or not named:
                errors.append(f"{where}: metadata needs a known name (and a process or thread name args.name)")
        elif not (isinstance(event.get("ts"), (int, float)) and event["ts"] >= 0):
            errors.append(f"{where}: ts must be a number >= 0 (microseconds)")
        if event.get("ph") == "X" and not (isinstance(event.get("dur"), (int, float)) and event["dur"] >= 0):
            errors.append(f"{where}: a complete event needs dur >= 0")
        if not isinstance(event.get("args", {}), dict):
            errors.append(f"{where}: args must be an object")
    if trace.get("displayTimeUnit", "ms") not in ("ms", "ns"):
        errors.append("displayTimeUnit must be ms or ns")
    return errors


def test_the_simulated_step_is_a_chrome_trace_with_a_compute_and_a_communication_lane(stage3, tmp_path):
    import json

    timeline = stage3[1].trace(tmp_path / "step.json", world=2, machine=SLOW_NET)
    trace = json.loads((tmp_path / "step.json").read_text())
    assert trace_event_format_errors(trace) == []
    lanes = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert lanes == {1: "compute", 2: "communication"}
    nodes = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(nodes) == len(timeline.events)
    comm = [e for e in nodes if e["tid"] == 2]
    assert {e["args"]["unit"] for e in comm} == {e.unit for e in timeline.events if e.stream == "comm"} != {""}
    assert max(e["ts"] + e["dur"] for e in nodes) == pytest.approx(timeline.step_time * 1e6)
    for a, b in zip(comm, comm[1:]):  # one communication stream: its collectives never overlap
        assert b["ts"] >= a["ts"] + a["dur"] - 1e-6


# -- hybrid mesh: the replicas' all-reduce on its own network ----------------------------------------------------

def hybrid_model(stage: int, replicas: int = 2, shards: int = 2):
    """The Chain's backend on a ``replicas`` x ``shards`` mesh of a fake process group (its graphs only)."""
    return scenarios.compiled_model("chain", stage, mesh_shape=(replicas, shards), bucket="layer")


R, S = 2, 2  # the mesh the hybrid backends compiled on
WORLD = 8  # the shard group simulated: not R, so that a collective timed over the wrong group shows
SLOW_REPLICAS = dataclasses.replace(SLOW_NET, replicate_bandwidth=1e3, replicate_latency=1e-2)
INTER_GROUP = Machine(bandwidth=1e3, latency=1e-2)  # SLOW_REPLICAS's inter-group network as a ring of its own


@pytest.fixture(scope="module")
def hybrid():
    return {stage: hybrid_model(stage, R, S) for stage in (1, 3)}


def _collectives(backend) -> dict[str, torch.fx.Node]:
    return {node.name: node for gm in _graphs(backend) for node in gm.graph.nodes
            if node.meta.get("fxshard", {}).get("role") in COLLECTIVE_ROLES}


def _across_replicas(node: torch.fx.Node) -> bool:
    return node.meta.get("fxshard", {}).get("across") == "replicate"


def _durations(timeline, stream: str) -> dict[tuple[str, str], float]:
    return {(e.graph, e.node): e.end - e.start for e in timeline.events if e.stream == stream}


def _bytes(value: torch.Tensor) -> int:
    return value.numel() * value.element_size()


def test_the_replicas_all_reduce_is_a_ring_all_reduce_of_the_gradient_shard_over_r_ranks(hybrid):
    """With the inter-group figures unset (or equal to the ring's), each all-reduce across the replicas takes the
    ring formula for an all-reduce of its gradient shard over R ranks; every other collective the formula over the
    ``world`` ranks simulated, as on one group."""
    collectives = _collectives(hybrid[3])
    across = {name: node for name, node in collectives.items() if _across_replicas(node)}
    assert across and {node.meta["fxshard"]["ranks"] for node in across.values()} == {R}
    shard_of = {node.meta["fxshard"]["unit"]: _bytes(node.args[0].meta["val"]) / S for node in collectives.values()
                if node.meta["fxshard"]["role"] == "reduce_scatter"}
    assert {node.meta["fxshard"]["unit"]: _bytes(node.args[0].meta["val"]) for node in across.values()} == shard_of
    timeline = simulate(hybrid[3], WORLD, machine=SLOW_NET)
    equal = dataclasses.replace(SLOW_NET, replicate_bandwidth=SLOW_NET.bandwidth, replicate_latency=SLOW_NET.latency)
    assert simulate(hybrid[3], WORLD, machine=equal) == timeline
    durations = {name: seconds for (_, name), seconds in _durations(timeline, "comm").items()}
    assert durations.keys() == collectives.keys()
    for name, node in collectives.items():
        role = node.meta["fxshard"]["role"]
        full = _bytes(node.meta["val"] if role == "all_gather" else node.args[0].meta["val"])
        expected = collective_seconds(role, full, R if name in across else WORLD, SLOW_NET)
        assert durations[name] == pytest.approx(expected), name


def test_only_the_replicas_all_reduces_take_the_inter_group_figures(hybrid):
    collectives = _collectives(hybrid[3])
    base = simulate(hybrid[3], WORLD, machine=SLOW_NET)
    slow = simulate(hybrid[3], WORLD, machine=SLOW_REPLICAS)
    assert _durations(slow, "compute") == pytest.approx(_durations(base, "compute"))
    before = _durations(base, "comm")
    for (graph, name), seconds in _durations(slow, "comm").items():
        node = collectives[name]
        if _across_replicas(node):
            assert seconds == pytest.approx(collective_seconds("all_reduce", _bytes(node.args[0].meta["val"]), R,
                                                               INTER_GROUP))
            assert seconds > before[graph, name]
        else:
            assert seconds == pytest.approx(before[graph, name]), name
    free_ring = simulate(hybrid[3], WORLD, machine=dataclasses.replace(SLOW_REPLICAS, bandwidth=1e30, latency=0.0))
    across = {key for key in before if _across_replicas(collectives[key[1]])}
    assert {key: _durations(free_ring, "comm")[key] for key in across} == pytest.approx(
        {key: _durations(slow, "comm")[key] for key in across})


def _compute_between_all_reduce_and_wait(backend, machine: Machine) -> list[tuple[torch.fx.Node, float]]:
    """Each all-reduce across the replicas and the compute seconds the graph runs between it and its wait; checks
    that none overlaps another or waits, before its own wait, on a collective queued behind it."""
    gaps = []
    for gm in _graphs(backend):
        issued, behind, gap, computing = None, set(), 0.0, set(compute_nodes(gm))
        for node in gm.graph.nodes:
            if issued is not None and node.op == "call_function" and node.target is WAIT:
                if node.args[0] is issued:
                    gaps.append((issued, gap))
                    issued = None
                assert node.args[0] not in behind, f"{node.name} waits behind {issued.name}"
            elif node.meta.get("fxshard", {}).get("role") in COLLECTIVE_ROLES:
                if _across_replicas(node):
                    assert issued is None, f"{node.name} overlaps {issued.name}"
                    issued, behind, gap = node, set(), 0.0
                elif issued is not None:
                    behind.add(node)
            elif issued is not None and node in computing:
                gap += compute_seconds(node, machine)
    return gaps


def test_a_slow_inter_group_network_slows_the_step_by_what_compute_does_not_cover(hybrid):
    """With a free shard-group network only the replicas' all-reduces take time: each is exposed by what the compute
    the graph runs between it and its wait does not cover, and the step is its compute plus those parts."""
    free_ring = dataclasses.replace(SLOW_NET, bandwidth=1e30, latency=0.0)
    gaps = _compute_between_all_reduce_and_wait(hybrid[3], free_ring)
    assert len(gaps) == len([n for n in _collectives(hybrid[3]).values() if _across_replicas(n)]) > 0
    assert any(gap > 0 for _, gap in gaps)  # the schedule puts compute behind at least one of them
    timelines = []
    for replicate_bandwidth in (1e30, 1e4, 1e2):
        machine = dataclasses.replace(free_ring, replicate_bandwidth=replicate_bandwidth, replicate_latency=1e-4)
        timeline = simulate(hybrid[3], WORLD, machine=machine)
        all_reduces = [collective_seconds("all_reduce", _bytes(node.args[0].meta["val"]), R, machine.across_replicas())
                       for node, _ in gaps]
        exposed = sum(max(0.0, seconds - gap) for seconds, (_, gap) in zip(all_reduces, gaps))
        assert timeline.comm_time == pytest.approx(sum(all_reduces))
        assert timeline.exposed_comm == pytest.approx(exposed)
        assert timeline.step_time == pytest.approx(timeline.compute_time + exposed)
        timelines.append(timeline)
    fast, slow = timelines[0], timelines[-1]
    assert slow.compute_time == fast.compute_time
    assert slow.step_time - fast.step_time == pytest.approx(slow.exposed_comm - fast.exposed_comm)
    assert 0 < slow.step_time - fast.step_time < slow.comm_time - fast.comm_time  # the covered part stays hidden


def test_stage_1_all_reduces_the_shards_across_replicas_in_the_optimizer_step_on_the_inter_group_network(hybrid):
    shards = sum(chunk_size(p.shape, S) * p.element_size() for p in scenarios._ledger_model("chain").parameters())
    base, slow = (simulate(hybrid[1], WORLD, machine=machine) for machine in (SLOW_NET, SLOW_REPLICAS))
    before, after = ({name: seconds for (graph, name), seconds in _durations(t, "comm").items()
                      if graph == "optimizer step"} for t in (base, slow))
    assert after.keys() == {"all_gather", "reduce_scatter", "all_reduce"}
    assert before["all_reduce"] == pytest.approx(collective_seconds("all_reduce", shards, R, SLOW_NET))
    assert after["all_reduce"] == pytest.approx(collective_seconds("all_reduce", shards, R, INTER_GROUP))
    assert {k: after[k] for k in ("all_gather", "reduce_scatter")} == pytest.approx(
        {k: before[k] for k in ("all_gather", "reduce_scatter")})
    assert slow.step_time - base.step_time == pytest.approx(after["all_reduce"] - before["all_reduce"])  # unhidden


def test_the_trace_format_check_finds_what_perfetto_would_reject():
    assert trace_event_format_errors({"traceEvents": [{"name": "mm", "ph": "X", "ts": 0, "pid": 0, "tid": 1}]}) == [
        "event 0 ('mm'): a complete event needs dur >= 0"]


def test_gpu_presets_are_the_datasheets_peaks_times_the_stated_efficiencies():
    from fxshard.simulate.machines import A100_80GB_SXM, H100_80GB_SXM, PRESETS, Efficiency

    stated = Efficiency()
    for key, gpu in (("a100-sxm", A100_80GB_SXM), ("h100-sxm", H100_80GB_SXM)):
        for gbits in (100, 200, 400):
            machine = PRESETS[f"{key}-{gbits}g"]
            assert machine.flops_per_s == gpu.bf16_flops_per_s * stated.compute
            # a ring across nodes: one per port, so the node's 8 ports add up, until each GPU's NVLink is full
            assert machine.bandwidth == min(8 * gbits / 8 * 1e9, gpu.nvlink_bytes_per_s) * stated.link
            assert machine.node_bandwidth == gpu.nvlink_bytes_per_s * stated.link  # re-gathers inside a node
            assert f"{gbits} Gb/s" in machine.name and gpu.name in machine.name
    # the same step predicts faster on the faster system
    graphs = [simulate(scenarios.compiled_model("chain", 3), 64, machine=PRESETS[name]).step_time
              for name in ("a100-sxm-100g", "h100-sxm-400g")]
    assert graphs[1] < graphs[0]
    # 400 Gb/s ports would carry 400 GB/s a node; an A100's NVLink (300 GB/s each way) caps the ring, an H100's not
    assert PRESETS["a100-sxm-400g"].bandwidth == A100_80GB_SXM.nvlink_bytes_per_s * stated.link
    assert PRESETS["h100-sxm-400g"].bandwidth == 400e9 * stated.link
