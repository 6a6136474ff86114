"""``Backend``: the object a user prepares a model with and hands to ``torch.compile``."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import weakref
from collections.abc import Sequence

import torch
from torch import fx, nn
from torch.utils.weak import WeakIdKeyDictionary

from fxshard import budget
from fxshard import passes as P
from fxshard.budget import budget_pass
from fxshard.budget.optimizer_terms import optimizer_bytes
from fxshard.errors import FxShardError
from fxshard.passes import PassContext
from fxshard.passes.context import DDP_BUCKET_BYTES, default_bucket
from fxshard.report.chrome_trace import write_chrome_trace
from fxshard.report.tables import collective_report, compile_time_report, ledger_report
from fxshard.report.trace import trace_choice
from fxshard.runtime.groups import (
    COLLECTIVE_TIMEOUT_S,
    explaining_peer_failures,
    scatters_by_all_to_all,
    secondary_group,
)
from fxshard.runtime.optim import (
    annotate_optimizer_graph,
    clip_grad_norm_,
    full_state_dict,
    load_full_state_dict,
    mark_published,
    shard_optimizer_over,
)
from fxshard.runtime.optimizer_record import updating_optimizer
from fxshard.runtime.param import prepared_param, spec_of
from fxshard.runtime.prepare import grad_sync_of, shard_parameters, sharded_world_size, tensor_parallel_of
from fxshard.runtime.step_clock import FORWARD, StepClock
from fxshard.simulate import autotune
from fxshard.passes.cost_model import Machine
from fxshard.simulate.simulator import machine_of, simulate
from fxshard.torch_compat import (
    aot_module_simplified,
    boxed_freeing_inputs,
    min_cut_rematerialization_partition,
    raised_inside_torch,
)

from .blocks import block_prefixes, describe_grouping, repeated_blocks
from .consistency import check_same_schedule, prepare_check_group
from .inductor import InductorCompiler
from .options import (
    COMPILERS,
    DEFAULT_COMPILER,
    STAGES,
    check_mesh,
    check_stage_knobs,
    checked_knobs,
    mesh_groups,
    secondary_size,
)
from .pipeline import GraphRecord, Pass, run_passes

# the phases of fxshard's own compile time the backend adds to each GraphRecord's (besides each pass and its history)
AUTOTUNE = "autotune trials"
CONSISTENCY = "consistency check"


@contextlib.contextmanager
def _torch_recursion_explained():
    """A RecursionError out of AOT autograd's trace names torch's part and the known workaround: torch 2.13 runs out
    of recursion tracing a tensor-parallel (DTensor) model recompiled for a new input size with dynamic shapes, as
    plain ``torch.compile(backend="aot_eager")`` does (docs/known-issues.md)."""
    try:
        yield
    except RecursionError as error:
        if not raised_inside_torch(error):  # ran out inside fxshard's own code: a bug of ours, shown as it is
            raise
        raise FxShardError(
            "torch's AOT autograd ran out of Python recursion tracing this graph's forward and backward (inside "
            "torch, before any fxshard pass). Known case: a tensor-parallel model (DTensor parameters) compiled "
            "again for a new input size with dynamic shapes, which plain torch.compile(backend=\"aot_eager\") hits "
            "too. Compile with torch.compile(model, backend=backend, dynamic=False): a graph per input size "
            "(docs/known-issues.md#torch-213-a-tensor-parallel-model-recompiled-for-a-new-size-exceeds-the-recursion-limit)"
        ) from error


# Every tensor a backend's prepare laid out (trainable leaves, the optimizer's shards) -> that backend, weakly;
# the prepared model keeps its backend alive (an attribute), so the entry lives as long as the model does.
PREPARED_BY: WeakIdKeyDictionary = WeakIdKeyDictionary()
_BACKEND = "_fxshard_backend"  # model attribute: a _KeepAlive of the Backend that prepared it
# The backend the registered backend last sent a graph of a prepared model to (weakly): it also compiles a graph
# that reads no prepared tensor, such as the rest of a forward after a graph break, as backend=backend would.
class _KeepAlive:
    """Holds a prepared model's Backend for as long as the model lives. A copy of the model shares it rather than
    copying the backend (its graphs, optimizer and process group): the copy's parameters are new tensors that no
    backend prepared, so it cannot be compiled anyway."""

    def __init__(self, backend):
        self.backend = backend

    def __deepcopy__(self, memo):
        return self


def default_passes() -> list[Pass]:
    """The pipeline every backend runs unless given ``passes=``; copy it, add or drop passes. It is the same for
    every stage: each pass acts on what the markers' arguments say (the layout ``prepare`` chose), not on the stage.

    ``shard_optimizer_pass`` acts only on a compiled ``optimizer.step`` (stages 1, 2: gather what it updated);
    ``bucket_pass`` names each marker's collective (the ``bucket``/``blocks`` knobs) right before the lowering;
    ``prefetch_pass`` reorders the lowered graph (``prefetch``, ``max_inflight_gathers``) or runs ``schedule``;
    ``budget_pass`` records each graph's memory ledger and enforces ``memory_budget``; ``twin_groups_pass`` moves
    DTensor's tensor-parallel collectives onto fxshard's one-worker gloo twin of their group.
    """
    return [P.shard_optimizer_pass, P.recompute_gathers_pass, P.merge_tied_grads_pass, P.bucket_pass,
            P.lower_collectives_pass, P.prefetch_pass, budget_pass, P.twin_groups_pass]


class Backend:
    """A Dynamo backend that compiles a prepared model's step with ZeRO collectives inserted by FX passes.

    Use one backend per model: ``prepare`` shards the model over ``group`` (default: the world group), and every
    graph Dynamo hands it is run through AOT autograd and the pass pipeline. ``graphs`` keeps each rewritten graph
    with its pass-by-pass history; ``report()`` summarises the collectives.

    Options: ``group`` (default: the world group) or ``mesh`` (a DeviceMesh: 1-D, the same as its group; 2-D with
    dimensions named ``"replicate"`` and ``"shard"``, hybrid sharding: stages 1-3 shard over the "shard" groups and
    average each shard's gradient over the "replicate" groups, stage 0 all-reduces over every rank of the mesh),
    ``passes`` (default: ``default_passes()``), ``compiler``
    (``"inductor"``, the default, compiles the rewritten graphs, as ``torch.compile``'s default backend would;
    ``"eager"`` runs them op by op, as printed), ``machine`` (a ``fxshard.simulate.Machine``, e.g. from
    ``fxshard.simulate.calibrate(group)``: what ``fxshard.simulate.autotune`` predicts on where the knobs leave a choice;
    default ``fxshard.simulate.default_machine`` of the model's device), and the knobs every pass
    reads, documented on ``fxshard.passes.PassContext``: ``reshard_after_forward``, ``bucket``, ``blocks``,
    ``prefetch``, ``max_inflight_gathers``, ``schedule``, ``memory_budget``, ``param_dtype``, ``reduce_dtype``,
    ``step_bucket_bytes``, ``collective_timeout_s``. An
    unknown option or a value of the wrong kind raises FxShardError.
    """

    def __init__(
        self,
        stage: int = 3,
        *,
        group=None,
        mesh=None,
        passes: Sequence[Pass] | None = None,
        compiler: str = DEFAULT_COMPILER,
        regional: bool = True,
        machine: Machine | None = None,
        **knobs,
    ):
        if isinstance(stage, bool) or stage not in STAGES:
            raise FxShardError(f"stage must be one of 0, 1, 2, 3 (ZeRO stage), got {stage!r}")
        if compiler not in COMPILERS:
            raise FxShardError(f"compiler must be one of {COMPILERS}, got {compiler!r}")
        if not isinstance(regional, bool):
            raise FxShardError(f"regional must be True (compile each repeated segment once) or False (compile each "
                               f"graph whole), got {regional!r}")
        if mesh is not None:
            check_mesh(mesh, group)
        if machine is not None and not isinstance(machine, Machine):
            raise FxShardError(f"machine must be a fxshard.simulate.Machine (e.g. fxshard.simulate.calibrate(group)) "
                               f"or None, got {type(machine).__name__}")
        self.stage = stage
        self.machine = machine
        self.group, self.mesh = group, mesh
        self.knobs = {"bucket": default_bucket(stage), **checked_knobs(knobs)}
        check_stage_knobs(self.knobs, stage)
        self.passes = list(default_passes() if passes is None else passes)
        self.compiler = compiler
        self.regional = regional
        self.model: nn.Module | None = None  # what prepare laid out, for the report and the budget
        self.optimizer: torch.optim.Optimizer | None = None
        self.graphs: list[GraphRecord] = []
        self._chosen_weights: dict[int, str | None] = {}  # graph id -> its forward's quantize_weights
        self._graph_ids = itertools.count()
        self._check_group_name = ""  # the group the consistency check compares over, set by prepare
        self._secondary: tuple[str, int] = ("", 0)  # reshard_after_forward=k: (group, this rank's place), by prepare

    # -- preparing ----------------------------------------------------------------------------------------------
    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                param_init_fn=None, device=None):
        """Shard ``model``'s parameters over the group in place; returns ``(model, optimizer)``, the
        optimizer regrouped in place over what this rank updates (a scheduler built on it before keeps working).

        A model built under ``torch.device("meta")`` (with its optimizer built over the meta parameters) is never
        whole: each module's parameters are materialised on the CPU in turn, initialised by ``param_init_fn(module)``
        or the module's ``reset_parameters()``, cut to this rank's shard and moved to ``device`` (default: the CPU,
        or the current CUDA device on NCCL). See docs/large-models.md for the initialisation contract."""
        if not isinstance(model, nn.Module):
            raise FxShardError(f"prepare takes an nn.Module, got {type(model).__name__}")
        if param_init_fn is not None and not callable(param_init_fn):
            raise FxShardError(f"param_init_fn must be a function fn(module) -> None, got {param_init_fn!r}")
        groups = (self.group, None, None) if self.mesh is None else mesh_groups(self.mesh, self.stage)
        timeout_s = self.knobs.get("collective_timeout_s", COLLECTIVE_TIMEOUT_S)
        self._make_secondary_group(groups[0], timeout_s)  # refuses a k that cannot apply before anything changes
        leaves, grad_sync = shard_parameters(model, self.stage, groups[0], self.knobs.get("param_dtype"),
                                             self.knobs.get("reduce_dtype"),
                                             timeout_s, *groups[1:], self.mesh,
                                             param_init_fn=param_init_fn, device=device,
                                             init_units=tuple(b for b in repeated_blocks(model) if b))
        self.model = model
        step_bucket_bytes = self.knobs.get("step_bucket_bytes", DDP_BUCKET_BYTES)
        self.optimizer = (None if optimizer is None
                          else shard_optimizer_over(optimizer, leaves, grad_sync, step_bucket_bytes))
        updated = [] if self.optimizer is None else updating_optimizer(self.optimizer).param_groups
        flats = (prepared_param(leaf).flat for leaf in leaves.values())  # what the compiled graphs read
        laid_out = [*leaves.values(), *(f for f in flats if f is not None), *(t for g in updated for t in g["params"])]
        for tensor in laid_out:
            PREPARED_BY[tensor] = weakref.ref(self)
        model.__dict__[_BACKEND] = _KeepAlive(self)
        # the consistency check compares over the ranks of this group (on a hybrid mesh over all of it: ranks of
        # different shard groups meet in the replicas' all-reduce)
        spec = next((spec_of(t) for t in laid_out if spec_of(t) is not None), None)
        self._check_group_name = "" if spec is None else spec.all_ranks_group_name
        prepare_check_group(self._check_group_name, self.knobs.get("collective_timeout_s", COLLECTIVE_TIMEOUT_S))
        return model, self.optimizer

    def _make_secondary_group(self, shard_group, timeout_s: float) -> None:
        """``reshard_after_forward=k``: the group of k ranks backward re-gathers over (``secondary_size``)."""
        reshard = self.knobs.get("reshard_after_forward", True)
        if isinstance(reshard, bool) or not torch.distributed.is_initialized():  # shard_parameters says what is wrong
            return
        shard_group = shard_group or torch.distributed.group.WORLD
        k = secondary_size(reshard, self.stage, torch.distributed.get_world_size(shard_group))
        if k is not None:
            self._secondary = secondary_group(shard_group, k, timeout_s)
        else:  # the whole shard group is True, a group of one keeps the whole weight
            self.knobs["reshard_after_forward"] = reshard != 1

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the prepared optimizer's gradients by the norm of the whole model's averaged gradient, as
        ``torch.nn.utils.clip_grad_norm_`` does on one process; returns that norm. Every rank must call it, between
        backward and ``optimizer.step()``. (torch's own function would see only this rank's shards in stages 1-3,
        or gradients not yet averaged in stage 1 and under ``no_sync``.)"""
        return clip_grad_norm_(self._prepared_optimizer("clip_grad_norm_"), max_norm, norm_type)

    def full_optimizer_state_dict(self) -> dict:
        """The prepared optimizer's state in full shapes, keyed by parameter name, as one process would hold it
        (a collective: every rank must call it). Save it to resume at another world size or stage."""
        return full_state_dict(self._prepared_optimizer("full_optimizer_state_dict"))

    def load_full_optimizer_state_dict(self, state_dict: dict) -> None:
        """Load a ``full_optimizer_state_dict()`` saved at any world size and stage into the prepared optimizer."""
        load_full_state_dict(self._prepared_optimizer("load_full_optimizer_state_dict"), state_dict)

    def _prepared_optimizer(self, purpose: str) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise FxShardError(f"{purpose} needs the optimizer: call backend.prepare(model, optimizer) first")
        return self.optimizer

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module):
        """Gradient accumulation: run the micro-batches of one optimizer step inside this context.

        Stage 0 keeps gradients local inside it (backward compiles a second graph without the all-reduce) and
        ``optimizer.step()`` all-reduces the accumulated gradients once. Stage 1 always communicates once per step,
        at ``optimizer.step()``; stages 2 and 3 reduce-scatter every micro-batch into the accumulating gradient
        shard (their gradients are never kept full), so for them this context changes nothing.
        """
        grad_sync = grad_sync_of(model)
        if self.stage != 0:
            yield
            return
        grad_sync.enabled = False
        try:
            yield
        finally:
            grad_sync.enabled = True
            grad_sync.local_grads_pending = True

    def __repr__(self) -> str:  # what torch's errors name the backend by
        return f"fxshard.backend(stage={self.stage}, compiler={self.compiler!r})"

    # -- compiling ----------------------------------------------------------------------------------------------
    def __call__(self, gm: fx.GraphModule, example_inputs, **_):
        specs = self._check_inputs(gm, example_inputs)
        if not specs and self.model is not None:  # an optimizer step reads its shards as attributes, not inputs
            specs = [spec_of(p) for p in self.model.parameters()]
        first = next(iter(specs), None)
        context = PassContext(
            stage=self.stage,
            graph="joint",
            world_size=first.world_size if first else 1,
            group_name=first.group_name if first else "",
            optimizer_bytes=0 if self.optimizer is None else optimizer_bytes(self.optimizer),
            reduce_scatter_by_all_to_all=first is not None and scatters_by_all_to_all(first.group_name),
            group_twins=self._group_twins(),
            secondary_group_name=self._secondary[0],
            secondary_rank=self._secondary[1],
            machine=machine_of(self),
            **self.knobs,
        )
        context = dataclasses.replace(context, blocks=self._block_names())
        graph_id = next(self._graph_ids)
        published = annotate_optimizer_graph(gm, example_inputs)
        if gm.meta["fxshard_optimizer"]:  # a compiled optimizer.step: rewritten before AOT sees it
            gm, _ = self._run(context, graph_id, "optimizer", gm)
        inductor = InductorCompiler(gm, example_inputs, self.regional) if self.compiler == "inductor" else None
        compile_graph = functools.partial(self._compile_graph, context, graph_id, inductor)
        with inductor.around_aot() if inductor else contextlib.nullcontext(), _torch_recursion_explained():
            compiled = aot_module_simplified(
                gm,
                example_inputs,
                fw_compiler=functools.partial(compile_graph, "forward"),
                bw_compiler=functools.partial(compile_graph, "backward"),
                inference_compiler=functools.partial(compile_graph, "inference"),
                partition_fn=functools.partial(self._partition, context, graph_id, inductor),
                # Inductor lowers the decomposed ATen op set; without its table AOT keeps ops that Inductor both
                # decomposes and has a fallback for, and Inductor rejects the graph (aten.t.default).
                **({"decompositions": inductor.decompositions} if inductor else {}),
            )
        if not published:
            return compiled

        @functools.wraps(compiled)
        def step_that_publishes(*args):
            outputs = compiled(*args)
            mark_published(published)
            return outputs

        return step_that_publishes

    def _group_twins(self) -> tuple[tuple[str, str], ...]:
        """(DTensor's group, the twin its collectives run on) of the model's tensor-parallel dimension, where
        they differ (gloo)."""
        layouts = [] if self.model is None else tensor_parallel_of(self.model)
        return tuple(sorted({(tp.dtensor_group_name, tp.group_name) for tp in layouts
                             if tp.dtensor_group_name != tp.group_name}))

    def _block_names(self) -> tuple[str, ...]:
        """The ``blocks`` the passes see: module names (passes never see modules), found in the model for
        ``bucket="auto"``, resolved from the user's names and classes for ``bucket="block"``."""
        if self.knobs["bucket"] == "auto":
            return repeated_blocks(self.model) if self.model is not None else ()
        return block_prefixes(self.model, self.knobs["blocks"]) if self.knobs.get("blocks") else ()

    def _check_inputs(self, gm: fx.GraphModule, example_inputs) -> list:
        specs = []
        for placeholder, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
            if not isinstance(value, nn.Parameter):
                continue
            spec = spec_of(value)
            if spec is None:
                grapharg = placeholder.meta.get("grapharg")
                where = grapharg.source.name if grapharg is not None else placeholder.name
                raise FxShardError(
                    f"the compiled code reads a parameter that fxshard did not shard ({where}, shape "
                    f"{list(value.shape)}): "
                    "call `model, opt = backend.prepare(model, opt)` before torch.compile, and do not add or "
                    "replace parameters after prepare"
                )
            specs.append(spec)
        # One backend prepares and compiles: its stage, group and knobs are the ones the shards were laid out for,
        # and its graphs and report() are the model's. (A compiled optimizer step reads its shards as attributes.)
        for tensor in _prepared_tensors(gm, example_inputs):
            preparer = prepared_by(tensor)
            if preparer is not self:
                raise FxShardError(
                    f"{spec_of(tensor).name} was prepared by {_describe(preparer)} but is compiled with "
                    f"{_describe(self)}; compile with the backend that prepared the model "
                    '(torch.compile(model, backend=backend), or backend="fxshard", which finds it): another backend '
                    "would compile it with its own settings and leave the preparing backend's graphs and report() empty"
                )
        return specs

    def _run(self, context: PassContext, graph_id: int, kind: str, gm: fx.GraphModule,
             tune: bool = False) -> tuple[fx.GraphModule, GraphRecord]:
        """The pass pipeline over ``gm``, with ``tune`` under the knobs ``fxshard.simulate.autotune`` chooses on
        ``context.machine`` where the user left a choice (a lowered graph's grouping, prefetch under
        ``memory_budget``); and the graph's record."""
        context = dataclasses.replace(context, graph=kind)
        if kind == "backward" and context.quantize_weights == "auto":  # the weights forward computed with
            context = dataclasses.replace(context, quantize_weights=self._chosen_weights.get(graph_id))
        record = GraphRecord(kind, graph_id)
        choice = None
        if tune:
            with record.timing(AUTOTUNE):
                context, choice = autotune.choose(gm, context, self.passes)
        if kind in ("forward", "inference"):
            self._chosen_weights[graph_id] = context.quantize_weights
        self.graphs.append(record)
        gm = run_passes(gm, context, self.passes, record, result=autotune.chosen_graph(choice, context))
        if choice is not None:
            gm.meta["fxshard_choice"] = choice
            trace_choice(kind, graph_id, choice)
        return gm, record

    def _partition(self, context, graph_id, inductor: InductorCompiler | None, joint: fx.GraphModule, joint_inputs,
                   **kwargs):
        joint, _ = self._run(context, graph_id, "joint", joint)
        partition = inductor.partition if inductor else min_cut_rematerialization_partition
        return partition(joint, joint_inputs, **kwargs)

    def _compile_graph(self, context, graph_id, inductor: InductorCompiler | None, kind, gm: fx.GraphModule, example_inputs):
        gm, record = self._run(context, graph_id, kind, gm, tune=True)
        if inductor:
            with record.timing_compiler():
                compiled, record.compiled_as = inductor.compile(kind, gm, example_inputs)
        else:
            compiled = boxed_freeing_inputs(gm)
        # Before the graph first runs, every rank must have compiled the same collectives (fxshard.compiler.consistency).
        with record.timing(CONSISTENCY):
            check_same_schedule(gm, kind, graph_id, self._check_group_name or context.group_name)
        compiled = explaining_peer_failures(compiled, f"the {kind} graph")
        if kind != "forward" or self.model is None:  # (an inference graph runs without gradients: no step to miss)
            return compiled
        return _checking_steps_first(compiled, grad_sync_of(self.model).clock)

    # -- reporting ----------------------------------------------------------------------------------------------
    def report(self, format: str = "text", measured=None) -> str:
        """The step's ledger (``fxshard.budget``) as a table per rewritten step: closed form, bytes at this run,
        the measured bytes where ``measured`` (a ``fxshard.report.measure.CollectiveCounter`` around one step, or
        around several with ``mark_step()`` after each: the last one counts) gives them,
        and the collective schedule; ``format="json"`` for tools. Before a forward and backward ran, or without an
        optimizer, only the collectives of the graphs compiled so far."""
        grouping = describe_grouping(self.knobs["bucket"], self._block_names())
        if self.model is None or self.optimizer is None or not any(r.kind == "backward" for r in self.graphs):
            text = f"{grouping}\n{collective_report(self.graphs)}"
        else:
            text = ledger_report(budget.ledger(self), format=format, measured=measured,
                                 title=f"fxshard stage {self.stage}, {grouping}")
            if format == "json":
                return text
        parts = [text, autotune.describe_choices(self.graphs), compile_time_report(self.graphs)]
        return "\n\n".join(part for part in parts if part)

    def trace(self, path, world: int | None = None, machine=None):
        """Write the simulated step (``fxshard.simulate``) of the graphs compiled so far as a Chrome trace-event
        JSON to ``path``, to open in Perfetto: a compute and a communication lane, an event per node, each with its
        unit (``fxshard.report.chrome_trace``). ``world``: the ranks to predict for (default: those the parameters are
        sharded over; on a hybrid mesh its shard dimension);
        ``machine``: a ``fxshard.simulate.Machine`` (e.g. from ``calibrate``; default: this backend's ``machine``,
        else its device's default, the one its schedules were chosen on). Returns the ``Timeline``."""
        import torch.distributed as dist

        sharded_over = sharded_world_size(self.model) if self.model is not None else None
        timeline = simulate(self, world or sharded_over or dist.get_world_size(self.group), machine=machine)
        write_chrome_trace(timeline, path)
        return timeline


def _checking_steps_first(compiled, clock: StepClock):
    """``compiled``, a training forward, after checking that every rank has taken as many optimizer steps as this
    one (``fxshard.runtime.step_clock``)."""

    @functools.wraps(compiled)
    def run(*args):
        clock.check(FORWARD)
        return compiled(*args)

    return run


def backend_of(model: nn.Module) -> Backend:
    """The Backend that prepared ``model`` (the module ``prepare`` returned, or its ``torch.compile`` wrapper)."""
    kept = getattr(model, "_orig_mod", model).__dict__.get(_BACKEND)
    if kept is None:
        raise FxShardError(f"this {type(model).__name__} was not prepared by fxshard; call "
                           "backend.prepare(model, optimizer) first")
    return kept.backend


def _prepared_tensors(gm: fx.GraphModule, example_inputs) -> list[torch.Tensor]:
    """The tensors a Dynamo graph reads that a backend's prepare laid out: parameter inputs, and the shards a compiled
    optimizer step reads as attributes of the graph."""
    candidates = [*(v for v in example_inputs if isinstance(v, nn.Parameter)), *gm.parameters()]
    return [t for t in candidates if spec_of(t) is not None]


def prepared_by(tensor: torch.Tensor) -> Backend | None:
    """The Backend whose ``prepare`` laid ``tensor`` out, if it is one of its leaves or optimizer shards."""
    ref = PREPARED_BY.get(tensor)
    return None if ref is None else ref()


def _describe(backend: Backend | None) -> str:
    if backend is None:
        return "another fxshard backend"
    defaults = {f.name: f.default for f in dataclasses.fields(PassContext)}
    changed = [f"{k}={v!r}" for k, v in backend.knobs.items() if k != "bucket" and v != defaults.get(k)]
    options = ", ".join([f"stage={backend.stage}", *([f"compiler={backend.compiler!r}"]
                                                     if backend.compiler != DEFAULT_COMPILER else []), *changed])
    return f"fxshard.backend({options}) at {id(backend):#x}"
