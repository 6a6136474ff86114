"""The optimizer ``prepare`` returns: the user's own object, its groups now over what this rank updates.

| stage | the optimizer updates | its step also |
|---|---|---|
| 0 | full parameters | all-reduces gradients that ``no_sync`` kept local (before the update) |
| 1 | flat master shards of the full parameters (its groups hold the parameters; see ``FlatShardUpdate``) | reduce-scatters the full gradients into the masters (before), all-gathers the updated masters into the parameters (after) |
| 2 | the flat shards under the leaves (its groups hold the leaves, DTensors of the parameters' shapes) | all-gathers the updated flat shards into the resident full copies (after) |
| 3 | the flat shards under the leaves, as at stage 2 | nothing: gradients arrive reduced, forward gathers |

Only elementwise optimizers run on flat shards exactly; the others are refused. A step of any other optimizer over
parameters whose communication lives in these steps raises FxShardError instead of training silently wrong.
"""

from __future__ import annotations

import functools
import inspect
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from fxshard.errors import FxShardError
from fxshard.torch_compat import (
    ConstantSource,
    after_grad_scaler_inf_check,
    name_parameter_source,
    tensor_version,
    total_norm_from,
    view_base,
)
from fxshard.torch_compat import c10d_functional as _c10d

from . import optimizer_state_dict
from .groups import peer_failures_explained
from .layout import flat_shard, full_from_value, gather_full, global_of
from .ops import cast_to, flat_padded, reduce_scatter_mean
from .param import GradSync, prepared_leaves, prepared_param, replaced_by, spec_of
from .optimizer_record import (
    OptimizerRecord,
    optimizer_record,
    replace_updated_state,
    steps_inside_another,
    updating_optimizer,
)
from .sharding import ShardSpec, pack_greedily, shard_of, unit_of, unpad
from .step_clock import INF_CHECK, NORM

# Optimizers whose update is elementwise, so running them on flat shards equals running them on full tensors.
ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.RMSprop,
    torch.optim.NAdam,
    torch.optim.RAdam,
)


def _check_optimizer(optimizer: torch.optim.Optimizer, leaves: dict[int, nn.Parameter]) -> None:
    if type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
        supported = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
        raise FxShardError(
            f"{type(optimizer).__name__} is not supported: fxshard runs the optimizer on flat parameter shards, "
            f"which is exact only for elementwise optimizers ({supported}); use one of those"
        )
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in leaves]
        if missing:
            raise FxShardError(
                f"the optimizer holds {len(missing)} tensor(s) that are not parameters of the prepared model "
                f"(shapes {[list(p.shape) for p in missing][:3]}); build the optimizer over model.parameters()"
            )


