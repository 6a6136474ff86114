"""Snapshots of graphs whose lines torch writes (its decompositions of the user's own math) are pinned on CI's torch
release only; fxshard's own lines are pinned on every release the suite runs on."""

import re

import torch

from fxshard.testing import assert_graph_snapshot, graph_summary

SNAPSHOT_TORCH = "2.13."  # the release CI runs, which the literals were recorded with


def on_snapshot_torch() -> bool:
    return torch.__version__.startswith(SNAPSHOT_TORCH)


def fxshard_lines(summary: str) -> list[str]:
    """The lines of the nodes fxshard put or tagged: a marker, a collective, a node with its unit and role."""
    return [line for line in summary.splitlines() if "  # " in line or re.search(r"= (fxshard|c10d)\.", line)]


def assert_fxshard_snapshot(gm, expected: str) -> None:
    """The whole graph on CI's torch; on another release, whose optimizer code and decompositions differ
    (torch 2.11 writes SGD's ``add(p, grad, alpha=-lr)`` as a mul and an add), fxshard's lines."""
    if on_snapshot_torch():
        assert_graph_snapshot(gm, expected, skip=1)
    else:
        assert fxshard_lines(graph_summary(gm)) == fxshard_lines(expected)
