"""Snapshots of graphs whose lines torch writes (its decompositions of the user's own math) are pinned on CI's torch
release only; fxshard's own lines are pinned on every release the suite runs on."""

import re

import torch

from fxshard.testing import assert_graph_snapshot, graph_summary

SNAPSHOT_TORCH = "2.13."  # the release CI runs, which the literals were recorded with


def on_snapshot_torch() -> bool:
    return torch.__version__.startswith(SNAPSHOT_TORCH)


def fxshard_lines(summary: str) -> list[str]:
    """The lines of the nodes fxshard put or tagged: a marker, a collective, a node with its unit and role, a node
    it marked recomputed. The graph's tensor inputs are named by their order (torch 2.13 passes DTensor's DeviceMesh
    as an input too, 2.11 does not) and fxshard's nodes by name; any other node, torch's own, which each release's
    decompositions name differently, is ``_``."""
    lines = summary.splitlines()
    inputs = [line.split(":")[0] for line in lines if re.fullmatch(r"\w+: \w+\[.*\]", line)]
    ours = [line for line in lines if "  # " in line or re.search(r"= (fxshard|c10d)\.", line)]
    names = {name: f"input_{index}" for index, name in enumerate(inputs)}
    # a node fxshard made or gave a role keeps its name; one of torch's it only marked recomputed does not
    names.update({line.split(" = ")[0]: line.split(" = ")[0] for line in ours if not line.endswith("  # recomputed")})

    def normalised(line: str) -> str:
        target, _, rest = line.partition(" = ")
        target = names.get(target, "_")
        call, arrow, result = rest.partition(") -> ")
        op, _, args = call.partition("(")
        args = re.sub(r"(?<![\w.])[A-Za-z_]\w*", lambda name: names.get(name.group(), "_"), args)
        return f"{target} = {op}({args}{arrow}{result}"

    return [normalised(line) for line in ours]


def assert_fxshard_snapshot(gm, expected: str) -> None:
    """The whole graph on CI's torch; on another release, whose optimizer code and decompositions differ
    (torch 2.11 writes SGD's ``add(p, grad, alpha=-lr)`` as a mul and an add), fxshard's lines."""
    if on_snapshot_torch():
        assert_graph_snapshot(gm, expected, skip=1)
    else:
        assert fxshard_lines(graph_summary(gm)) == fxshard_lines(expected)
