"""prefetch_pass and the schedule= hook: pure reorders, where collectives land, and numerics on gloo."""

import dataclasses
import random

import pytest
import torch
from torch import fx, nn

import fxshard
import scenarios
from examples.models import Block
from fxshard.passes import Machine, PassContext, exposed_communication, make_prefetch_pass, prefetch_pass
from expecttest import assert_expected_inline

from fxshard.passes.cost_model import GLOO_ON_CPU
from fxshard.testing import fake_process_group

aten = torch.ops.aten
COMM_ROLES = ("copy_in", "all_gather", "reduce_scatter", "wait", "copy_out")


# -- a pure reorder, on random graphs ---------------------------------------------------------------------------
def _tag(node, unit, role):
    node.meta["fxshard"] = {"unit": unit, "role": role, "params": [unit]}
    return node


def random_lowered_graph(rng: random.Random) -> tuple[fx.GraphModule, list[torch.Tensor]]:
    """A graph shaped like a lowered one: per unit a gather chain (copy_in, all_gather, wait, copy_out) whose weight
    random compute reads (several units' weights may be read late, interleaved), and reduction chains on random
    gradients. Collectives are stand-in ops: the pass reads roles and units, never targets."""
    graph = fx.Graph()
    units = rng.randint(1, 6)
    shards = [graph.placeholder(f"shard{u}") for u in range(units)]
    values = [graph.placeholder("x")]
    outputs = []
    for u in range(units):
        copy_in = _tag(graph.call_function(aten.mul.Tensor, (shards[u], 1.0)), f"u{u}", "copy_in")
        gather = _tag(graph.call_function(aten.cat.default, ([copy_in, copy_in],)), f"u{u}", "all_gather")
        wait = _tag(graph.call_function(aten.clone.default, (gather,)), f"u{u}", "wait")
        weight = _tag(graph.call_function(aten.slice.Tensor, (wait, 0, 0, 4)), f"u{u}", "copy_out")
        readers = [weight] + ([rng.choice(values)] if rng.random() < 0.5 else [])
        for i in range(rng.randint(1, 4)):
            a, b = (weight if i == 0 else rng.choice(readers)), rng.choice(values)
            values.append(graph.call_function(rng.choice([aten.add.Tensor, aten.mul.Tensor]), (a, b)))
            readers.append(values[-1])
        if rng.random() < 0.6:
            grad = rng.choice(values[1:])
            flat = _tag(graph.call_function(aten.mul.Tensor, (grad, 2.0)), f"r{u}", "copy_in")
            reduce = _tag(graph.call_function(aten.mul.Tensor, (flat, 0.5)), f"r{u}", "reduce_scatter")
            outputs.append(_tag(graph.call_function(aten.clone.default, (reduce,)), f"r{u}", "wait"))
    graph.output(tuple(values[-2:] + outputs))
    gm = fx.GraphModule(nn.Module(), graph)
    inputs = [torch.randn(2) for _ in range(units)] + [torch.randn(4)]

    class Record(fx.Interpreter):
        def run_node(self, n):
            result = super().run_node(n)
            n.meta["val"] = result
            return result

    Record(gm).run(*inputs)
    return gm, inputs


def comm_side(node):
    return node.meta.get("fxshard", {}).get("role") in COMM_ROLES


def alive_gathers(gm) -> int:
    """The most gathered buffers alive at once: from the all-gather to the last compute that reads the weight."""
    nodes = list(gm.graph.nodes)
    where = {n: i for i, n in enumerate(nodes)}
    spans = []
    for node in nodes:
        if node.meta.get("fxshard", {}).get("role") == "all_gather":
            (wait,) = node.users
            (weight,) = wait.users
            readers, pending = [], list(weight.users)
            while pending:  # views of the weight (its transpose) keep the buffer alive too
                reader = pending.pop()
                readers.append(reader)
                if isinstance(reader.target, torch._ops.OpOverload) and reader.target.is_view:
                    pending.extend(reader.users)
            last = max(where[u] for u in readers if u.op != "output")
            spans.append((where[node], last))
    return max((sum(lo <= i <= hi for lo, hi in spans) for i in range(len(nodes))), default=0)


