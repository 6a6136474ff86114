"""fxshard.simulate prices the communication options: on graphs compiled without them (``WhatIf``) as on graphs
compiled with them, and ``python -m fxshard simulate --options`` says where each pays."""

import dataclasses

import pytest

import scenarios
from fxshard.budget import ledger
from fxshard.budget.communication_options import option_rows
from fxshard.simulate import Machine, simulate
from fxshard.simulate.simulator import WhatIf
from fxshard.simulate.what_if import compare_options, options_table, swept_links, with_link

# bytes only: no latency, no per-collective or per-node cost, so a collective's time is its bytes / bandwidth
BYTES_ONLY = Machine(flops_per_s=1e30, memory_bandwidth=1e30, bandwidth=1e3, latency=0.0)
WORLD = 4
BLOCK = 8  # the Chain's shards are a few dozen elements: blocks of 256 would not make them smaller


@pytest.fixture(scope="module")
def compiled():
    options = {"plain": {}, "int8": {"quantize_weights": "int8", "quantize_grads": "int8", "quantize_block": BLOCK},
               "secondary": {"reshard_after_forward": 2}}
    return {name: scenarios.compiled_model("chain", 3, world=WORLD, bucket="layer", **o) for name, o in options.items()}


def test_priced_on_plain_graphs_an_option_costs_what_the_graphs_compiled_with_it_cost(compiled):
    what_if = simulate(compiled["plain"], WORLD, machine=BYTES_ONLY,
                       what_if=WhatIf(quantize_weights="int8", quantize_grads="int8", quantize_block=BLOCK))
    real = simulate(compiled["int8"], WORLD, machine=BYTES_ONLY)
    assert what_if.comm_time == pytest.approx(real.comm_time, rel=1e-9)
    plain = simulate(compiled["plain"], WORLD, machine=BYTES_ONLY)
    assert real.comm_time < 0.6 * plain.comm_time  # a row of a few dozen elements carries a scale per 8


def test_secondary_shards_move_backwards_gathers_to_the_node_link(compiled):
    free_node = Machine(flops_per_s=1e30, memory_bandwidth=1e30, bandwidth=1e3, latency=0.0, node_bandwidth=1e30)
    plain = simulate(compiled["plain"], WORLD, machine=free_node)
    what_if = simulate(compiled["plain"], WORLD, machine=free_node, what_if=WhatIf(secondary=2))
    real = simulate(compiled["secondary"], WORLD, machine=free_node)
    assert what_if.comm_time == pytest.approx(real.comm_time, rel=1e-6)
    gathers = [e for e in plain.events if e.stream == "comm" and e.node.startswith("all_gather")]
    backward_gathers = sum(e.end - e.start for e in gathers if "backward" in e.graph)
    assert backward_gathers > 0
    assert plain.comm_time - what_if.comm_time == pytest.approx(backward_gathers, rel=1e-6)


@pytest.mark.parametrize("machine", [
    Machine(flops_per_s=1e30, memory_bandwidth=1e6, bandwidth=1e30, latency=0.0),  # bytes written
    Machine(flops_per_s=1e30, memory_bandwidth=1e30, bandwidth=1e30, latency=0.0, op_overhead=1e-5),  # nodes
], ids=["bytes", "nodes"])
def test_packing_costs_the_compute_stream_what_the_lowerings_nodes_cost(compiled, machine):
    plain = simulate(compiled["plain"], WORLD, machine=machine)
    what_if = simulate(compiled["plain"], WORLD, machine=machine,
                       what_if=WhatIf(quantize_weights="int8", quantize_grads="int8", quantize_block=BLOCK))
    real = simulate(compiled["int8"], WORLD, machine=machine)
    assert real.compute_time > 4 * plain.compute_time  # on the Chain's small layers packing outweighs the rest
    # the lowering's packing nodes, priced on their own; the graphs compiled with the option add a view per gather
    assert what_if.compute_time == pytest.approx(real.compute_time, rel=0.1)


def test_options_pay_on_a_slow_link_and_the_table_says_from_where(compiled):
    machine = Machine(flops_per_s=1e9, memory_bandwidth=1e10, bandwidth=1e9, latency=1e-6)
    slow = with_link(machine, 1e6, node_link=1e12)
    rows = {r.option: r for r in compare_options(compiled["plain"], slow, node=2, worlds=(2, 4, 8))}
    assert rows['quantize_weights="int8", quantize_grads="int8"'].pays_from == 2
    assert rows["reshard_after_forward=2"].pays_from == 4  # the first world of more than one node
    assert set(rows["reshard_after_forward=2"].step_s) == {4, 8}
    text = options_table(compiled["plain"], swept_links(machine, (1e6,), node_link=1e12), node=2, worlds=(2, 4, 8))
    assert "pays from" in text and "N=4" in text and "custom at 0.008 Gb/s" in text
    assert max(map(len, text.splitlines())) <= 120


