"""What ``prepare`` made of an optimizer: one ``OptimizerRecord``, reached through ``optimizer_record``.

At stage 0 the optimizer prepare returns updates the model's parameters itself. At stages 1-3 it holds the model's
tensors and its step steps an inner optimizer of the same class over the flat shards (``FlatShardUpdate``); both
optimizers reach the same record, so either one answers "which optimizer updates what this rank trains" and "is
this the one stepped from another's step".
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

_RECORD_KEY = "_fxshard"  # in the optimizer's __dict__, as ModuleRecord's in a module's


@dataclass(eq=False)
class OptimizerRecord:
    """``returned``: the optimizer prepare returned (its groups hold what the model holds). ``updating``: the one
    whose update writes what this rank trains (``returned`` at stage 0; the inner optimizer over the flat shards at
    stages 1-3). ``sharded_step``: the stage's ``ShardedStep``, its communication around that update.
    ``flat_shard_update``: at stages 1-3, the ``FlatShardUpdate`` that steps ``updating`` from ``returned``'s step.
    (Both classes live in ``optim``, which builds this record: typed ``object`` here so that this module, read by
    the optimizer's state-dict hooks below ``optim``, imports neither.)"""

    returned: torch.optim.Optimizer
    updating: torch.optim.Optimizer
    sharded_step: object
    flat_shard_update: object | None = None

    def attach(self) -> None:
        for optimizer in (self.returned, self.updating):
            optimizer.__dict__[_RECORD_KEY] = self


def optimizer_record(optimizer: torch.optim.Optimizer) -> OptimizerRecord | None:
    """The record of an optimizer ``prepare`` returned, or of the one its step steps; None for any other."""
    return optimizer.__dict__.get(_RECORD_KEY)


def updating_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose update writes what this rank trains: at stages 1-3 the one over the flat shards (stage
    1: the fp32 masters) that the returned optimizer steps from its own step; at stage 0 the returned optimizer."""
    record = optimizer_record(optimizer)
    return optimizer if record is None else record.updating


def steps_inside_another(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is the one over the flat shards that a returned optimizer steps from its own step."""
    record = optimizer_record(optimizer)
    return record is not None and record.updating is optimizer and record.returned is not optimizer


def replace_updated_state(optimizer: torch.optim.Optimizer, state_of_updated: dict) -> None:
    """Make ``state_of_updated`` (keyed by what ``updating_optimizer`` updates) the optimizer's whole state: at
    stages 1-3 through its FlatShardUpdate, which shares it with the returned optimizer's parameters."""
    record = optimizer_record(optimizer)
    if record is not None and record.flat_shard_update is not None:
        record.flat_shard_update.replace_state(state_of_updated)
    else:
        optimizer.state.clear()
        optimizer.state.update(state_of_updated)
