"""One record per parameter ``prepare`` laid out (FSDP2's ``FSDPParam``): its layout and the tensors fxshard keeps
for it, found from any of them by ``prepared_param``.

- ``leaf``: what the model holds, autograd fills and ``model.parameters()`` yields: the parameter (stages 0, 1),
  or at stages 2 and 3 a DTensor of the parameter's shape holding this rank's rows (``Shard(0)``, as FSDP2's);
- ``flat``: at stages 2 and 3 the flat, zero-padded shard of those rows (``fxshard/runtime/sharding.py``), a
  parameter of its own: the leaf's local tensor is a view of its storage, the compiled graphs read it (and the
  collectives move it), and the gradient autograd gives it is handed to the leaf (``prepare``);
- ``updated``: what the optimizer's update writes: stage 1's ``master``, stages 2-3's ``flat``, stage 0's leaf;
- ``full_copy``: what forward reads of ``updated``, refreshed after each step: stage 1's leaf, stage 2's
  ``resident`` buffer, else none;
- ``grad_sync``: its model's: whether backward averages gradients now (stage 0's ``no_sync``), how the full
  gradients this rank holds become the averaged ones before the step (stages 0, 1), and the model's step clock.

A parameter that ``prepare`` replaced (by its shard; under tensor parallelism, by the leaf of its DTensor's local
piece) finds the record too: ``replaced_by`` names its leaf.

The registry holds the leaf and the flat shard weakly (the model owns them: its ``_parameters`` and the owning
module's ``__dict__``) and a stage-1 master strongly (the record owns it, as FSDP2's ``FSDPParam`` owns its
sharded parameter).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .sharding import ShardSpec
from .step_clock import StepClock

_RECORDS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # leaf, master, flat or replaced parameter -> its record


@dataclasses.dataclass
class GradSync:
    """A prepared model's: whether backward averages gradients now (stage 0, not under ``no_sync``), whether some
    were kept local since the last step, and how the prepared optimizer makes the full gradients this rank holds the
    averaged ones before the step, as a torch utility reading them needs (stage 0: the all-reduce ``no_sync`` left
    pending; stage 1: an all-reduce of the gradients the step reduce-scatters). That method is held weakly: the
    optimizer owns its step, and the registry's records, which hold this, must not keep it (and through it the
    parameters) alive. ``clock`` counts the model's optimizer steps and checks that every rank took the same."""

    enabled: bool = True
    local_grads_pending: bool = False
    clock: StepClock = dataclasses.field(default_factory=lambda: StepClock("", torch.device("cpu")))
    _settle: weakref.WeakMethod | None = None

    def settle_with(self, method: Callable[[], None]) -> None:
        self._settle = weakref.WeakMethod(method)

    def settle(self) -> bool:
        """Average the gradients as the prepared optimizer's step would; False where no prepared optimizer is."""
        method = None if self._settle is None else self._settle()
        if method is None:
            return False
        method()
        return True


@dataclasses.dataclass(eq=False)
class PreparedParam:
    spec: ShardSpec
    _leaf: weakref.ref
    master: nn.Parameter | None = None
    resident: torch.Tensor | None = None
    grad_sync: GradSync | None = None
    _flat: weakref.ref | None = None

    @property
    def flat(self) -> nn.Parameter | None:
        return None if self._flat is None else self._flat()

    @property
    def leaf(self) -> nn.Parameter | None:
        return self._leaf()

    @property
    def updated(self) -> torch.Tensor:
        return self.master if self.master is not None else self.flat if self.flat is not None else self.leaf

    @property
    def full_copy(self) -> torch.Tensor | None:
        return self.leaf if self.master is not None else self.resident

    def is_laid_out(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is one of the tensors prepare made or kept for training (the leaf, the master or the
        flat shard), not a parameter it replaced."""
        return tensor is self.leaf or tensor is self.master or tensor is self.flat


def register(leaf: nn.Parameter, spec: ShardSpec, flat: nn.Parameter | None = None, **tensors) -> PreparedParam:
    """The record of a leaf prepare laid out under ``spec``, with its flat shard, master, resident copy or
    GradSync."""
    record = PreparedParam(spec, weakref.ref(leaf), _flat=None if flat is None else weakref.ref(flat), **tensors)
    _RECORDS[leaf] = record
    for kept in (record.master, record.flat):
        if kept is not None:
            _RECORDS[kept] = record
    return record


def register_replaced(original: torch.Tensor, leaf: nn.Parameter) -> None:
    """``original``, a parameter prepare replaced, now finds ``leaf``'s record."""
    _RECORDS[original] = _RECORDS[leaf]


def prepared_param(tensor: torch.Tensor) -> PreparedParam | None:
    """The record of the parameter ``tensor`` is (its leaf, its master, or the parameter prepare replaced)."""
    return _RECORDS.get(tensor)


def spec_of(tensor: torch.Tensor) -> ShardSpec | None:
    """The ShardSpec of a leaf laid out by ``prepare`` (or of a stage-1 master, a stage-2/3 flat shard), or None for
    any other tensor."""
    record = _RECORDS.get(tensor)
    return record.spec if record is not None and record.is_laid_out(tensor) else None


def replaced_by(tensor: torch.Tensor) -> nn.Parameter | None:
    """The leaf that took the place of ``tensor``, a parameter prepare replaced; None for any other tensor."""
    record = _RECORDS.get(tensor)
    return record.leaf if record is not None and not record.is_laid_out(tensor) else None


def prepared_leaves() -> Iterator[nn.Parameter]:
    """Every live leaf prepare laid out, in any model of this process."""
    for tensor, record in list(_RECORDS.items()):
        if tensor is record.leaf:
            yield tensor
