"""Every rank steps together: each training forward and each step checks that the ranks took the same steps.

Data parallelism is right only while every rank runs the same forward and backward passes and steps its optimizer
after the same ones. A rank that skips ``optimizer.step()`` on a condition only it sees (its own loss, a scaler of
its own) would otherwise go on alone: at stages 0 and 3 silently, training on stale parameters beside the others;
at stages 1 and 2 the others' step collectives would meet the first collective of its next forward and backward
(a hang until the timeout, or worse). So each place where the ranks must meet between two backward passes (every
compiled training forward; every step, gradient norm and GradScaler inf check of a prepared model) starts with one
all-gather of each rank's ``(steps taken, the place)``: two integers a rank. After a skip, the ranks meet in the
first such all-gather (the skipping rank's next forward, the others' step), every rank sees the rows differ, and
every rank raises the same FxShardError, naming who is where. Nothing is left in flight, so the group stays usable.

The check reads the result on the host: free on the CPU; on a GPU it waits for the work queued before it. It runs
through c10d, not the functional collectives a step's data moves by: it is bookkeeping, not part of the step's
communication, so the ledger and ``fxshard.report.measure.CollectiveCounter`` leave it out (a profiler's trace of
gloo shows it: one ``gloo:all_gather`` per check).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fxshard.errors import FxShardError
from fxshard.torch_compat import resolve_group

from .groups import compares_peers, peer_failures_explained

FORWARD = "a forward pass"
STEP = "optimizer.step()"
NORM = "a gradient norm"
INF_CHECK = "GradScaler's inf/NaN check"
PLACES = (FORWARD, STEP, NORM, INF_CHECK)


class StepClock:
    """A prepared model's count of optimizer steps on this rank, compared with every rank's at each meeting place
    (``check``); ``group_name``: every rank that holds a piece of the model; nothing to compare on one rank or the
    single-process fake group."""

    def __init__(self, group_name: str, device: torch.device):
        self.steps = 0
        self.group_name, self.device = group_name, device
        group = resolve_group(group_name) if group_name else None
        self.ranks = dist.get_process_group_ranks(group) if group is not None and compares_peers(group) else []

    def check(self, place: str) -> None:
        """Raise FxShardError on every rank unless every rank arrives at ``place`` with this rank's step count."""
        if not self.ranks or torch.compiler.is_compiling():
            return
        mine = torch.tensor([self.steps, PLACES.index(place)], dtype=torch.int64, device=self.device)
        every = mine.new_empty(2 * len(self.ranks))
        with peer_failures_explained(place):
            dist.all_gather_into_tensor(every, mine, group=resolve_group(self.group_name))
        rows = [tuple(row) for row in every.view(-1, 2).tolist()]
        if any(row != rows[0] for row in rows):
            raise FxShardError(_disagreement(dict(zip(self.ranks, rows))))

    def step(self) -> None:
        """An optimizer step over the model begins: checked, then counted."""
        self.check(STEP)
        self.steps += 1


def _disagreement(where: dict[int, tuple[int, int]]) -> str:
    ranks_at: dict[tuple[int, int], list[int]] = {}
    for rank, row in where.items():
        ranks_at.setdefault(row, []).append(rank)
    said = "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
        f"{'start' if len(ranks) > 1 else 'starts'} {PLACES[place]} after {steps} optimizer step{'s' * (steps != 1)}"
        for (steps, place), ranks in sorted(ranks_at.items(), key=lambda item: item[1][0]))
    return (
        f"the ranks are not at the same place of training: {said}. Every rank must run the same forward and backward "
        "passes and call optimizer.step() after the same ones: one rank skipped a step (a condition on a value only "
        "it holds, such as its own loss), ran another number of micro-batches, or ran a forward with gradients "
        "enabled alone. Decide such a condition on a value every rank agrees on (all-reduce it first), and run "
        "evaluation under torch.no_grad() (docs/training-scripts.md#every-rank-steps-together)"
    )