@pytest.mark.parametrize("seed", range(40))
def test_prefetch_is_a_pure_reorder_of_random_graphs(seed):
    rng = random.Random(seed)
    gm, inputs = random_lowered_graph(rng)
    before = [(n.name, n.target, str(n.args)) for n in gm.graph.nodes]
    expected = gm(*inputs)
    alive_before = alive_gathers(gm)
    ctx = PassContext(stage=3, graph="forward", world_size=2, group_name="0",
                      prefetch=rng.randint(1, 3), max_inflight_gathers=rng.randint(1, 3))
    out = prefetch_pass(gm, ctx)
    after = [(n.name, n.target, str(n.args)) for n in out.graph.nodes]
    assert sorted(after, key=str) == sorted(before, key=str)  # the same nodes with the same arguments
    out.graph.lint()  # every node after the nodes it reads
    assert after[: len(inputs)] == before[: len(inputs)] and after[-1] == before[-1]  # inputs first, output last
    torch.testing.assert_close(out(*inputs), expected, rtol=0, atol=0)
    nodes = list(out.graph.nodes)
    where = {n: i for i, n in enumerate(nodes)}
    for node in nodes:
        role = node.meta.get("fxshard", {}).get("role")
        if role in ("wait", "copy_out") and node.meta["fxshard"]["unit"].startswith("u"):
            # a wait / copy-out sits right before its first reader: only communication nodes in between
            first = min(where[u] for u in node.users)
            assert all(comm_side(n) for n in nodes[where[node] + 1 : first]), node.name
        if role == "reduce_scatter":
            # issued as soon as its gradient exists: no compute between the gradient and the collective
            (flat,) = node.all_input_nodes
            assert all(comm_side(n) for n in nodes[where[flat.args[0]] + 1 : where[node]]), node.name
    assert alive_gathers(out) <= max(ctx.max_inflight_gathers, alive_before)


# -- a 4-block model: where the collectives land ------------------------------------------------------------------
class FourBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return x


# Activations (BATCH x 8 floats per block) outweigh a block's 8 x 8 weight, as in a real model: with fewer rows
# a gathered weight would be most of what a step holds, and the pass's memory rule would keep every gather at
# its use (test_a_gather_that_would_raise_the_peak_is_held_back).
BATCH = 64


def compile_four_blocks(model_class: type = FourBlocks, rows: int = BATCH, **options) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    with fake_process_group(2):
        backend = fxshard.backend(stage=3, **{"compiler": "eager", **options})
        model, _ = backend.prepare(model_class())
        torch.compile(model, backend=backend, fullgraph=True)(torch.randn(rows, 8)).sum().backward()
    return {r.kind: r.final for r in backend.graphs if r.kind in ("forward", "backward")}


def positions(gm) -> str:
    """One line per all-gather, wait, reduce-scatter and matmul, in graph order."""
    lines = []
    for node in gm.graph.nodes:
        meta = node.meta.get("fxshard", {})
        if meta.get("role") in ("all_gather", "reduce_scatter"):
            lines.append(f"{meta['role']} {meta['unit']}")
        elif meta.get("role") == "wait":
            lines.append(f"wait({node.args[0].meta['fxshard']['role']} {meta['unit']})")
        elif node.target in (aten.mm.default, aten.addmm.default):
            reads = ", ".join(a.name for a in node.args if isinstance(a, fx.Node))
            lines.append(f"    {node.target._opname}({reads})")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def scheduled():
    return {depth: compile_four_blocks(prefetch=depth, max_inflight_gathers=3) for depth in (0, 1, 2)}


def both(graphs) -> str:
    return positions(graphs["forward"]) + "\n--- backward ---\n" + positions(graphs["backward"])


def test_prefetch_0_leaves_each_gather_at_its_use(scheduled):
    assert_expected_inline(both(scheduled[0]), """\
all_gather blocks.0
wait(all_gather blocks.0)
    mm(primals_2, t)
all_gather blocks.1
wait(all_gather blocks.1)
    mm(relu, t_1)
all_gather blocks.2
wait(all_gather blocks.2)
    mm(relu_1, t_2)
all_gather blocks.3
wait(all_gather blocks.3)
    mm(relu_2, t_3)
--- backward ---
    mm(t_4, relu_2)
all_gather blocks.3
wait(all_gather blocks.3)
    mm(threshold_backward, t_6)
reduce_scatter blocks.3
wait(reduce_scatter blocks.3)
    mm(t_8, relu_1)
all_gather blocks.2
wait(all_gather blocks.2)
    mm(threshold_backward_1, t_10)
reduce_scatter blocks.2
wait(reduce_scatter blocks.2)
    mm(t_12, relu)
all_gather blocks.1
wait(all_gather blocks.1)
    mm(threshold_backward_2, t_14)
reduce_scatter blocks.1
wait(reduce_scatter blocks.1)
    mm(t_16, primals_2)
reduce_scatter blocks.0
wait(reduce_scatter blocks.0)""")


