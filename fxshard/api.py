"""The public entry points: ``fxshard.backend(...)``, ``fxshard.backend_of(model)``, ``fxshard.report(model)``, and
the registered ``torch.compile(model, backend="fxshard", options={...})`` backend (``dynamo_backend``)."""

from __future__ import annotations

import dataclasses
import threading
import weakref

from torch import fx, nn

from fxshard.compiler.backend import Backend, _describe, _prepared_tensors, backend_of, default_passes, prepared_by
from fxshard.compiler.options import COMPILERS, DEFAULT_COMPILER, STAGES
from fxshard.errors import FxShardError
from fxshard.passes import PassContext
from fxshard.passes.context import KNOBS

__all__ = ["COMPILERS", "DEFAULT_COMPILER", "STAGES", "Backend", "backend", "backend_of", "default_passes",
           "dynamo_backend", "prepared_by", "report"]

# The backend the registered backend last sent a graph of a prepared model to (weakly): it also compiles a graph
# that reads no prepared tensor, such as the rest of a forward after a graph break, as backend=backend would.
_LAST_PREPARER = threading.local()


def backend(stage: int = 3, **options) -> Backend:
    """``fxshard.backend(stage=3, **options)``: ``group``, ``passes``, ``compiler`` (see ``Backend``) and the knobs
    that every pass reads (see ``fxshard.passes.PassContext``)."""
    return Backend(stage, **options)



def report(model: nn.Module, format: str = "text", measured=None) -> str:
    """``backend.report(...)`` of the Backend that prepared ``model``, however it was compiled (``backend=backend``
    or ``backend="fxshard"``)."""
    return backend_of(model).report(format=format, measured=measured)



def _option_values(backend: Backend) -> dict:
    """Every option of ``backend`` by its ``fxshard.backend`` keyword (knobs it was not given: their defaults)."""
    defaults = {f.name: f.default for f in dataclasses.fields(PassContext) if f.name in KNOBS}
    return {"stage": backend.stage, "group": backend.group, "mesh": backend.mesh, "passes": backend.passes,
            "compiler": backend.compiler, "regional": backend.regional, "machine": backend.machine,
            **defaults, **backend.knobs}


def dynamo_backend(gm: fx.GraphModule, example_inputs, options: dict | None = None, **_):
    """The registered ``torch.compile(model, backend="fxshard", options={...})`` entry point.

    A graph of a prepared model is compiled by the Backend that prepared it (the same graphs and ``report()`` as
    ``backend=backend``); ``options`` may repeat its settings but not contradict them. A graph that reads nothing a
    backend prepared (e.g. the rest of a forward after a graph break) goes to the backend this thread last compiled
    a prepared model's graph with, as ``backend=backend`` would send it; before any, to a new ``Backend(**options)``
    (which refuses a model that was never prepared)."""
    options = dict(options or {})
    preparer = next((b for t in _prepared_tensors(gm, example_inputs) if (b := prepared_by(t)) is not None), None)
    if preparer is None:
        last = getattr(_LAST_PREPARER, "ref", None)
        preparer = None if last is None else last()
    if preparer is None:
        return Backend(**options)(gm, example_inputs)
    _LAST_PREPARER.ref = weakref.ref(preparer)
    wanted = _option_values(Backend(**options))  # validates the options
    have = _option_values(preparer)
    differing = [name for name in options if wanted[name] != have[name] and not (
        name in ("group", "mesh") and wanted[name] is None)]
    if differing:
        raise FxShardError(
            f'torch.compile(backend="fxshard", options=...) compiles with the backend that prepared the model, '
            f"{_describe(preparer)}, but the options contradict it: "
            + ", ".join(f"{name}={wanted[name]!r} (prepared with {have[name]!r})" for name in differing)
            + "; drop these options or prepare with them"
        )
    return preparer(gm, example_inputs)
