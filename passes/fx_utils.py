"""Small helpers over ``fx.Graph`` shared by the passes."""

from __future__ import annotations

from torch import fx
from torch._guards import detect_fake_mode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp


def unit_of(fqn: str) -> str:
    """The module that uses a parameter: ``"blocks.0.attn.qkv.weight"`` -> ``"blocks.0.attn.qkv"``."""
    return fqn.rpartition(".")[0]


def marker_args(node: fx.Node) -> dict:
    """A marker node's arguments by their schema names (``local``, ``resident``, ``fqn``, ``grad_reduction``...)."""
    return {arg.name: value for arg, value in zip(node.target._schema.arguments, node.args)}


def fxshard_meta(node: fx.Node) -> dict:
    """The node's ``meta["fxshard"]`` record, created empty if missing."""
    return node.meta.setdefault("fxshard", {})


def refresh_fake_values(gm: fx.GraphModule) -> None:
    """Recompute ``meta["val"]`` of every node from the placeholders' fake values (new nodes lack them)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    values = [p.meta.get("val") for p in placeholders]
    fake_mode = detect_fake_mode(values)
    if fake_mode is None or any(v is None for v in values):
        return
    FakeTensorProp(gm, mode=fake_mode).propagate_dont_convert_inputs(*values)


def position(graph: fx.Graph) -> dict[fx.Node, int]:
    return {node: i for i, node in enumerate(graph.nodes)}