def test_prefetch_1_gathers_the_next_unit_during_this_ones_compute(scheduled):
    # forward: unit i+1's gather before unit i's matmul; backward: unit i-1's before unit i's; reduce-scatters
    # right after their gradient, each waited for when the next one or the next gather is issued; at one matmul,
    # the waits before the gathers issued there
    assert_expected_inline(both(scheduled[1]), """\
all_gather blocks.0
wait(all_gather blocks.0)
all_gather blocks.1
    mm(primals_2, t)
wait(all_gather blocks.1)
all_gather blocks.2
    mm(relu, t_1)
wait(all_gather blocks.2)
all_gather blocks.3
    mm(relu_1, t_2)
wait(all_gather blocks.3)
    mm(relu_2, t_3)
--- backward ---
all_gather blocks.3
    mm(t_4, relu_2)
wait(all_gather blocks.3)
all_gather blocks.2
    mm(threshold_backward, t_6)
reduce_scatter blocks.3
    mm(t_8, relu_1)
wait(all_gather blocks.2)
    mm(threshold_backward_1, t_10)
wait(reduce_scatter blocks.3)
all_gather blocks.1
reduce_scatter blocks.2
    mm(t_12, relu)
wait(all_gather blocks.1)
    mm(threshold_backward_2, t_14)
wait(reduce_scatter blocks.2)
reduce_scatter blocks.1
    mm(t_16, primals_2)
wait(reduce_scatter blocks.1)
reduce_scatter blocks.0
wait(reduce_scatter blocks.0)""")


def test_prefetch_2_gathers_two_units_ahead(scheduled):
    assert_expected_inline(both(scheduled[2]), """\
all_gather blocks.0
all_gather blocks.1
wait(all_gather blocks.0)
all_gather blocks.2
    mm(primals_2, t)
wait(all_gather blocks.1)
all_gather blocks.3
    mm(relu, t_1)
wait(all_gather blocks.2)
    mm(relu_1, t_2)
wait(all_gather blocks.3)
    mm(relu_2, t_3)
--- backward ---
all_gather blocks.3
all_gather blocks.2
    mm(t_4, relu_2)
wait(all_gather blocks.3)
all_gather blocks.1
    mm(threshold_backward, t_6)
reduce_scatter blocks.3
    mm(t_8, relu_1)
wait(all_gather blocks.2)
    mm(threshold_backward_1, t_10)
wait(reduce_scatter blocks.3)
reduce_scatter blocks.2
    mm(t_12, relu)
wait(all_gather blocks.1)
    mm(threshold_backward_2, t_14)
wait(reduce_scatter blocks.2)
reduce_scatter blocks.1
    mm(t_16, primals_2)
wait(reduce_scatter blocks.1)
reduce_scatter blocks.0
wait(reduce_scatter blocks.0)""")


def test_the_in_flight_cap_holds_back_deeper_prefetch(scheduled):
    capped = compile_four_blocks(prefetch=2)  # default max_inflight_gathers=2: no room for a third buffer
    # each gather goes before the same matmul as with prefetch=1 (where the waits fall around it may differ: a
    # gather issued at the graph's start precedes the first wait, one issued at unit 0's compute follows it)
    assert without_waits(capped["forward"]) == without_waits(scheduled[1]["forward"])
    assert alive_gathers(capped["forward"]) == 2 and alive_gathers(scheduled[2]["forward"]) == 3


class EmbeddedBlocks(nn.Module):
    """Blocks between an input and an output projection tied as one weight (an embedding and its LM head): the
    root unit's gathered weight lives from the first matmul to the last."""

    def __init__(self):
        super().__init__()
        self.tied = nn.Linear(8, 8, bias=False)
        self.blocks = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(4))

    def forward(self, x):
        x = self.tied(x)
        for block in self.blocks:
            x = torch.relu(block(x))
        return x @ self.tied.weight


def test_a_buffer_alive_across_the_blocks_does_not_hold_their_prefetch_back():
    # the root's weight is alive wherever the blocks' gathers go: counted against max_inflight_gathers=2, it would
    # leave room for one block at a time and no block's gather could go ahead of its own compute
    graphs = compile_four_blocks(EmbeddedBlocks, prefetch=1, bucket="block", blocks=["blocks.0", "blocks.1",
                                                                                     "blocks.2", "blocks.3"])
    assert lookaheads(graphs["forward"]) == [1] * 5
    lines = without_waits(graphs["forward"])
    issued = [line for line in lines if line.startswith("all_gather")]
    matmuls = [i for i, line in enumerate(lines) if line.startswith("    mm")]
    # every block's gather is issued before the matmul of the unit ahead of it (root, blocks.0, ...)
    for k, line in enumerate(issued[1:], start=1):
        assert lines.index(line) < matmuls[k - 1], (line, lines)