def _same_kind(optimizer: torch.optim.Optimizer, params_of: dict[int, torch.Tensor]) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class and hyperparameters, without state, whose groups hold
    ``params_of[id(p)]`` for each of its parameters ``p``."""
    groups = [{**group, "params": [params_of[id(p)] for p in group["params"]]} for group in optimizer.param_groups]
    # Every group carries all its hyperparameters; defaults go to the constructor as far as it names them.
    accepted = inspect.signature(type(optimizer)).parameters
    return type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})


def _regroup_in_place(optimizer: torch.optim.Optimizer, params_of: dict[int, torch.Tensor], state: dict) -> None:
    """``optimizer`` now holds ``params_of[id(p)]`` for each of its parameters ``p``, and ``state``. Its group dicts
    and its state dict stay the same objects: an LR scheduler, a GradScaler or a hook built on the optimizer before
    prepare reads and writes them, and keeps working."""
    for group in optimizer.param_groups:
        group["params"] = [params_of[id(p)] for p in group["params"]]
    optimizer.state.clear()
    optimizer.state.update(state)


def shard_optimizer_over(
    optimizer: torch.optim.Optimizer, leaves: dict[int, nn.Parameter], grad_sync: GradSync, bucket_bytes: int
) -> torch.optim.Optimizer:
    """``optimizer`` itself, now over what this rank updates (shard leaves; full parameters for stage 0; for stage 1
    the model's full parameters, stepping an inner optimizer over their master shards: :class:`FlatShardUpdate`), its
    existing state laid out the same way, with the stage's ``ShardedStep`` (collectives packed in buckets of up to
    ``bucket_bytes``) hooked around the update."""
    _check_optimizer(optimizer, leaves)
    stage = max((spec_of(leaf).stage for leaf in leaves.values()), default=3)  # (a 0-d one's may be lower)
    updated = {key: prepared_param(leaf).updated for key, leaf in leaves.items()}
    state = {}
    for param, param_state in optimizer.state.items():
        target = updated[id(param)]
        spec = spec_of(target)
        state[target] = {key: _held_state_laid_out(value, spec) for key, value in param_state.items()}
    if stage >= 1:
        updating = _same_kind(optimizer, updated)
        updating.state.update(state)
        _regroup_in_place(optimizer, leaves, {})
    else:
        updating = optimizer
        _regroup_in_place(optimizer, updated, state)
    step = ShardedStep(stage, list(leaves.values()), grad_sync, bucket_bytes)
    grad_sync.settle_with(step.average_full_gradients if stage == 1 else step.settle_gradients)
    record = OptimizerRecord(optimizer, updating, step)
    record.attach()
    updating.register_step_pre_hook(step.settle_gradients)
    updating.register_step_post_hook(step.publish_parameters)
    optimizer.add_param_group = functools.partial(_refuse_new_param_group, stage)  # its own, over the class's
    # state_dict(): shards as DTensors of the parameters' full shapes; load_state_dict(): back to this rank's shards
    optimizer.register_state_dict_pre_hook(optimizer_state_dict.optimizer_state_dict_pre_hook)
    optimizer.register_state_dict_post_hook(optimizer_state_dict.optimizer_state_dict_post_hook)
    optimizer.register_load_state_dict_pre_hook(optimizer_state_dict.optimizer_load_state_dict_pre_hook)
    if stage >= 1:
        record.flat_shard_update = FlatShardUpdate(optimizer, updating)
    return optimizer


def _held_state_laid_out(value, spec: ShardSpec):
    """A state the optimizer held before prepare, laid out like what this rank now updates: a per-element one (of
    the parameter's shape) becomes its flat shard (stages 1-3), or under tensor parallelism this tp rank's piece."""
    if not torch.is_tensor(value) or tuple(value.shape) != spec.global_shape:
        return value
    full = full_from_value(value, spec, spec.name)
    return shard_of(full, spec) if spec.stage >= 1 else full


def _refuse_new_param_group(stage: int, param_group: dict) -> None:
    """``add_param_group`` on an optimizer prepare returned: its parameters would train on each rank alone (no
    gradient reduction, no shard, and at stage 1 no master shard), diverging silently between ranks."""
    raise FxShardError(
        f"add_param_group on the optimizer backend.prepare returned (stage {stage}): prepare laid out the "
        "parameters it was given, and the new group's would train on each rank alone, diverging between ranks. "
        "Give the optimizer every parameter group before prepare: build it over model.parameters() (or its groups), "
        "then call backend.prepare(model, optimizer)"
    )


class FlatShardUpdate:
    """The optimizer of stages 1-3: its groups hold what the model holds (stage 1: the full parameters; stages 2, 3:
    the leaves, DTensors of the parameters' shapes), as torch's optimizers, LR schedulers, weight-decay rules and
    checkpoint functions expect (``get_state_dict`` names each state through ``model.named_parameters()``), while
    the update runs on plain flat shards (stage 1: the fp32 masters; stages 2, 3: the flat shards under the
    leaves), one elementwise kernel per group as on one process, not a DTensor dispatch per tensor.

    The returned optimizer (``outer``) holds the model's tensors; an ``inner`` optimizer of the same class holds the
    flat shards, with the ``ShardedStep`` around its update (stage 1: reduce-scatter the gradients into the masters;
    stages 1, 2: gather the update into what forward reads). ``outer.step()`` runs ``inner.step()`` as its step
    pre-hook, with the outer groups' hyperparameters (a scheduler sets those), after handing each leaf's gradient
    to its flat shard (stages 2, 3: the rows, padded; a view where they are the flat gradient already); the outer
    update then finds no gradient it may use and changes nothing. Each parameter's state (``exp_avg``: a flat shard)
    is one dict in both ``outer.state`` and ``inner.state``. A state dict loaded into ``outer`` is laid out by the
    checkpoint's pre-hook in the flat shards' dtype and kept so (torch's load would cast it to the parameters'
    dtype)."""

    def __init__(self, outer: torch.optim.Optimizer, inner: torch.optim.Optimizer):
        self.outer, self.inner = outer, inner
        self.pairs = [(p, flat) for og, ig in zip(outer.param_groups, inner.param_groups)
                      for p, flat in zip(og["params"], ig["params"])]  # (what the model holds, its flat shard)
        self._loading: dict = {}
        self._held_aside: list[tuple[torch.Tensor, torch.Tensor]] = []  # (leaf, its gradient) during the outer update
        outer.register_step_pre_hook(self.step_shards)
        outer.register_step_post_hook(self.give_back_gradients)
        outer.register_load_state_dict_pre_hook(self._keep_laid_out)  # after the checkpoint's: it lays out
        outer.register_load_state_dict_post_hook(self._load_into_shards)
        self.share_state()

    def step_shards(self, optimizer=None, args=(), kwargs=None) -> None:
        if args[1:] or (kwargs or {}).get("closure") is not None:  # args: (optimizer, closure?)
            raise FxShardError("a prepared optimizer.step() takes no closure (its update runs on the flat shards, "
                               "with the stage's communication around it); run forward and backward, then call "
                               "opt.step()")
        self.copy_hyperparameters()
        self.hand_gradients_to_shards()
        self.inner.step()
        self.after_update()

    @torch.compiler.disable
    def hand_gradients_to_shards(self) -> None:
        """Stages 2, 3: each leaf's gradient (its rows) becomes its flat shard's; the leaf's is held aside while the
        outer update runs (it must find none to apply again) and given back after it (``give_back_gradients``), so
        a script reads and zeroes it as under DDP."""
        for leaf, flat in self.pairs:
            if leaf.grad is not None and prepared_param(flat).flat is flat:  # stages 2, 3 (stage 1: the masters)
                flat.grad = flat_gradient(leaf.grad, spec_of(flat))
                self._held_aside.append((leaf, leaf.grad))
                leaf.grad = None

    @torch.compiler.disable
    def give_back_gradients(self, optimizer=None, args=None, kwargs=None) -> None:
        for leaf, grad in self._held_aside:
            leaf.grad = grad
        self._held_aside = []

    @torch.compiler.disable  # bookkeeping between Python objects, outside any compiled step graph
    def copy_hyperparameters(self) -> None:
        for outer_group, inner_group in zip(self.outer.param_groups, self.inner.param_groups):
            for key, value in outer_group.items():
                if key != "params" and inner_group.get(key) is not value:
                    inner_group[key] = value

    @torch.compiler.disable
    def after_update(self) -> None:
        # a flat shard's gradient lives from the reduce-scatter or hand-over to the update: the next step must not
        # see it again. A tensor updated as the model holds it (a 0-d parameter of stages 2, 3) keeps its gradient
        # for the script, held aside from the outer update like the leaves'.
        for leaf, flat in self.pairs:
            if flat is leaf and leaf.grad is not None:
                self._held_aside.append((leaf, leaf.grad))
            flat.grad = None
        self.share_state()

    def share_state(self) -> None:
        """``outer.state`` holds the inner optimizer's state dicts, each under the parameter of its flat shard."""
        for param, flat in self.pairs:
            state = self.inner.state.get(flat)
            if state:
                self.outer.state[param] = state
            else:
                self.outer.state.pop(param, None)

    def replace_state(self, state_of_flat: dict) -> None:
        self.inner.state.clear()
        self.inner.state.update(state_of_flat)
        self.share_state()
        self.copy_hyperparameters()

    def _keep_laid_out(self, optimizer, state_dict: dict) -> None:
        saved_keys = [key for group in state_dict["param_groups"] for key in group["params"]]
        self._loading = {flat: state_dict["state"][key] for key, (_, flat) in zip(saved_keys, self.pairs)
                         if key in state_dict["state"]}

    def _load_into_shards(self, optimizer) -> None:
        loading, self._loading = self._loading, {}
        self.replace_state(loading)


class ShardedStep:
    """What a stage does around the optimizer's update, so that the update itself is shard-local.

    ``settle_gradients`` (before the update) leaves every updated tensor with its averaged gradient: stage 0
    all-reduces gradients that ``no_sync`` kept local; stage 1 reduce-scatters the full gradients into the master
    shards (freeing the full ones, as ZeRO-1 promises). ``publish_parameters`` (after it) makes forward see the
    update: stage 1 all-gathers the masters into the parameters, stage 2 the shards into the resident copies, each
    cast to the compute dtype before the gather. Every one of these runs one collective per bucket
    (:meth:`buckets`), not per parameter: nothing overlaps them, and each collective has a fixed latency.
    """

    def __init__(self, stage: int, leaves: list[nn.Parameter], grad_sync: GradSync, bucket_bytes: int):
        self.stage, self.leaves, self.grad_sync, self.bucket_bytes = stage, leaves, grad_sync, bucket_bytes

    def shards(self) -> list[torch.Tensor]:
        """What the step publishes, in parameter order: every trainable stage-1 master or stage-2 leaf (each has a
        full copy that forward reads)."""
        records = [prepared_param(leaf) for leaf in self.leaves if leaf.requires_grad]
        return [record.updated for record in records if record.full_copy is not None]

    def collective_dtype(self, kind: str, shard: torch.Tensor) -> torch.dtype:
        """The dtype a step collective moves ``shard`` in: its full copy's (``"all_gather"``), or for stage 1's
        ``"reduce_scatter"`` the reduce dtype, else the full gradient's (the full parameter's); for stage 0's
        ``"all_reduce"`` of gradients ``no_sync`` kept local, the reduce dtype, else the parameter's."""
        if kind == "all_reduce":
            return spec_of(shard).reduce_dtype or shard.dtype
        if kind == "all_gather":
            return prepared_param(shard).full_copy.dtype
        return spec_of(shard).reduce_dtype or prepared_param(shard).full_copy.dtype

    def buckets(self, kind: str, shards: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """``shards`` grouped as one step collective of ``kind`` takes them: in order, up to ``bucket_bytes`` of
        full buffer per bucket, one dtype per bucket. The ledger reads the same buckets."""
        dtypes = [self.collective_dtype(kind, shard) for shard in shards]
        sizes = [spec_of(shard).chunk * spec_of(shard).world_size * dtype.itemsize
                 for shard, dtype in zip(shards, dtypes)]
        return [[shards[i] for i in bucket] for bucket in pack_greedily(sizes, self.bucket_bytes, dtypes)]

    @torch.compiler.disable  # eager even inside a compiled step: gradients are new tensors every step
    @torch.no_grad()
    @peer_failures_explained("optimizer.step()")
    def settle_gradients(self, optimizer=None, args=None, kwargs=None) -> None:
        if self.stage == 0 and self.grad_sync.local_grads_pending:
            # Averaging is idempotent on gradients that were already reduced: a synced last micro-batch stays exact.
            self.average_full_gradients()
            self.grad_sync.local_grads_pending = False
        elif self.stage == 1:
            # a parameter without a gradient has none this step, or it is in its master already
            masters = [prepared_param(p).master for p in self.leaves if p.grad is not None]
            for bucket in self.buckets("reduce_scatter", masters):
                _reduce_scatter_into_masters(bucket)

    @torch.compiler.disable
    @torch.no_grad()
    @peer_failures_explained("averaging the gradients")
    def average_full_gradients(self) -> None:
        """Every full gradient (stages 0, 1) becomes its average over the ranks, what DDP's backward leaves: one
        all-reduce per bucket. Stage 0 runs it for gradients ``no_sync`` kept local; stage 1 for torch's
        ``clip_grad_norm_`` / ``get_total_norm``, and the step's reduce-scatter that follows averages gradients every
        rank holds alike, which leaves them as they are (averaging is linear, so a gradient accumulated into
        afterwards is still reduced right)."""
        for bucket in self.buckets("all_reduce", [p for p in self.leaves if p.grad is not None]):
            _all_reduce_gradients(bucket)

    @torch.compiler.disable  # a compiled step publishes inside its graph (shard_optimizer_pass); this is the eager path
    @torch.no_grad()
    @peer_failures_explained("optimizer.step()")
    def publish_parameters(self, optimizer=None, args=None, kwargs=None) -> None:
        pending = [shard for shard in self.shards() if _PUBLISHED_AT_VERSION.get(shard) != tensor_version(shard)]
        for bucket in self.buckets("all_gather", pending):
            _gather_into_full_copies(bucket)


def flat_gradient(grad: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """The flat, zero-padded gradient of a stage-2/3 leaf's gradient: the flat gradient its rows are a view of, where
    they are one (what the hand-over hook of ``prepare`` gives the leaf), else its rows padded (a copy)."""
    rows = grad.to_local()
    base = view_base(rows)
    if base is not None and base.dim() == 1 and base.numel() == spec.chunk and rows.data_ptr() == base.data_ptr():
        return base
    return flat_shard(grad, spec)


def sharded_step_of(optimizer: torch.optim.Optimizer) -> ShardedStep:
    """The ``ShardedStep`` of an optimizer ``prepare`` returned."""
    record = optimizer_record(optimizer)
    if record is None:
        raise FxShardError("this optimizer was not returned by backend.prepare; prepare the model with its "
                           "optimizer and use the optimizer it returns")
    return record.sharded_step


def _all_reduce_gradients(params: list[torch.Tensor]) -> None:
    """One all-reduce (average) of these parameters' gradients, flat and concatenated in the reduce dtype; each
    gradient becomes its averaged slice, in the parameter's dtype."""
    flat = torch.cat([cast_to(p.grad, spec_of(p).reduce_dtype).reshape(-1) for p in params])
    reduced = _c10d.wait_tensor(_c10d.all_reduce(flat, "avg", spec_of(params[0]).group_name))
    for param, piece in zip(params, reduced.split([p.numel() for p in params])):
        param.grad = piece.view_as(param).to(param.dtype, copy=True)


def _reduce_scatter_into_masters(masters: list[torch.Tensor]) -> None:
    """One reduce-scatter (average) of the full gradients of the parameters these stage-1 masters shard; each
    master's gradient becomes its slice, and the full gradient is freed."""
    params = [prepared_param(master).full_copy for master in masters]
    specs = [spec_of(master) for master in masters]
    world, group = specs[0].world_size, specs[0].group_name
    # rank-major, written in place: row r holds the slice of every gradient that rank r keeps
    rows = params[0].grad.new_empty(world, sum(s.chunk for s in specs), dtype=specs[0].reduce_dtype)
    for param, spec, columns in zip(params, specs, rows.split([s.chunk for s in specs], dim=1)):
        columns.copy_(flat_padded(param.grad, world).view(world, spec.chunk))
    reduced = reduce_scatter_mean(rows.view(-1), world, group, specs[0].replicate_group_name)
    for master, param, piece in zip(masters, params, reduced.split([s.chunk for s in specs])):
        # a tensor of its own, not a view into the bucket: a compiled step would see each gradient's storage offset
        # and trace it as a size symbol
        master.grad = piece.to(master.dtype, copy=True)
        param.grad = None


def _gather_into_full_copies(shards: list[torch.Tensor]) -> None:
    """One all-gather of these shards, each cast to its full copy's dtype, into their full copies."""
    specs = [spec_of(shard) for shard in shards]
    fulls = [prepared_param(shard).full_copy for shard in shards]
    world, group = specs[0].world_size, specs[0].group_name
    flat = torch.cat([cast_to(shard, full.dtype) for shard, full in zip(shards, fulls)])
    gathered = _c10d.wait_tensor(_c10d.all_gather_into_tensor(flat, world, group))
    # rank-major: row r holds rank r's shard of every parameter, side by side
    columns = gathered.view(world, -1).split([spec.chunk for spec in specs], dim=1)
    for full, spec, column in zip(fulls, specs, columns):
        full.copy_(unpad(column.reshape(-1), spec))


def _refuse_foreign_optimizer(optimizer, args, kwargs) -> None:
    """A step of an optimizer that ``prepare`` did not return, over parameters whose communication lives in the
    steps of the one it did return (stages 0 under ``no_sync``, 1, 2), or over parameters prepare replaced by
    shards (stages 2, 3), would train silently wrong: stop it before it updates anything."""
    if optimizer_record(optimizer) is not None or torch.compiler.is_compiling():
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            spec = spec_of(param)
            record = prepared_param(param)
            if replaced_by(param) is not None:
                problem = f"a parameter that prepare replaced by its shard ({record.spec.name})"
            elif spec is not None and spec.stage in (1, 2):
                problem = f"{spec.name}, whose stage-{spec.stage} communication runs in the optimizer's step"
            elif record is not None and record.grad_sync.local_grads_pending:
                problem = f"{spec.name}, whose gradients no_sync kept local until the step"
            else:
                continue
            raise FxShardError(
                f"{type(optimizer).__name__}.step() updates {problem}, but this optimizer is not the one "
                "backend.prepare returned; pass the optimizer to `model, opt = backend.prepare(model, opt)` and "
                "step the returned `opt`"
            )


register_optimizer_step_pre_hook(_refuse_foreign_optimizer)


def _count_the_step(optimizer, args, kwargs) -> None:
    """A step over a prepared model's parameters (by the optimizer prepare returned, or at stages 0 and 3 one built
    over the model after prepare) is checked against the other ranks' and counted by the model's ``StepClock``. The
    optimizer over the flat shards that a returned one steps from its own step takes no step of its own."""
    if torch.compiler.is_compiling() or steps_inside_another(optimizer):
        return
    record = next((r for group in optimizer.param_groups for p in group["params"]
                   if (r := prepared_param(p)) is not None), None)
    if record is not None:
        record.grad_sync.clock.step()


register_optimizer_step_pre_hook(_count_the_step)


@torch.no_grad()
def _agree_on_found_inf(optimizer: torch.optim.Optimizer, found_inf_per_device: dict) -> None:
    """A plain ``torch.amp.GradScaler`` flags inf/NaN in the gradients this rank holds: at stages 1-3 (and stage 0
    under ``no_sync``) the ranks hold different ones, so an overflow in one rank's part would make that rank alone
    skip the step and halve its scale. For an optimizer ``prepare`` returned, every rank's flag becomes the largest
    over the ranks (one all-reduce of one element, every rank checks before it steps), so the ranks skip, step and
    rescale together, as ``ShardedGradScaler`` and FSDP2's DTensor gradients make them."""
    record = optimizer_record(optimizer)
    if record is None or not found_inf_per_device or not record.sharded_step.leaves:
        return
    step = record.sharded_step
    step.grad_sync.clock.check(INF_CHECK)
    flags = list(found_inf_per_device.values())
    group = spec_of(step.leaves[0]).all_ranks_group_name
    with peer_failures_explained("GradScaler's inf/NaN check"):
        any_rank = _c10d.wait_tensor(_c10d.all_reduce(torch.stack([f.to(flags[0].device) for f in flags]).amax(),
                                                      "max", group))
    for flag in flags:
        flag.copy_(any_rank)


after_grad_scaler_inf_check(_agree_on_found_inf)


@torch.no_grad()
def clip_grad_norm_(optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for the optimizer ``prepare`` returned: the norm of the whole model's
    averaged gradient, the same on every rank (a collective: every rank must call it), and every gradient scaled by
    ``min(1, max_norm / norm)``. Call it between backward and ``optimizer.step()``."""
    step = sharded_step_of(optimizer)
    step.grad_sync.clock.check(NORM)
    step.settle_gradients()
    # where the averaged gradients are now: stage 1's masters (the reduce-scatter freed the full ones), else what the
    # model holds (stages 2, 3: the leaves; their flat shards get theirs at the step)
    holding = updating_optimizer(optimizer) if step.stage == 1 else optimizer
    params = [p for group in holding.param_groups for p in group["params"] if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    total = _global_grad_norm(params, float(norm_type))
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _global_grad_norm(params: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The ``norm_type`` norm of the whole model's gradient, from the averaged gradients of ``params`` (tensors
    prepare laid out) that this rank holds: a collective over their groups, the same on every rank."""
    op = "max" if norm_type == math.inf else "sum"
    # A gradient's term is added over the ranks that hold disjoint pieces of it: its tp group where it is split over
    # one, fxshard's group where this rank holds a shard of it; a term every rank holds alike (a Replicate tp piece,
    # a parameter every rank holds whole) counts once.
    grads_over: dict[tuple[str, str], list[torch.Tensor]] = {}  # (tp group, shard group; "": none) -> gradients
    for param in params:
        spec = spec_of(param)
        tp = spec.tensor_parallel
        sharded = spec.stage >= 2 or prepared_param(param).master is param
        groups = (tp.group_name if tp is not None and tp.splits else "", spec.group_name if sharded else "")
        grads_over.setdefault(groups, []).append(param.grad.to_local() if isinstance(param.grad, DTensor)
                                                 else param.grad)  # this rank's rows
    terms = []
    for groups, grads in grads_over.items():
        if norm_type == math.inf:
            term = torch.stack([g.abs().max() for g in grads]).max()
        else:
            term = torch.stack([torch.linalg.vector_norm(g, norm_type) ** norm_type for g in grads]).sum()
        for group in filter(None, groups):
            term = _c10d.wait_tensor(_c10d.all_reduce(term, op, group))
        terms.append(term)
    total = torch.stack(terms).max() if norm_type == math.inf else torch.stack(terms).sum()
    return total if norm_type == math.inf else total ** (1.0 / norm_type)


@torch.no_grad()
def _total_norm_of_prepared_grads(tensors: list[torch.Tensor], norm_type: float) -> torch.Tensor | None:
    """``torch.nn.utils.get_total_norm`` (what ``clip_grad_norm_`` calls) over gradients of parameters prepare
    laid out: the norm of the whole model's averaged gradient, as DDP's ranks compute it, not this rank's piece; None
    when no tensor is such a gradient (torch's own computation runs). Gradients a stage averages only in the step
    (stage 1; stage 0 after ``no_sync``) are averaged first, so the clip that follows scales what the step uses."""
    prepared = {id(leaf.grad): leaf for leaf in prepared_leaves() if leaf.grad is not None}
    leaves = [prepared[id(t)] for t in tensors if id(t) in prepared]
    if not leaves:
        return None
    if len(leaves) != len(tensors):
        raise FxShardError(
            f"a gradient norm over {len(leaves)} gradient(s) of a prepared model and {len(tensors) - len(leaves)} "
            "other tensor(s): the prepared ones are pieces held by each rank, the others this rank's own; take "
            "the norm of each kind apart"
        )
    spec = spec_of(leaves[0])
    grad_sync = prepared_param(leaves[0]).grad_sync
    grad_sync.clock.check(NORM)
    # stage 0 after no_sync, and stage 1 always: this rank's own gradients, averaged here as the step would
    if (grad_sync.local_grads_pending or spec.stage == 1) and not grad_sync.settle():
        raise FxShardError(f"a stage-{spec.stage} model averages the gradients a norm reads in the step of its "
                           "prepared optimizer, and this model was prepared without one: prepare it with its "
                           "optimizer")
    return _global_grad_norm(leaves, norm_type)


total_norm_from(_total_norm_of_prepared_grads)


# -- a full optimizer state dict: the same at any world size and stage -------------------------------------------
def _updated_with_specs(optimizer: torch.optim.Optimizer) -> list[list[tuple[torch.Tensor, ShardSpec]]]:
    sharded_step_of(optimizer)  # the optimizer prepare returned: it updates tensors prepare laid out
    return [[(p, spec_of(p)) for p in group["params"]] for group in updating_optimizer(optimizer).param_groups]


@torch.no_grad()
def full_state_dict(optimizer: torch.optim.Optimizer) -> dict:
    """The prepared optimizer's state as if it ran on one process over the full parameters (a collective: every
    rank must call it): ``{"state": {parameter name: {kind: full-shape tensor or scalar}}, "param_groups": [{
    hyperparameters..., "params": [parameter names]}]}``. Loadable at any world size and stage with
    :func:`load_full_state_dict`."""
    state, groups = {}, []
    updating = updating_optimizer(optimizer)
    for group, pairs in zip(optimizer.param_groups, _updated_with_specs(optimizer)):
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": [s.name for _, s in pairs]})
        for updated, spec in pairs:
            if updated not in updating.state:
                continue
            state[spec.name] = {  # stages 1-3 update flat shards, stage 0 full parameters
                kind: global_of(gather_full(value, spec) if spec.stage >= 1 else value.clone(), spec)
                if optimizer_state_dict.is_per_element(value, updated)
                else (value.clone() if torch.is_tensor(value) else value)
                for kind, value in updating.state[updated].items()
            }
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def load_full_state_dict(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    """Lay a :func:`full_state_dict` (saved at any world size and stage) out over this prepared optimizer: each
    per-element state becomes this rank's flat shard of it (stages 1-3) or stays full (stage 0), in the updated
    tensor's dtype; the groups' hyperparameters are restored. Raises FxShardError, before changing anything, when
    the state dict names other parameters or shapes."""
    groups = _updated_with_specs(optimizer)
    saved_groups = state_dict.get("param_groups", [])
    names = [[spec.name for _, spec in pairs] for pairs in groups]
    if [g.get("params") for g in saved_groups] != names:
        raise FxShardError(
            f"the state dict's param groups name {[g.get('params') for g in saved_groups]}, this optimizer's "
            f"{names}; load a full optimizer state dict saved from the same model, with its parameters grouped "
            "alike"
        )
    laid_out = {}
    for pairs in groups:
        for updated, spec in pairs:
            saved = state_dict["state"].get(spec.name)
            if saved is None:
                continue
            kinds = {}
            for kind, value in saved.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    if tuple(value.shape) != spec.global_shape:
                        raise FxShardError(f"{spec.name}: {kind} has shape {list(value.shape)}, the parameter "
                                           f"{list(spec.global_shape)}; load a full optimizer state dict (from "
                                           "backend.full_optimizer_state_dict()) of the same model")
                    value = full_from_value(value, spec, f"{spec.name}: {kind}").to(updated.dtype)
                    kinds[kind] = shard_of(value, spec) if spec.stage >= 1 else value.clone()
                else:
                    kinds[kind] = value.clone() if torch.is_tensor(value) else value
            laid_out[updated] = kinds
    for group, saved in zip(optimizer.param_groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
    replace_updated_state(optimizer, laid_out)


# -- a compiled optimizer.step -------------------------------------------------------------------------------------
_PUBLISHED_AT_VERSION: WeakIdKeyDictionary = WeakIdKeyDictionary()  # shard -> its version when a graph published it


def _mutated_tensors(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """Inputs and attributes of a Dynamo graph that an in-place op (``add_``, ``_foreach_mul_``, ``copy_``...)
    mutates."""
    mutated = set()
    for node in gm.graph.nodes:
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        if node.op not in ("call_method", "call_function") or not name.endswith("_") or name.endswith("__"):
            continue
        first = node.args[0] if node.args else None
        for arg in first if isinstance(first, (list, tuple)) else [first]:
            if isinstance(arg, torch.fx.Node) and arg.op in ("placeholder", "get_attr"):
                mutated.add(arg)
    return mutated


def annotate_optimizer_graph(gm: torch.fx.GraphModule, example_inputs) -> list[torch.Tensor]:
    """If ``gm`` is (part of) a compiled ``optimizer.step`` that updates tensors ``prepare`` laid out, mark their
    nodes for ``shard_optimizer_pass`` and register, as buffers of ``gm``, the full tensors each update must be
    published into; returns the shards it will publish (empty: not an optimizer graph, or nothing to publish).
    Dynamo hands an optimizer's parameters to the backend as attributes of ``gm`` (``get_attr``), its gradients
    as inputs. The ShardedStep's eager post-step gather skips what the graph published."""
    inputs = dict(zip(gm.graph.find_nodes(op="placeholder"), example_inputs))
    attributes = dict(gm.named_parameters())
    updated = []
    for node in _mutated_tensors(gm):
        value = inputs.get(node) if node.op == "placeholder" else attributes.get(node.target)
        if value is not None and spec_of(value) is not None:
            updated.append((node, value))
    published = []
    for node, shard in sorted(updated, key=lambda pair: spec_of(pair[1]).name):
        spec = spec_of(shard)
        node.meta["fxshard"] = {"role": "updated_shard", "unit": unit_of(spec.name), "fqn": spec.name,
                                "full_shape": spec.full_shape,
                                "world_size": spec.world_size, "group_name": spec.group_name}
        full = prepared_param(shard).full_copy
        if full is not None:
            name = f"_fxshard_publish_{len(published)}"
            gm.register_buffer(name, full)
            name_parameter_source(gm, name, ConstantSource(f"fxshard_full_copy_of_{spec.name}"))
            node.meta["fxshard"]["publish_into"] = name
            published.append(shard)
    gm.meta["fxshard_optimizer"] = bool(updated)
    return published


def mark_published(shards: list[torch.Tensor]) -> None:
    """A compiled step just gathered these shards into their full copies."""
    for shard in shards:
        _PUBLISHED_AT_VERSION[shard] = tensor_version(shard)
