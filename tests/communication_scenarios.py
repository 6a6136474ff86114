"""Rank functions for the communication options (secondary shards, quantized gathers and reductions): what a step
sends on the wire, counted by the kernel, beside the ledger; training against plain stage 3."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import fxshard
import scenarios
from fxshard import budget
from fxshard.report.measure import CollectiveCounter
from fxshard.report.wire import sent_during
from fxshard.runtime.collectives import COLLECTIVE_ROLES
from fxshard.runtime.prepare import grad_sync_of
from fxshard.runtime.step_clock import FORWARD
from examples.models import GPTConfig, pattern_batch
from fxshard.testing import rank_and_world
from fxshard.torch_compat import c10d_functional, resolve_group

WARM_STEPS = 2  # the first step compiles; the second is the first to run what was compiled
LR = 3e-3  # the pattern task's loss falls from 4.2 to 2.2 in 40 steps


def _phases_of_a_step(run, opt, generator):
    """The phases of one training step of the GPT on this rank's slice of a global batch of the pattern task:
    forward, backward, the optimizer's step, and the loss."""
    rank, world = rank_and_world()
    batch = pattern_batch(GPTConfig(), world * scenarios.PER_RANK_BATCH, generator)
    local = tuple(t[rank * scenarios.PER_RANK_BATCH:(rank + 1) * scenarios.PER_RANK_BATCH] for t in batch)
    state = {}

    def forward():
        state["loss"] = scenarios.loss_of("gpt", run, local)

    def step():
        opt.step()
        opt.zero_grad()

    return {"forward": forward, "backward": lambda: state["loss"].backward(), "step": step}, state


def step_on_the_wire(steps: int = WARM_STEPS + 1, **options) -> dict:
    """Stage 3 AdamW on the GPT learning ``pattern_batch``'s rule, under ``options``, for ``steps`` steps (at least
    ``WARM_STEPS`` + 1): the losses,
    the full parameters after them, and of the last step, by phase (forward, backward, step), the bytes each pair of
    ranks sent as the kernel counts them (less what two barriers alone send), beside the ledger's bytes sent per rank
    (ring collectives), in all and by the group they run over."""
    torch._dynamo.reset()
    model = scenarios.build_model("gpt")
    backend = fxshard.backend(stage=3, **options)
    model, opt = backend.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    run = torch.compile(model, backend=backend, fullgraph=True)
    generator = torch.Generator().manual_seed(1)
    losses, sent = [], {}
    for index in range(steps):
        phases, state = _phases_of_a_step(run, opt, generator)
        last = index == steps - 1
        with CollectiveCounter() if last else contextlib.nullcontext() as counter:
            for name, work in phases.items():
                if last:
                    sent[name] = sent_during(work)
                else:
                    work()
        losses.append(state["loss"].item())
    # one check of the step clock, bookkeeping outside the ledger's data collectives: a step runs two (its
    # forward's, its optimizer step's)
    clock_check_sent = sent_during(lambda: grad_sync_of(model).clock.check(FORWARD))
    ledger = budget.ledger(backend)
    by_group = {str(g): ledger.at(ledger.communicated(moved=True, ranks=g))
                for g in (budget.N, budget.R, budget.T, budget.K) if any(t.ranks == g for t in ledger.select("comm"))}
    by_kind = {kind: ledger.at(ledger.communicated(kind, moved=True)) for kind in ("all_gather", "reduce_scatter")}
    handed = {kind: ledger.at(ledger.communicated(kind)) for kind in COLLECTIVE_ROLES if ledger.calls(kind)}
    backward_gathers = [n.args[-1] for r in backend.graphs if r.kind == "backward" for n in r.final.graph.nodes
                        if n.target is c10d_functional.all_gather_into_tensor.default]
    return {"losses": losses, "final": scenarios.full_state(model), "sent": sent, "clock_check_sent": clock_check_sent,
            "ledger_sent": ledger.at(ledger.communicated(moved=True)), "ledger_by_group": by_group,
            "ledger_by_kind": by_kind, "ledger_handed": handed,
            "counted": {kind: totals["bytes"] for kind, totals in counter.totals().items()}, "calls": {kind: ledger.calls(kind) for kind in ("all_gather", "reduce_scatter")},
            "backward_gather_ranks": sorted({tuple(dist.get_process_group_ranks(resolve_group(name)))
                                             for name in backward_gathers})}