def without_waits(gm) -> list[str]:
    return [line for line in positions(gm).splitlines() if not line.startswith("wait(")]


def lookaheads(gm) -> list[int]:
    return [n.meta["fxshard"]["schedule"]["lookahead"] for n in gm.graph.nodes
            if n.meta.get("fxshard", {}).get("role") == "all_gather"]


def test_the_cost_model_goes_only_as_far_ahead_as_hiding_needs(scheduled):
    # the default machine (GLOO_ON_CPU): a gather's 2.1 ms overhead dwarfs these tiny matmuls: 2 units ahead each
    assert lookaheads(scheduled[2]["forward"]) == [2, 2, 2, 2]
    # free communication: one unit ahead already hides it, so no gather goes further (less memory)
    free = Machine(latency=0.0, bandwidth=float("inf"), all_to_all_bandwidth=float("inf"))
    passes = [*fxshard.default_passes()[:-1], make_prefetch_pass(free)]
    graphs = compile_four_blocks(prefetch=2, max_inflight_gathers=3, passes=passes)
    assert lookaheads(graphs["forward"]) == [1, 1, 1, 1]
    assert positions(graphs["forward"]) == positions(scheduled[1]["forward"])


def test_the_backends_machine_places_the_gathers_it_predicts_with():
    # one estimator: machine= reaches the prefetch pass (PassContext.machine) as it reaches the simulator
    free = Machine(latency=0.0, bandwidth=float("inf"), all_to_all_bandwidth=float("inf"), name="free links")
    graphs = compile_four_blocks(prefetch=2, max_inflight_gathers=3, machine=free)
    assert lookaheads(graphs["forward"]) == [1, 1, 1, 1]
    schedule = next(n for n in graphs["forward"].graph.nodes if n.meta.get("fxshard", {}).get("role") == "all_gather")
    assert schedule.meta["fxshard"]["schedule"]["comm_s"] == 0.0  # what the free links price a gather at


def test_prefetch_lowers_the_estimated_exposed_communication(scheduled):
    exposed = [exposed_communication(scheduled[d]["forward"], 2)["exposed_s"] for d in (0, 1, 2)]
    assert exposed[0] > exposed[1] > exposed[2]
    record = next(n for n in scheduled[1]["forward"].graph.nodes if n.name == "all_gather_blocks_1")
    schedule = record.meta["fxshard"]["schedule"]
    assert schedule["issued_before"] == "t" and schedule["overlap_s"] > 0  # issued before unit 0's compute
    assert schedule["exposed_s"] == pytest.approx(schedule["comm_s"] - schedule["overlap_s"])


def test_a_gather_issued_while_a_reduction_is_in_flight_goes_after_its_wait(scheduled):
    # the reduction's gradient buffers (and gloo's copy of them) are freed before the gather allocates its own;
    # the gather still has compute to hide behind, between that wait and its own
    nodes = {n.name: n for n in scheduled[1]["backward"].graph.nodes}
    order = {node: i for i, node in enumerate(nodes.values())}
    gather, reduction = nodes["all_gather_blocks_1"], nodes["reduce_scatter_blocks_3"]
    schedule = gather.meta["fxshard"]["schedule"]
    assert schedule["after_wait_of"] == "reduce_scatter_blocks_3"
    (reduction_wait,), (gather_wait,) = reduction.users, gather.users
    assert order[reduction] < order[reduction_wait] < order[gather] < order[gather_wait]
    assert schedule["overlap_s"] > 0 and schedule["lookahead"] == 1
    assert "after_wait_of" not in nodes["all_gather_blocks_2"].meta["fxshard"]["schedule"]  # none in flight there


