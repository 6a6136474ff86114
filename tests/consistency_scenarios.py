"""Rank functions of the compile-time consistency check (module level, so that WorkerPool ranks import them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import fxshard
from fxshard.testing import rank_and_world


class BranchingMLP(nn.Module):
    """fc1 -> extra (only where ``takes_extra``) -> fc2: a forward whose path a rank-dependent flag decides."""

    def __init__(self, takes_extra: bool):
        super().__init__()
        self.fc1, self.extra, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 5)
        self.takes_extra = takes_extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.relu(self.fc1(x))
        if self.takes_extra:
            hidden = F.relu(self.extra(hidden))
        return self.fc2(hidden)


def _compile_the_branching_mlp(takes_extra: bool, **knobs) -> str:
    """Prepare a stage-3 ``BranchingMLP`` with these backend knobs and compile its forward: the FxShardError the
    compile raised, as a string."""
    torch.manual_seed(0)
    backend = fxshard.backend(compiler="eager", stage=3, **knobs)
    model, _ = backend.prepare(BranchingMLP(takes_extra))
    try:
        torch.compile(model, backend=backend, fullgraph=True)(torch.randn(4, 8))
    except fxshard.FxShardError as error:
        return str(error)
    return "compiled and ran without an error"


def compile_a_forward_that_branches_between_shard_groups() -> str:
    """On a 2x2 hybrid mesh, the second shard group's forward takes the extra layer: each shard group agrees within
    itself, and only the replicas' all-reduce would meet the difference; returns each rank's error."""
    from scenarios import hybrid_mesh

    rank, _ = rank_and_world()
    return _compile_the_branching_mlp(rank >= 2, mesh=hybrid_mesh((2, 2)))


def compile_a_forward_that_branches_on_the_rank() -> str:
    """Rank 1's forward takes the extra layer, rank 0's does not; returns the error each rank's compile raised."""
    rank, _ = rank_and_world()
    return _compile_the_branching_mlp(rank == 1)


def only_rank_1_compiles() -> str:
    """Rank 1 compiles a forward its peer never compiles (as after a Dynamo guard that failed on rank 1 alone);
    returns rank 1's error. Leaves the ranks' checks out of step: run it on ranks of its own."""
    rank, _ = rank_and_world()
    if rank == 0:
        torch.manual_seed(0)
        fxshard.backend(compiler="eager", stage=3, collective_timeout_s=2).prepare(BranchingMLP(False))
        return "rank 0 compiled nothing"
    return _compile_the_branching_mlp(False, collective_timeout_s=2)


class PairSum(nn.Module):
    """An MLP whose hidden activations are summed over a pair of ranks by the user's own functional all-reduce."""

    def __init__(self, pair_group: str):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 5)
        self.pair_group = pair_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_reduce

        return self.fc2(all_reduce(F.relu(self.fc1(x)), "sum", self.pair_group))


def compile_a_forward_with_a_collective_over_rank_pairs() -> str:
    """Stage 3 over every rank of 4, the user's all-reduce over the pairs (0, 1) and (2, 3): the same graph on
    every rank, on groups of other names. Returns each rank's FxShardError, or that it ran."""
    from torch.distributed.device_mesh import init_device_mesh

    pairs = init_device_mesh("cpu", (2, 2), mesh_dim_names=("across", "pair"))["pair"].get_group()
    torch.manual_seed(0)
    backend = fxshard.backend(compiler="eager", stage=3)
    model, _ = backend.prepare(PairSum(pairs.group_name))
    try:
        torch.compile(model, backend=backend, fullgraph=True)(torch.randn(4, 8)).sum().backward()
    except fxshard.FxShardError as error:
        return str(error)
    return "compiled and ran without an error"
