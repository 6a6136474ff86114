"""Where each communication option starts to pay: a step's graphs simulated under each option (``WhatIf``) at
growing world sizes, beside the step as compiled: over a range of inter-node links (the machine's other figures
kept), or over whole machines (every figure theirs: bandwidth, latency, per-collective overhead, all-to-all, the
node's link)."""

from __future__ import annotations

import dataclasses

from fxshard.errors import FxShardError
from fxshard.passes.cost_model import Machine

from .simulator import WhatIf, simulate

WORLDS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
LINKS = (1.25e9, 1.25e10, 5e10)  # bytes/s per rank between nodes: 10, 100 and 400 Gb/s
NODE_LINK = 1e11  # bytes/s per rank inside a node (NVLink-class)


def swept_links(machine: Machine, links=LINKS, node_link: float = NODE_LINK) -> list[Machine]:
    """``machine`` on each of ``links`` (bytes/s per rank between nodes), named by it: what ``--options`` sweeps
    where no machine is named."""
    return [dataclasses.replace(with_link(machine, link, node_link), name=f"{machine.name} at {link * 8 / 1e9:g} Gb/s")
            for link in links]


def options(node: int) -> dict[str, WhatIf]:
    """The options compared, by the backend arguments that ask for them."""
    return {
        'quantize_weights="bf16"': WhatIf(quantize_weights="bf16"),
        'quantize_weights="int8"': WhatIf(quantize_weights="int8"),
        'quantize_grads="int8"': WhatIf(quantize_grads="int8"),
        'quantize_weights="int8", quantize_grads="int8"': WhatIf(quantize_weights="int8", quantize_grads="int8"),
        f"reshard_after_forward={node}": WhatIf(secondary=node),
    }


@dataclasses.dataclass
class OptionRow:
    option: str
    step_s: dict[int, float]  # world -> predicted step
    pays_from: int | None  # the least world where it is predicted faster than the step as compiled


def with_link(machine: Machine, link: float, node_link: float = NODE_LINK) -> Machine:
    """``machine`` with ``link`` bytes/s per rank between nodes and ``node_link`` inside one; an all-to-all keeps its
    speed relative to the ring's (``all_to_all_bandwidth / bandwidth``)."""
    exchange = None if machine.all_to_all_bandwidth is None else link * machine.all_to_all_bandwidth / machine.bandwidth
    return dataclasses.replace(machine, bandwidth=link, node_bandwidth=node_link, all_to_all_bandwidth=exchange)


def compare_options(backend, machine: Machine, node: int = 8, worlds=WORLDS) -> list[OptionRow]:
    """The step as compiled (first row) and under each option, predicted at each of ``worlds`` on ``machine`` with
    nodes of ``node`` ranks; secondary shards only where a world spans more than one node."""
    if node < 2:
        raise FxShardError(f"node must be 2 or more ranks (the group secondary shards are re-gathered in), got {node}")
    plain = {w: simulate(backend, w, machine=machine).step_time for w in worlds}
    rows = [OptionRow("as compiled", plain, None)]
    for name, what_if in options(node).items():
        usable = [w for w in worlds if not what_if.secondary or (w > node and w % node == 0)]
        steps = {w: simulate(backend, w, machine=machine, what_if=what_if).step_time for w in usable}
        faster = [w for w in usable if steps[w] < plain[w] * 0.99]
        rows.append(OptionRow(name, steps, min(faster) if faster else None))
    return rows


def options_table(backend, machines: list[Machine], node: int = 8, worlds=WORLDS) -> str:
    """``compare_options`` on each machine, as text: predicted milliseconds per step by world size, and the least
    world where each option is predicted faster than the step as compiled."""
    from tabulate import tabulate

    parts = []
    for machine in machines:
        rows = compare_options(backend, machine, node, worlds)
        parts.append(f"\n{machine.name}: predicted step (ms)\n  between nodes {machine.bandwidth / 1e9:g} GB/s "
                     f"per rank, {1e6 * machine.latency:g} us a hop, {1e6 * machine.collective_overhead:g} us a "
                     f"collective; inside a node of {node} ranks "
                     f"{(machine.node_bandwidth or machine.bandwidth) / 1e9:g} GB/s")
        cells = [[r.option, *(f"{1e3 * r.step_s[w]:.1f}" if w in r.step_s else "" for w in worlds),
                  "" if r.option == "as compiled" else (f"N={r.pays_from}" if r.pays_from else "never")]
                 for r in rows]
        parts.append(tabulate(cells, headers=["option", *(f"N={w}" for w in worlds), "pays from"]))
    return "\n".join(parts)