class WideTemporary(nn.Module):
    """FourBlocks whose second block makes a temporary 64 times as wide as its activations: the forward's peak."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(4))

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = torch.relu(block(x))
            if i == 1:
                x = x + x.repeat(1, 64).mul(2.0).view(x.shape[0], 64, 8).sum(1)  # nothing of it saved
        return x


def test_a_gather_that_would_raise_the_peak_is_held_back():
    forward = compile_four_blocks(WideTemporary, prefetch=1)["forward"]
    nodes = list(forward.graph.nodes)
    gathers = {n.meta["fxshard"]["unit"]: n for n in nodes if n.meta.get("fxshard", {}).get("role") == "all_gather"}
    held = {unit: n.meta["fxshard"]["schedule"]["held_back_for_peak"] for unit, n in gathers.items()}
    # blocks.2's gather would be in flight during blocks.1's wide temporary: it is issued past its widest point
    assert held == {"blocks.0": False, "blocks.1": False, "blocks.2": True, "blocks.3": False}
    # the widest point: the mul, where the repeated tensor and the product are both alive
    (widest,) = next(n for n in nodes if n.target is aten.repeat.default).users
    assert nodes.index(widest) < nodes.index(gathers["blocks.2"])
    # ... and still ahead of its own use: some compute stays between it and its wait
    assert gathers["blocks.2"].meta["fxshard"]["schedule"]["overlap_s"] > 0
    # the FourBlocks of the tests above, with 4 rows instead of 64: a block's weight outweighs its activations,
    # and no gather can go ahead without raising the peak
    small = compile_four_blocks(rows=4, prefetch=1)["forward"]
    assert held_back(small) == [False, True, True, True]
    # gloo gathers into a buffer of its own: a gather in flight holds its output twice. Where the backend writes in
    # place (NCCL), 8 rows leave room for every gather ahead that gloo's staging copy takes
    assert held_back(compile_four_blocks(rows=8, prefetch=1)["forward"]) == [False, False, False, True]
    in_place = dataclasses.replace(GLOO_ON_CPU, gathers_into_staging=False)
    assert held_back(compile_four_blocks(rows=8, prefetch=1, machine=in_place)["forward"]) == [False] * 4


def held_back(gm) -> list[bool]:
    return [n.meta["fxshard"]["schedule"]["held_back_for_peak"] for n in gm.graph.nodes
            if n.meta.get("fxshard", {}).get("role") == "all_gather"]


# -- the schedule= hook ---------------------------------------------------------------------------------------------
def test_a_custom_schedule_runs_instead_of_prefetch():
    from examples.custom_schedule import gathers_first

    graphs = compile_four_blocks(schedule=gathers_first)
    lines = positions(graphs["forward"]).splitlines()
    assert lines[:4] == [f"all_gather blocks.{i}" for i in range(4)]
    assert lines[4:6] == ["wait(all_gather blocks.0)", "    mm(primals_2, t)"]


def add_a_node(gm, ctx):
    node = next(iter(gm.graph.find_nodes(op="placeholder")))
    with gm.graph.inserting_after(node):
        gm.graph.call_function(aten.clone.default, (node,))
    return gm


def use_before_definition(gm, ctx):
    wait = next(n for n in gm.graph.nodes if n.meta.get("fxshard", {}).get("role") == "wait")
    next(iter(gm.graph.find_nodes(op="placeholder"))).prepend(wait)  # the wait before the gather it waits for
    return gm


@pytest.mark.parametrize("schedule, message", [(add_a_node, "must only reorder"),
                                               (use_before_definition, "not valid"),
                                               (lambda gm, ctx: None, "must return the GraphModule")])
def test_a_custom_schedule_that_is_no_pure_reorder_is_refused(schedule, message):
    with pytest.raises(fxshard.FxShardError, match=message):
        compile_four_blocks(schedule=schedule)


# -- numerics on 2 gloo ranks: a reorder and a regrouping change no number -------------------------------------------
VARIANTS = [
    {"stage": 3, "bucket": "layer", "prefetch": 2, "max_inflight_gathers": 3},
    {"stage": 3, "bucket": "block", "blocks": [Block], "prefetch": 1},
    {"stage": 0, "bucket": 20_000},
]


def test_scheduled_and_bucketed_stages_match_the_single_process_reference(pools):
    for result in pools(2).run(scenarios.train_variants_against_reference, "gpt", "sgd", VARIANTS):
        for options, final, collectives in zip(VARIANTS, result["finals"], result["collectives"]):
            for name, want in result["expected"].items():
                error = ((final[name] - want).norm() / want.norm()).item()
                assert error <= 1e-6, (options, name, error)
        # every variant sums the same per-rank gradients in the same order: bit-identical to each other
        for final in result["finals"][1:]:
            assert all(torch.equal(final[k], result["finals"][0][k]) for k in final)
        assert [len(c["forward"]) for c in result["collectives"]] == [16, 6, 0]
        assert [len(c["backward"]) for c in result["collectives"]] == [29, 9, 7]