def test_options_compare_whole_machines_every_figure_theirs(compiled):
    # the same link, but one machine pays 1 ms per collective and per hop: every step of it is slower, each named
    quick = Machine(flops_per_s=1e9, memory_bandwidth=1e10, bandwidth=1e9, latency=1e-6, name="quick")
    costly = dataclasses.replace(quick, latency=1e-3, collective_overhead=1e-3, name="costly")
    rows = {m.name: compare_options(compiled["plain"], m, node=2, worlds=(2, 4)) for m in (quick, costly)}
    for fast, slow in zip(rows["quick"], rows["costly"]):
        assert all(slow.step_s[w] > fast.step_s[w] + 1e-3 for w in fast.step_s)
    text = options_table(compiled["plain"], [quick, costly], node=2, worlds=(2, 4))
    assert "quick: predicted step (ms)\n  between nodes 1 GB/s per rank, 1 us a hop, 0 us a collective" in text
    assert "costly: predicted step (ms)\n  between nodes 1 GB/s per rank, 1000 us a hop, 1000 us a collective" in text


def test_an_all_to_all_keeps_its_speed_against_the_ring_on_every_swept_link(compiled):
    # gloo's all-to-all is faster than its ring; on a link swept by --options it stays as much faster, not at the
    # calibrated machine's bytes per second (which made int8 gradients, exchanged by all-to-all, look slower on
    # fast links)
    for link in (1e6, 1e9):
        scaled = Machine(flops_per_s=1e30, memory_bandwidth=1e30, bandwidth=link, latency=0.0,
                         all_to_all_bandwidth=2 * link)
        swept = Machine(flops_per_s=1e30, memory_bandwidth=1e30, bandwidth=1e3, latency=0.0,
                        all_to_all_bandwidth=2e3)
        rows = compare_options(compiled["int8"], with_link(swept, link, node_link=link), node=2, worlds=(2,))
        expected = simulate(compiled["int8"], 2, machine=dataclasses.replace(scaled, node_bandwidth=link))
        assert rows[0].step_s[2] == pytest.approx(expected.step_time)


def test_the_report_offers_no_option_a_step_already_uses(compiled):
    # the Chain's rows are shorter than the report's 256-element blocks: only bf16 makes them smaller
    assert [row["option"] for row in option_rows(ledger(compiled["plain"]))] == ['quantize_weights="bf16"']
    assert option_rows(ledger(compiled["int8"])) == []  # its values and scales stay as they travel


def _packed_collectives(backend) -> dict[str, set]:
    return {record.kind: {node.meta["fxshard"]["role"] for node in record.final.graph.nodes
                          if node.meta.get("fxshard", {}).get("quantized")}
            for record in backend.graphs if record.kind in ("forward", "backward")}


@pytest.mark.parametrize("link, packed", [
    (1e5, {"forward": {"all_gather"}, "backward": {"all_gather", "reduce_scatter"}}),  # bytes cost most
    (1e15, {"forward": set(), "backward": set()}),  # packing costs more than the bytes it saves
], ids=["slow link", "fast link"])
def test_auto_lets_the_simulator_choose_int8_where_it_pays(link, packed):
    machine = Machine(flops_per_s=1e9, memory_bandwidth=1e9, bandwidth=link, latency=0.0)
    backend = scenarios.compiled_model("chain", 3, world=WORLD, bucket="layer", machine=machine, quantize_block=BLOCK,
                                       quantize_weights="auto", quantize_grads="auto")
    assert _packed_collectives(backend) == packed  # backward computes with the weights forward chose
    chosen = [r.final.meta["fxshard_choice"] for r in backend.graphs if r.kind in ("forward", "backward")]
    assert all(len(c["candidates"]) == 2 for c in chosen)  # unpacked and int8: the weights, or the gradients


def test_without_auto_no_candidate_is_lossy():
    machine = Machine(flops_per_s=1e9, memory_bandwidth=1e9, bandwidth=1e5, latency=0.0)
    backend = scenarios.compiled_model("chain", 3, world=WORLD, bucket="layer", machine=machine)
    assert _packed_collectives(backend) == {"forward": set(), "backward": set()}
