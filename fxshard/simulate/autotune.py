"""The knobs a graph compiles with where the user left fxshard a choice: the candidate the simulator predicts
fastest, among those whose memory fits ``memory_budget``.

Three knobs leave a choice:

- ``bucket="auto"`` (the default of stages 1-3) on a model with repeated blocks: one collective per block and one
  for the rest (FSDP2's grouping, ``fxshard.compiler.blocks``), or one per layer (less memory held at once, more
  collectives);
- ``memory_budget``: ``prefetch`` and ``max_inflight_gathers`` become the most a schedule may use: the given pair
  and every less eager one down to no prefetch are candidates, under each grouping;
- ``quantize_weights="auto"`` / ``quantize_grads="auto"``, the user's leave to go lossy: unpacked and ``"int8"``
  (``LOSSY_CHOICES``) are candidates under each of the above, the weights in forward and inference graphs (the
  backend gives backward the forward's choice), the gradients in backward graphs. Without "auto" no candidate is
  lossy.

For a lowered graph (forward, backward, inference) with more than one candidate, the backend runs its pass pipeline
on a copy of the graph per candidate, predicts the graph's time on a ``fxshard.simulate.Machine``
(``simulate_graph``: a compute and a communication stream, alpha-beta collectives with a per-collective overhead)
and its memory (``fxshard.budget.graph_ledger``: inputs, peak, what the optimizer keeps), and compiles with the
fastest candidate that fits: on a tie the one listed first (the knobs as given); where none fits, the one that needs
least, which ``budget_pass`` then refuses with its ledger. Every rank chooses alike: the graphs are the same on every
rank (``fxshard.compiler.consistency`` checks it) and the machine's figures are constants or calibrated over the group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torch import fx

from fxshard.budget.step_ledger import graph_ledger
from fxshard.passes import PassContext
from fxshard.passes.trial import Pass, trial_run

from .simulator import chosen_candidate, simulate_graph

CHOSEN_GRAPHS = ("forward", "backward", "inference")
LOSSY_CHOICES = (None, "int8")  # unpacked first: on a tie the exact one


def candidates(ctx: PassContext) -> list[PassContext]:
    """The contexts a graph of ``ctx.graph`` may compile under, the knobs as given first; one where there is no
    choice."""
    if ctx.graph not in CHOSEN_GRAPHS:
        return [ctx]
    groupings = [ctx, dataclasses.replace(ctx, bucket="layer")] if ctx.bucket == "auto" and ctx.blocks else [ctx]
    if ctx.memory_budget is not None and ctx.schedule is None:
        pairs = [(p, m) for p in range(ctx.prefetch, 0, -1) for m in range(ctx.max_inflight_gathers, 0, -1)]
        groupings = [dataclasses.replace(grouping, prefetch=p, max_inflight_gathers=m)
                     for grouping in groupings for p, m in [*pairs, (0, 1)]]
    weights = LOSSY_CHOICES if ctx.quantize_weights == "auto" else (ctx.quantize_weights,)
    grads = (ctx.quantize_grads,)
    if ctx.quantize_grads == "auto":  # only backward reduces gradients
        grads = LOSSY_CHOICES if ctx.graph == "backward" else (None,)
    return [dataclasses.replace(grouping, quantize_weights=w, quantize_grads=g)
            for grouping in groupings for w in weights for g in grads]


def describe_knobs(ctx: PassContext) -> str:
    """``bucket=auto, prefetch=1, max_inflight_gathers=2``: the knobs that tell candidates apart (and the
    quantization where there is one)."""
    bucket = f'"{ctx.bucket}"' if isinstance(ctx.bucket, str) else ctx.bucket
    packed = "".join(f', {name}="{value}"' for name, value in (("quantize_weights", ctx.quantize_weights),
                                                                ("quantize_grads", ctx.quantize_grads)) if value)
    return f"bucket={bucket}, prefetch={ctx.prefetch}, max_inflight_gathers={ctx.max_inflight_gathers}{packed}"


def choose(gm: fx.GraphModule, ctx: PassContext, passes: Sequence[Pass]) -> tuple[PassContext, dict | None]:
    """The context to compile ``gm`` under, each candidate predicted on ``ctx.machine`` (the figures its gathers are
    placed by), and the record of the choice (None where there was none):
    ``{"machine", "memory_budget", "candidates": [{"knobs", "predicted_s", "bytes", "fits", "graph"}], "chosen":
    index}``; each candidate keeps its rewritten graph, so a prediction at another world size chooses again
    (``simulator.as_chosen_at``)."""
    options = candidates(ctx)
    if len(options) == 1:
        return options[0], None
    tried = []
    for option in options:
        trial = trial_run(gm, dataclasses.replace(option, memory_budget=None), passes)
        ledger = trial.meta.get("fxshard_ledger") or graph_ledger(trial, ctx.graph, ctx.world_size,
                                                                   ctx.optimizer_bytes)  # budget_pass's, if run
        needed = ledger["total"]
        seconds = simulate_graph(trial, ctx.graph, ctx.world_size, ctx.machine)[0]
        tried.append({"knobs": describe_knobs(option), "predicted_s": seconds, "bytes": needed,
                      "fits": ctx.memory_budget is None or needed <= ctx.memory_budget, "graph": trial})
    chosen = chosen_candidate(tried, [c["predicted_s"] for c in tried])
    return options[chosen], {"machine": ctx.machine, "memory_budget": ctx.memory_budget, "candidates": tried,
                             "chosen": chosen}


def chosen_graph(choice: dict | None, ctx: PassContext) -> fx.GraphModule | None:
    """The graph the chosen candidate's trial made, where that trial ran under ``ctx`` itself: what the pipeline
    would make of the graph again. Trials run without ``memory_budget`` (``budget_pass`` refuses none of them), so
    under a budget the pipeline runs again and enforces it."""
    if choice is None or ctx.memory_budget is not None:
        return None
    return choice["candidates"][choice["chosen"]]["graph"]


def describe_choices(records) -> str:
    """For each graph whose knobs were chosen (``gm.meta["fxshard_choice"]``), every candidate with its predicted
    time and memory, the chosen one marked; "" when no graph had a choice."""
    lines = []
    for record in records:
        choice = None if record.final is None else record.final.meta.get("fxshard_choice")
        if choice is None:
            continue
        if not lines:
            budget = choice["memory_budget"]
            fits = "" if budget is None else f" that fits memory_budget={budget:,} bytes"
            lines.append(f"knobs chosen by the simulator (the fastest predicted graph{fits}):")
        for index, tried in enumerate(choice["candidates"]):
            lines.append(f"  graph {record.graph_id} {record.kind}: {tried['knobs']}: "
                         f"{tried['predicted_s'] * 1e3:.2f} ms, {tried['bytes']:,} bytes"
                         f"{'' if tried['fits'] else ' (over)'}" + ("  <- chosen" if index == choice["chosen"] else ""))
    return "\n".join(lines)
