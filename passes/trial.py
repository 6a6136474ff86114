"""What a list of passes makes of a graph, on a copy that leaves the graph and its history untouched: the autotuner
tries candidate knobs this way, and the calibration times copies of graphs."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence

from torch import fx

from fxshard.torch_compat import lazy_graph_module

from .context import PassContext

Pass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]


def copied_graph(gm: fx.GraphModule) -> fx.Graph:
    """A deep copy of ``gm``'s graph whose nodes' ``meta["fxshard"]`` records are copies too."""
    with warnings.catch_warnings():  # torch 2.13's pytree warns about its own LeafSpec while copying codegen
        warnings.simplefilter("ignore", FutureWarning)
        graph = copy.deepcopy(gm.graph)
    # Copying a graph copies each node's meta shallowly: without this, a later pass that updates a node's
    # meta["fxshard"] record would rewrite the history of every earlier pass.
    for node in graph.nodes:
        if "fxshard" in node.meta:
            node.meta["fxshard"] = copy.deepcopy(node.meta["fxshard"])
    return graph


def copied_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A module over a copy of ``gm``'s graph (``copied_graph``), as ``module_over`` makes it."""
    return module_over(gm, copied_graph(gm), gm.meta)


def module_over(root: fx.GraphModule, graph: fx.Graph, meta: dict) -> fx.GraphModule:
    """A module running ``graph`` with ``meta``'s entries and ``root``'s attributes: those the graph reads, and
    ``root``'s own parameters and buffers that no node reads yet (a pass may read them: ``shard_optimizer_pass``
    publishes into buffers the backend registered)."""
    module = lazy_graph_module(root, graph)  # its code generated when first run or read
    module.meta.update(meta)
    for name, buffer in root.named_buffers(recurse=False):
        if not hasattr(module, name):
            module.register_buffer(name, buffer)
    for name, parameter in root.named_parameters(recurse=False):
        if not hasattr(module, name):
            module.register_parameter(name, parameter)
    return module


def trial_run(gm: fx.GraphModule, ctx: PassContext, passes: Sequence[Pass]) -> fx.GraphModule:
    """``passes`` over a copy of ``gm``, recorded nowhere: what the pipeline would make of it under ``ctx``."""
    trial = copied_module(gm)
    for pass_fn in passes:
        trial = pass_fn(trial, ctx)
    return trial
