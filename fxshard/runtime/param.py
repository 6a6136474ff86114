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

Each module that owns parameters keeps one ``ModuleRecord`` (``module_record``): its name in the prepared model,
the record of each parameter it owns, and the model's ``GradSync``. The module owns its records, and each record
owns its tensors (as FSDP2's ``FSDPParam`` owns its sharded parameter); the registry that finds a record from a
tensor holds both weakly, so a dropped model frees everything prepare made for it.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .sharding import MarkerLayout, ShardSpec
from .step_clock import StepClock
from .tensor_parallel import TensorParallel

# leaf, master, flat or replaced parameter -> a weak reference to its record (a record refers to its tensors: held
# strongly, a value would keep its own key alive)
_RECORDS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_MODULE_RECORD = "_fxshard"  # the module __dict__ key of its ModuleRecord
RESIDENT_BUFFER = "_fxshard_full_"  # buffer name prefix of a stage-2 parameter's resident full copy


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
    leaf: nn.Parameter
    grad_sync: GradSync
    flat: nn.Parameter | None = None
    master: nn.Parameter | None = None
    resident: torch.Tensor | None = None

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


@dataclasses.dataclass(frozen=True, eq=False)
class ParamRead:
    """What a module's accessor reads for one parameter, worked out once by ``prepare``: Dynamo traces each Python
    step of an accessor and guards on each value it reads, for every parameter of the model, so the accessor looks
    up these fields and nothing else (``fxshard.runtime.prepare``)."""

    leaf: nn.Parameter  # the parameter the module must still hold (else it was replaced after prepare)
    shard: torch.Tensor | None  # what the marker reads: the flat shard (stages 2, 3), the leaf (stage 0); None: none
    resident: str | None  # stage 2: the name of the module's buffer holding the resident full copy
    marker: tuple  # the marker's arguments after its two tensors (``ShardSpec.marker_arguments``)
    kept_local: tuple | None  # stage 0: the same arguments under ``no_sync`` (the gradient stays on this rank)
    grad_sync: GradSync | None  # stage 0: the model's, whose ``enabled`` picks between the two
    tensor_parallel: TensorParallel | None  # the spec's: the accessor returns a DTensor over its mesh


@dataclasses.dataclass(eq=False)
class ModuleRecord:
    """What prepare keeps on a module that owns parameters: its qualified name in the prepared model (``path``), the
    record of each parameter it owns, by attribute name (a tied parameter's record is its owners' alike), its
    model's GradSync, and what its accessors read (``reads``, by attribute name)."""

    path: str
    params: dict[str, PreparedParam]
    grad_sync: GradSync
    reads: dict[str, ParamRead] = dataclasses.field(init=False)

    def __post_init__(self):
        self.reads = {name: self._read(name, record) for name, record in self.params.items()}

    def _read(self, name: str, record: PreparedParam) -> ParamRead:
        spec = record.spec
        fqn = f"{self.path}.{name}" if self.path else name
        stage_0 = spec.stage == 0
        return ParamRead(
            leaf=record.leaf,
            shard=None if spec.stage == 1 else record.leaf if record.flat is None else record.flat,
            resident=f"{RESIDENT_BUFFER}{name}" if spec.stage == 2 else None,
            marker=spec.marker_arguments(fqn),
            kept_local=spec.marker_arguments(fqn, MarkerLayout.KEPT_LOCAL) if stage_0 else None,
            grad_sync=self.grad_sync if stage_0 else None,
            tensor_parallel=spec.tensor_parallel,
        )


def register(record: PreparedParam) -> PreparedParam:
    """Make ``record`` found from its leaf, flat shard and master; whoever keeps it alive (its modules'
    ``ModuleRecord``) keeps it found."""
    for tensor in (record.leaf, record.flat, record.master):
        if tensor is not None:
            _RECORDS[tensor] = weakref.ref(record)
    return record


def register_replaced(original: torch.Tensor, leaf: nn.Parameter) -> None:
    """``original``, a parameter prepare replaced, now finds ``leaf``'s record."""
    _RECORDS[original] = _RECORDS[leaf]


def attach(module: nn.Module, record: ModuleRecord) -> None:
    module.__dict__[_MODULE_RECORD] = record


def module_record(module: nn.Module) -> ModuleRecord | None:
    """The ModuleRecord of a module whose parameters prepare laid out, else None."""
    return module.__dict__.get(_MODULE_RECORD)


def module_records(model: nn.Module) -> Iterator[tuple[nn.Module, ModuleRecord]]:
    """(module, its ModuleRecord) for each module of ``model`` whose parameters prepare laid out."""
    for module in model.modules():
        if (record := module_record(module)) is not None:
            yield module, record


def prepared_param(tensor: torch.Tensor) -> PreparedParam | None:
    """The record of the parameter ``tensor`` is (its leaf, its master, or the parameter prepare replaced)."""
    ref = _RECORDS.get(tensor)
    return None if ref is None else ref()


def spec_of(tensor: torch.Tensor) -> ShardSpec | None:
    """The ShardSpec of a leaf laid out by ``prepare`` (or of a stage-1 master, a stage-2/3 flat shard), or None for
    any other tensor."""
    record = prepared_param(tensor)
    return record.spec if record is not None and record.is_laid_out(tensor) else None


def replaced_by(tensor: torch.Tensor) -> nn.Parameter | None:
    """The leaf that took the place of ``tensor``, a parameter prepare replaced; None for any other tensor."""
    record = prepared_param(tensor)
    return record.leaf if record is not None and not record.is_laid_out(tensor) else None


def prepared_leaves() -> Iterator[nn.Parameter]:
    """Every live leaf prepare laid out, in any model of this process."""
    for tensor, ref in list(_RECORDS.items()):
        record = ref()
        if record is not None and tensor is record.leaf:
            yield tensor
