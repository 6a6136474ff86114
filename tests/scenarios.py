"""Functions that run on every rank of a WorkerPool (module level so spawned ranks can import them)."""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import time

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

import fxshard
from examples.models import GPT, MLP, GPTConfig, gpt_batch
from fxshard.runtime.optimizer_record import updating_optimizer
from fxshard.testing import rank_and_world

PER_RANK_BATCH = 4
LR = {"sgd": 0.05, "adamw": 1e-2}


def full_state(model: torch.nn.Module) -> dict:
    """``model.state_dict()`` with every DTensor (a prepared model's sharded parameters) gathered into its full
    tensor: what the single-process reference's state_dict() holds. A collective: every rank calls it."""
    from torch.distributed.tensor import DTensor

    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}


def build_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        return MLP()
    if name == "gpt":
        return GPT(GPTConfig())
    if name == "mlp_uneven":  # shapes that no world size of 2 or 3 divides
        return MLP(d_in=7, d_hidden=11, d_out=5)
    if name == "mlp_temperature":  # the uneven MLP and a 0-d parameter
        return MLPWithTemperature()
    if name == "mlp_stack":
        return ResidualStack()
    if name == "gpt_checkpointed":  # activation checkpointing: each block recomputed in backward
        model = GPT(GPTConfig())
        model.blocks = torch.nn.ModuleList(CheckpointedBlock(block) for block in model.blocks)
        return model
    raise ValueError(name)


class ResidualBlock(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(width, 2 * width)
        self.fc2 = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class ResidualStack(torch.nn.Module):
    """Thirty-two identical residual blocks before an output layer: small, and repeated enough that most of the
    segments of a stage-3 graph repeat (``fxshard.compiler.segments``)."""

    def __init__(self, width: int = 8, depth: int = 32):
        super().__init__()
        self.blocks = torch.nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class CheckpointedBlock(torch.nn.Module):
    """``block`` run under non-reentrant activation checkpointing, as training scripts wrap their layers."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def hybrid_mesh(shape: tuple | None, device: str = "cpu"):
    """A (replicas, shards) DeviceMesh with the dimension names hybrid sharding takes, or None for ``None``."""
    if shape is None:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device, shape, mesh_dim_names=("replicate", "shard"))


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=LR["sgd"], momentum=0.9)
    return torch.optim.AdamW(params, lr=LR["adamw"], weight_decay=0.1)


def global_batch(model_name: str, size: int, generator: torch.Generator):
    if model_name.startswith("gpt"):
        return gpt_batch(GPTConfig(), size, generator)
    d_in = 7 if model_name in ("mlp_uneven", "mlp_temperature") else 8
    return torch.randn(size, d_in, generator=generator), torch.randn(size, 5, generator=generator)


def loss_of(model_name: str, model, batch) -> torch.Tensor:
    if model_name.startswith("gpt"):
        return model(*batch)
    inputs, targets = batch
    # in fp32 whatever the compute dtype: torch 2.11's mse_loss backward fails on a bf16 input beside fp32 targets
    return F.mse_loss(model(inputs).float(), targets)


def train_against_reference(
    model_name: str, optimizer: str, steps: int = 5, compiled: bool = True, compiler: str = "eager", stage: int = 3,
    clip: float | None = None, compile_step: bool = False, device: str = "cpu", mesh_shape: tuple | None = None,
    halve_lr_each_step: bool = False, clip_with: str = "backend", regional: bool = True,
) -> dict:
    """Train a prepared model (this rank's slice of each global batch) beside a single-process reference that
    sees the whole global batch; return both models' full parameters before and after, the graphs compiled and
    the collectives and the bytes of each kind of training state of the last step (gradients: after its backward)
    and, with ``clip``, the gradient norms each clipped by. ``compile_step`` compiles ``opt.step`` with the same
    backend. ``device``: where both models train (``"cuda"``: this rank's GPU); what is returned is on the CPU.
    ``mesh_shape``: (replicas, shards) of a hybrid-sharding mesh over every rank.
    ``halve_lr_each_step``: both optimizers get an LR scheduler, the prepared one's built before prepare.
    ``clip_with``: ``"backend"`` clips with ``backend.clip_grad_norm_``, ``"torch"`` with torch's own function over
    ``model.parameters()``, as a script written for DDP does. ``regional``: the backend's option (Inductor compiles
    each repeated segment once); ``"segments"`` says per graph kind (segments, distinct), (0, 0) where compiled
    whole."""
    from fxshard.report.measure import CollectiveCounter

    rank, world = rank_and_world()
    model = build_model(model_name).to(device)
    reference = copy.deepcopy(model)
    initial = {k: v.clone() for k, v in reference.state_dict().items()}
    reference_opt = make_optimizer(optimizer, reference.parameters())
    backend = fxshard.backend(stage=stage, compiler=compiler, mesh=hybrid_mesh(mesh_shape, device), regional=regional)
    users_opt = make_optimizer(optimizer, model.parameters())
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 0.5**step)
                  for o in (users_opt, reference_opt) if halve_lr_each_step]
    model, opt = backend.prepare(model, users_opt)
    run = torch.compile(model, backend=backend, fullgraph=True) if compiled else model
    step = torch.compile(opt.step, backend=backend) if compile_step else opt.step
    generator = torch.Generator().manual_seed(1)
    norms, reference_norms = [], []
    for i in range(steps):
        batch = tuple(t.to(device) for t in global_batch(model_name, world * PER_RANK_BATCH, generator))
        local = tuple(t[rank * PER_RANK_BATCH : (rank + 1) * PER_RANK_BATCH] for t in batch)
        with CollectiveCounter() if i == steps - 1 else contextlib.nullcontext() as counter:
            loss_of(model_name, run, local).backward()
            grads_after_backward = _storage_bytes(p.grad for p in model.parameters())
            if clip is not None:
                clipped = (backend.clip_grad_norm_(clip) if clip_with == "backend"
                           else torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
                norms.append(clipped.item())
            step()
        opt.zero_grad()
        step_the_reference(loss_of(model_name, reference, batch), reference, reference_opt, clip, reference_norms)
        for scheduler in schedulers:
            scheduler.step()
    on_cpu = functools.partial(torch.utils._pytree.tree_map_only, torch.Tensor, lambda t: t.cpu())
    return on_cpu({
        "norms": norms,
        "reference_norms": reference_norms,
        "initial": initial,
        "prepare_kept_the_optimizer": opt is users_opt,
        "final": full_state(model),
        "expected": reference.state_dict(),
        "compiled_graphs": sorted({(r.graph_id, r.kind) for r in backend.graphs}),
        "segments": {r.kind: (len(r.compiled_as.segments), r.compiled_as.distinct) for r in backend.graphs
                     if r.compiled_as is not None},
        "collectives": counter.totals(),
        "world_size": world,
        "state_bytes": state_bytes(model, opt, grads_after_backward),
        "graph_devices": sorted({str(n.meta["val"].device) for r in backend.graphs if r.kind in ("forward", "backward")
                                 for n in r.final.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)}),
        "devices": sorted({str(t.device) for t in [*model.parameters(), *(v for state in opt.state.values()
                                                                          for v in state.values() if v.dim())]}),
    })


def step_the_reference(loss: torch.Tensor, reference, reference_opt, clip: float | None, norms: list) -> None:
    """One step of a single-process reference: the backward of ``loss``, with ``clip`` the gradient norm clipped by
    (appended to ``norms``), the update."""
    loss.backward()
    if clip is not None:
        norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), clip).item())
    reference_opt.step()
    reference_opt.zero_grad()


def _full_weight_matches(tensors, full_weights: dict) -> list[str]:
    """Names of full weights (or their transposes) that any of ``tensors`` holds, compared by value."""
    found = []
    for name, weight in full_weights.items():
        candidates = [weight] + ([weight.t()] if weight.dim() == 2 else [])
        for tensor in tensors:
            if any(tensor.shape == c.shape and torch.equal(tensor, c) for c in candidates):
                found.append(name)
                break
    return found


def memory_of_training(steps: int = 2, **backend_options) -> dict:
    """Train the GPT with AdamW; report what each rank's storage holds and whether a full weight was ever
    saved for backward or kept alive between steps."""
    import gc

    from fxshard.runtime.param import prepared_param, spec_of

    torch._dynamo.reset()
    gc.collect()
    # what earlier work in this worker left alive (held here, so no new tensor takes one's id) is not this run's
    earlier = [o for o in gc.get_objects() if type(o) in (torch.Tensor, torch.nn.Parameter)]
    earlier_ids = {id(o) for o in earlier}
    rank, world = rank_and_world()
    model = build_model("gpt")
    backend = fxshard.backend(stage=3, **{"compiler": "eager", **backend_options})
    model, opt = backend.prepare(model, make_optimizer("adamw", model.parameters()))
    gc.collect()
    params = dict(model.named_parameters())
    storage = {n: (p.to_local().untyped_storage().nbytes(), spec_of(p).chunk * p.element_size())
               for n, p in params.items()}
    run = torch.compile(model, backend=backend, fullgraph=True)
    generator = torch.Generator().manual_seed(rank)
    saved_full, alive_full = set(), set()
    for _ in range(steps):
        weights_before = {k: v for k, v in full_state(model).items() if k.endswith("weight")}
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss = loss_of("gpt", run, gpt_batch(GPTConfig(), PER_RANK_BATCH, generator))
        saved_full.update(_full_weight_matches(saved, weights_before))
        del saved
        loss.backward()
        opt.step()
        opt.zero_grad()
        del loss
        gc.collect()
        weights_after = {k: v for k, v in full_state(model).items() if k.endswith("weight")}
        # full_tensor() returns a view of the gathered tensor: the test's own copies are their storages
        ours = {t.untyped_storage().data_ptr() for t in [*weights_before.values(), *weights_after.values()]}
        live = [o for o in gc.get_objects() if type(o) in (torch.Tensor, torch.nn.Parameter)
                and id(o) not in earlier_ids and o.untyped_storage().data_ptr() not in ours]
        alive_full.update(_full_weight_matches(live, weights_before) + _full_weight_matches(live, weights_after))
    state_shapes = {tuple(v.shape) for s in opt.state.values() for v in s.values() if v.dim() > 0}
    return {
        "storage": storage,
        "flat_shard_shapes": {n: tuple(prepared_param(p).flat.shape) for n, p in params.items()},
        "optimizer_state_shapes": state_shapes,
        "saved_full_weights": sorted(saved_full),
        "alive_full_weights": sorted(alive_full),
    }


class MLPWithTemperature(torch.nn.Module):
    """An MLP whose output a learned 0-d scalar divides (CLIP's ``logit_scale`` is one)."""

    def __init__(self):
        super().__init__()
        self.mlp = MLP(d_in=7, d_hidden=11, d_out=5)
        self.temperature = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x) / self.temperature


def state_dict_on_the_first_rank_only(stage: int, timeout_s: float, with_scalar: bool,
                                     param_dtype: torch.dtype | None = None) -> dict:
    """``if rank == 0: model.state_dict()`` on a prepared MLP whose rows split unevenly, ``with_scalar``: with a
    0-d parameter too; returns what each rank saw (the first one's keys and value types, or its error) and how long
    it took."""
    rank, _ = rank_and_world()
    backend = fxshard.backend(compiler="eager", stage=stage, collective_timeout_s=timeout_s, param_dtype=param_dtype)
    model, _ = backend.prepare(MLPWithTemperature() if with_scalar else build_model("mlp_uneven"))
    start = time.monotonic()
    try:
        saved = {k: type(v).__name__ for k, v in model.state_dict().items()} if rank == 0 else {}
    except fxshard.FxShardError as error:
        return {"error": str(error), "seconds": time.monotonic() - start}
    return {"saved": saved, "seconds": time.monotonic() - start}


def state_dict_round_trip() -> dict:
    """state_dict() of a prepared model gathers to the full, unpadded model; load_state_dict() takes full tensors
    back."""
    model = build_model("mlp_uneven")
    original = {k: v.clone() for k, v in model.state_dict().items()}
    backend = fxshard.backend(compiler="eager", stage=3)
    backend.prepare(model)
    gathered = full_state(model)
    replacement = {k: torch.full_like(v, float(i)) for i, (k, v) in enumerate(original.items())}
    model.load_state_dict(replacement)
    return {"original": original, "gathered": gathered, "reloaded": full_state(model), "replacement": replacement,
            "shards": {n: p.detach().to_local().clone() for n, p in model.named_parameters()}}


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (gradients of one unit may share one buffer)."""
    from fxshard.runtime.tensor_parallel import local_tensor  # a DTensor's storage: its local tensor's

    locals_ = [local_tensor(t) for t in tensors if t is not None]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in locals_}
    return sum(storages.values())


def state_bytes(model, opt, grads_after_backward: int) -> dict:
    """The elements Ψ of a prepared model (``psi_padded``: with each shard's padding) and the bytes each kind of
    training state holds on this rank."""
    from fxshard.runtime.param import spec_of

    specs = [spec_of(p) for p in model.parameters()]
    return {
        "psi": sum(s.numel for s in specs),
        "psi_padded": sum(s.chunk * s.world_size for s in specs),
        "psi_bytes": 4 * sum(s.numel for s in specs),
        "shard_bytes": 4 * sum(s.chunk for s in specs),
        "params": _storage_bytes(model.parameters()),
        "resident_copies": _storage_bytes(b for n, b in model.named_buffers() if "_fxshard_full_" in n),
        "grads_after_backward": grads_after_backward,
        "optimizer_params": _storage_bytes(p for g in updating_optimizer(opt).param_groups for p in g["params"]),
        "optimizer_state": _storage_bytes(v for s in opt.state.values() for v in s.values() if v.dim()),
    }


def accumulate_against_reference(stage: int, micro_batches: int = 3, steps: int = 3, clip: float | None = None
                                 ) -> dict:
    """Gradient accumulation: each step runs ``micro_batches`` backward passes inside ``backend.no_sync`` on this
    rank's slices, beside a single process that sees each step's whole global batch at once; with ``clip``, both
    clip with torch's ``clip_grad_norm_`` before the step. Returns the full parameters, the collectives of the last
    step and the norms clipped by."""
    from fxshard.report.measure import CollectiveCounter

    rank, world = rank_and_world()
    model = build_model("gpt")
    reference = copy.deepcopy(model)
    initial = {k: v.clone() for k, v in reference.state_dict().items()}
    reference_opt = make_optimizer("sgd", reference.parameters())
    backend = fxshard.backend(compiler="eager", stage=stage)
    model, opt = backend.prepare(model, make_optimizer("sgd", model.parameters()))
    run = torch.compile(model, backend=backend, fullgraph=True)
    generator = torch.Generator().manual_seed(1)
    per_micro = PER_RANK_BATCH
    norms, reference_norms = [], []
    for _ in range(steps):
        batch = global_batch("gpt", world * per_micro * micro_batches, generator)
        with CollectiveCounter() as counter:
            with backend.no_sync(model):
                for m in range(micro_batches):
                    lo = (m * world + rank) * per_micro
                    (loss_of("gpt", run, tuple(t[lo : lo + per_micro] for t in batch)) / micro_batches).backward()
            if clip is not None:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
            opt.step()
            opt.zero_grad()
        step_the_reference(loss_of("gpt", reference, batch), reference, reference_opt, clip, reference_norms)
    return {
        "norms": norms,
        "reference_norms": reference_norms,
        "initial": initial,
        "final": full_state(model),
        "expected": reference.state_dict(),
        "compiled_graphs": sorted({(r.graph_id, r.kind) for r in backend.graphs}),
        "segments": {r.kind: (len(r.compiled_as.segments), r.compiled_as.distinct) for r in backend.graphs
                     if r.compiled_as is not None},
        "collectives": counter.totals(),
    }


# --- scheduling (issue 5) ---
def train_variants_against_reference(model_name: str, optimizer: str, variants: list[dict], steps: int = 3) -> dict:
    """Train one prepared copy of the model per entry of ``variants`` (backend options: stage, bucket, prefetch...)
    on this rank's slice of each global batch, beside one single-process reference on the whole batch. Returns the
    reference, each variant's full parameters and its collectives per graph kind in graph order."""
    from fxshard.report import collectives

    rank, world = rank_and_world()
    model = build_model(model_name)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    reference = copy.deepcopy(model)
    reference_opt = make_optimizer(optimizer, reference.parameters())
    generator = torch.Generator().manual_seed(1)
    batches = [global_batch(model_name, world * PER_RANK_BATCH, generator) for _ in range(steps)]
    for batch in batches:
        loss_of(model_name, reference, batch).backward()
        reference_opt.step()
        reference_opt.zero_grad()
    finals, graphs = [], []
    for options in variants:
        torch._dynamo.reset()
        sharded = copy.deepcopy(build_model(model_name))
        backend = fxshard.backend(**{"compiler": "eager", **options})
        sharded, opt = backend.prepare(sharded, make_optimizer(optimizer, sharded.parameters()))
        run = torch.compile(sharded, backend=backend, fullgraph=True)
        for batch in batches:
            local = tuple(t[rank * PER_RANK_BATCH : (rank + 1) * PER_RANK_BATCH] for t in batch)
            loss_of(model_name, run, local).backward()
            opt.step()
            opt.zero_grad()
        finals.append(full_state(sharded))
        graphs.append({r.kind: [(c["kind"], c["unit"]) for c in collectives(r.final)]
                       for r in backend.graphs if r.kind in ("forward", "backward")})
    return {"initial": initial, "expected": reference.state_dict(), "finals": finals, "collectives": graphs}


def _cast_floats(batch, dtype):
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in batch)


def train_mixed_precision_against_reference(
    model_name: str, stage: int, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, steps: int = 3,
    mode: str = "compiled",
) -> dict:
    """Train with ``param_dtype``/``reduce_dtype`` beside a single process that applies the same casts without
    autocast: an fp32 master; per rank's slice, a ``param_dtype`` copy of it computes the gradient, which is cast
    to ``reduce_dtype``, averaged over the ranks' slices, and cast to fp32 for the master's SGD step. ``mode``:
    ``"compiled"`` (the model), ``"compiled step"`` (the model and ``opt.step``), ``"compiled loss"`` (a function
    that calls the model and computes the loss, ``fullgraph=True``) or ``"eager"`` (none)."""
    rank, world = rank_and_world()
    model = build_model(model_name)
    master = copy.deepcopy(model)
    master_opt = make_optimizer("sgd", master.parameters())
    torch._dynamo.reset()
    backend = fxshard.backend(compiler="eager", stage=stage, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    model, opt = backend.prepare(model, make_optimizer("sgd", model.parameters()))
    run = model if mode in ("eager", "compiled loss") else torch.compile(model, backend=backend, fullgraph=True)
    step = torch.compile(opt.step, backend=backend) if mode == "compiled step" else opt.step
    loss_fn = torch.compile(loss_of, backend=backend, fullgraph=True) if mode == "compiled loss" else loss_of
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        batch = global_batch(model_name, world * PER_RANK_BATCH, generator)
        slices = [tuple(t[r * PER_RANK_BATCH : (r + 1) * PER_RANK_BATCH] for t in batch) for r in range(world)]
        loss = loss_fn(model_name, run, slices[rank])
        loss.backward()
        step()
        opt.zero_grad()
        per_rank_grads = []
        for local in slices:
            compute = copy.deepcopy(master).to(param_dtype)
            def forward(*inputs, compute=compute):  # floating inputs enter in the compute dtype, as prepare does
                return compute(*_cast_floats(inputs, param_dtype))

            loss_of(model_name, forward, local).backward()
            per_rank_grads.append([p.grad.to(reduce_dtype or param_dtype) for p in compute.parameters()])
        for param, grads in zip(master.parameters(), zip(*per_rank_grads)):
            param.grad = (sum(grads) / world).to(param.dtype)
        master_opt.step()
        master_opt.zero_grad()
    return {
        "final": full_state(model),
        "expected": master.state_dict(),
        "loss_dtype": loss.dtype,
        "leaf_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "updated_dtypes": sorted({str(p.dtype) for g in updating_optimizer(opt).param_groups for p in g["params"]}),
        "state_dtypes": sorted({str(v.dtype) for s in opt.state.values() for v in s.values() if v.dim()}),
        "resident_dtypes": sorted({str(b.dtype) for n, b in model.named_buffers() if "_fxshard_full_" in n}),
        "graphs": [record.kind for record in backend.graphs],
    }


# -- the ledger (fxshard.budget) against what a step measures ------------------------------------------------------


class Chain(torch.nn.Module):
    """Bias-free linear layers of uneven sizes whose input requires grad, so backward reads every weight (stage 3
    gathers each again: the textbook 3Ψ) and flat shards are padded at world sizes 2 and 3."""

    def __init__(self, sizes=(7, 11, 13, 5)):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b, bias=False) for a, b in zip(sizes, sizes[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == 0 else layer(torch.tanh(x))
        return x


def chain_batch(size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(size, 7, generator=generator).requires_grad_(), torch.randn(size, 5, generator=generator)


def _ledger_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return Chain() if name == "chain" else build_model(name)


def _ledger_batch(name: str, generator: torch.Generator):
    return chain_batch(PER_RANK_BATCH, generator) if name == "chain" else global_batch(name, PER_RANK_BATCH, generator)


def _ledger_step(name: str, model, backend):
    """The compiled step: for the Chain, the loss too, so that everything the step computes is in the graphs."""
    if name == "chain":
        return torch.compile(lambda inputs, targets: F.mse_loss(model(inputs), targets), backend=backend,
                             fullgraph=True)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    return lambda *batch: loss_of(name, compiled, batch)


def _ledger_loss(name: str, run, generator: torch.Generator) -> torch.Tensor:
    return run(*_ledger_batch(name, generator))


def peak_allocated_bytes(fn) -> int:
    """The most bytes allocated at once while ``fn()`` runs beyond what was allocated when it started, from the
    profiler's allocation events (every CPU allocation and free, in order)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    allocations, pending = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if event.typed[0] == _EventType.Allocation:
            allocations.append((event.start_time_ns, event.typed[1].alloc_size))
    live = peak = 0
    for _, size in sorted(allocations, key=lambda a: a[0]):
        live += size
        peak = max(peak, live)
    return peak


def _measured_peak(model_name: str, run, opt, generator, steps: int = 5) -> int:
    """Peak bytes allocated during a step (``peak_allocated_bytes``), the least over ``steps`` steps.

    Gloo's work object holds a collective's buffers until its worker thread has finished with it; where that thread
    waits for a core (two ranks on two cores), the buffers the graph has already dropped are freed later, so one
    step's peak varies with the scheduler. The least over a few steps is the graph's own."""
    batch = _ledger_batch(model_name, generator)  # the caller's, not the step's

    def step():
        run(*batch).backward()
        opt.step()

    peaks = []
    for _ in range(steps):
        opt.zero_grad()
        peaks.append(peak_allocated_bytes(step))
    return min(peaks)


def ledger_against_measurement(model_name: str, stages=(0, 1, 2, 3), peak: bool = False,
                               compile_step: bool = False, mesh_shape: tuple | None = None) -> dict:
    """For each stage: train three AdamW steps (``opt.step`` compiled too, with ``compile_step``; on a hybrid mesh
    of ``mesh_shape`` (replicas, shards), with it); of the last, the ledger at this world size beside what was
    measured (collective bytes and calls by kind, bytes of each kind of state), optionally the step's peak."""
    from fxshard import budget
    from fxshard.report.measure import CollectiveCounter
    from fxshard.runtime.collectives import COLLECTIVE_ROLES

    rank, world = rank_and_world()
    results = {}
    for stage in stages:
        torch._dynamo.reset()
        model = _ledger_model(model_name)
        backend = fxshard.backend(compiler="eager", stage=stage, mesh=hybrid_mesh(mesh_shape))
        model, opt = backend.prepare(model, make_optimizer("adamw", model.parameters()))
        run = _ledger_step(model_name, model, backend)
        step = torch.compile(opt.step, backend=backend) if compile_step else opt.step
        generator = torch.Generator().manual_seed(rank)
        for _ in range(3):  # the last step runs what the first two compiled (AdamW recompiles its step once)
            opt.zero_grad()
            with CollectiveCounter() as counter:
                _ledger_loss(model_name, run, generator).backward()
                grads = _storage_bytes(p.grad for p in model.parameters())
                step()
        leaves = {id(p) for p in model.parameters()}
        masters = [p for g in updating_optimizer(opt).param_groups for p in g["params"] if id(p) not in leaves]
        measured = {
            # distinct storages: a stage-2/3 leaf's rows are a view of the flat shard its optimizer updates
            "compute copy and master": _storage_bytes([*model.parameters(), *masters, *(
                b for n, b in model.named_buffers() if "_fxshard_full_" in n)]),
            "gradients": grads,
            # per-element state (a 0-d parameter's is 0-d too), not AdamW's step counter
            "optimizer state": _storage_bytes(v for s in opt.state.values() for k, v in s.items() if k != "step"),
            "collectives": {k: (t["bytes"], t["calls"]) for k, t in counter.totals().items()},
        }
        ledger = budget.ledger(backend)
        state_items = sorted({t.item for t in ledger.select("memory")} - {"compute copy", "master", "gradients"})
        predicted = {
            "compute copy and master": ledger.at(sum((t.bytes for t in ledger.select("memory", "compute copy")
                                                      + ledger.select("memory", "master")), 0)),
            "gradients": ledger.at(sum((t.bytes for t in ledger.select("memory", "gradients")), 0)),
            "optimizer state": ledger.at(sum((t.bytes for i in state_items for t in ledger.select("memory", i)), 0)),
            "collectives": {k: (ledger.at(ledger.communicated(k)), ledger.calls(k))
                            for k in COLLECTIVE_ROLES if ledger.calls(k)},
        }
        results[stage] = {"measured": measured, "ledger": predicted, "resident": ledger.at(ledger.resident()),
                          "ledger_peak": ledger.at(ledger.peak()), "world": world}
        if peak:
            results[stage]["measured_peak"] = _measured_peak(model_name, run, opt, generator)
    return results


def resume_from_checkpoint(stage: int, steps_before: int = 2, steps_after: int = 2) -> dict:
    """Train, save the model's full state dict and the sharded optimizer's state dict, train on; then prepare a
    fresh model, load both, and train the same steps again. Returns both runs' final parameters."""
    rank, world = rank_and_world()

    def batches():
        generator = torch.Generator().manual_seed(1)
        while True:
            batch = global_batch("gpt", world * PER_RANK_BATCH, generator)
            yield tuple(t[rank * PER_RANK_BATCH : (rank + 1) * PER_RANK_BATCH] for t in batch)

    def prepared():
        model = build_model("gpt")
        backend = fxshard.backend(compiler="eager", stage=stage)
        model, opt = backend.prepare(model, make_optimizer("adamw", model.parameters()))
        return model, opt, torch.compile(model, backend=backend, fullgraph=True)

    def train(opt, run, data, steps):
        for _ in range(steps):
            loss_of("gpt", run, next(data)).backward()
            opt.step()
            opt.zero_grad()

    model, opt, run = prepared()
    data = batches()
    train(opt, run, data, steps_before)
    model_state, opt_state = _saved_and_read_back(model.state_dict()), _saved_and_read_back(opt.state_dict())
    train(opt, run, data, steps_after)
    uninterrupted = full_state(model)

    resumed_model, resumed_opt, resumed_run = prepared()
    resumed_model.load_state_dict(model_state)
    resumed_opt.load_state_dict(opt_state)
    data = batches()
    for _ in range(steps_before):
        next(data)
    train(resumed_opt, resumed_run, data, steps_after)
    from fxshard.runtime.param import spec_of

    return {"uninterrupted": uninterrupted, "resumed": full_state(resumed_model),
            "saved_exp_avg_elements": sum(s["exp_avg"].to_local().numel() for s in opt_state["state"].values()),
            "full_elements": sum(spec_of(p).numel for p in model.parameters())}


def _saved_and_read_back(state_dict: dict) -> dict:
    """``state_dict`` through torch.save and torch.load, as a checkpoint on disk would be: nothing in it aliases the
    live model any more."""
    import io

    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _trained_gpt(stage: int, steps: int):
    """A GPT prepared for ``stage`` on this world, after ``steps`` AdamW steps on the ranks' slices of one global
    batch stream (the same stream at any world size, as long as it divides the global batch)."""
    rank, world = rank_and_world()
    backend = fxshard.backend(compiler="eager", stage=stage)
    model = build_model("gpt")
    model, opt = backend.prepare(model, make_optimizer("adamw", model.parameters()))
    run = torch.compile(model, backend=backend, fullgraph=True)
    generator = torch.Generator().manual_seed(1)
    per_rank = 12 // world
    for _ in range(steps):
        batch = global_batch("gpt", 12, generator)
        loss_of("gpt", run, tuple(t[rank * per_rank : (rank + 1) * per_rank] for t in batch)).backward()
        opt.step()
        opt.zero_grad()
    return backend


def save_full_optimizer_state(stage: int, path: str, steps: int = 2) -> dict:
    """Train, then write the full optimizer state dict to ``path`` (from rank 0) and return it from every rank."""
    torch._dynamo.reset()
    state = _trained_gpt(stage, steps).full_optimizer_state_dict()
    if rank_and_world()[0] == 0:
        torch.save(state, path)
    torch.distributed.barrier()
    return state


def reload_full_optimizer_state(stage: int, path: str) -> dict:
    """Prepare a fresh GPT for ``stage`` on this world, load the full optimizer state dict at ``path`` into it, and
    return it gathered again, with the number of elements of one state kind this rank holds."""
    torch._dynamo.reset()
    backend = _trained_gpt(stage, steps=0)
    backend.load_full_optimizer_state_dict(torch.load(path))
    held = sum(s["exp_avg"].numel() for s in backend.optimizer.state.values())
    return {"regathered": backend.full_optimizer_state_dict(), "exp_avg_elements_held": held}


def compiled_model(model_name: str, stage: int, world: int = 2, mesh_shape: tuple | None = None,
                   on_meta: bool = False, **backend_options):
    """The backend after one forward and backward of a model (``"chain"`` or a ``build_model`` name; ``on_meta``:
    built on the meta device) with AdamW, compiled under a fake process group of ``world`` ranks, or of a
    (replicas, shards) ``mesh_shape`` hybrid mesh (single process: its graphs, not its numbers)."""
    from fxshard.testing import fake_process_group

    with fake_process_group(math.prod(mesh_shape) if mesh_shape else world):
        torch._dynamo.reset()
        backend = fxshard.backend(stage=stage, mesh=hybrid_mesh(mesh_shape),
                                  **{"compiler": "eager", **backend_options})
        with torch.device("meta" if on_meta else "cpu"):
            model = _ledger_model(model_name)
        model, _ = backend.prepare(model, torch.optim.AdamW(model.parameters()))
        batch = _ledger_batch(model_name, torch.Generator().manual_seed(0))
        loss_of(model_name, torch.compile(model, backend=backend, fullgraph=True), batch).backward()
        return backend


class _FaultyMLP(torch.nn.Module):
    """The MLP with a point between its layers where one rank can fail mid-forward (a graph break: the point runs
    eagerly between two compiled graphs)."""

    def __init__(self, fault_at: tuple[int, int, str]):
        super().__init__()
        self.inner, self.fault_at, self.calls = build_model("mlp"), fault_at, 0

    def forward(self, x):
        hidden = torch.relu(self.inner.fc1(x))
        self._maybe_fail()
        return self.inner.fc2(hidden)

    @torch._dynamo.disable
    def _maybe_fail(self):
        import os
        import signal

        self.calls += 1
        rank, call, fault = self.fault_at
        if (rank, call) == (rank_and_world()[0], self.calls) and fault == "sigkill_mid_forward":
            print(f"rank {rank}: last words before SIGKILL", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def peer_fault(fault: str, timeout_s: float) -> dict:
    """Train the MLP at stage 3 where rank 1 fails in step 2: ``"sigkill_mid_forward"`` (killed between its layers)
    or ``"raise_in_loss"`` (an exception after forward, before backward). The other ranks return what they raised
    and how long after the start of step 2."""
    import time

    rank, world = rank_and_world()
    model = _FaultyMLP((1, 2, fault))
    backend = fxshard.backend(compiler="eager", stage=3, collective_timeout_s=timeout_s)
    model, opt = backend.prepare(model, make_optimizer("sgd", model.parameters()))
    run = torch.compile(model, backend=backend)
    generator = torch.Generator().manual_seed(rank)
    for step in range(1, 4):
        start = time.monotonic()
        try:
            inputs, targets = global_batch("mlp", PER_RANK_BATCH, generator)
            loss = F.mse_loss(run(inputs), targets)
            if (rank, step, fault) == (1, 2, "raise_in_loss"):
                raise ValueError("rank 1's loss could not be computed")
            loss.backward()
            opt.step()
            opt.zero_grad()
        except Exception as error:
            if rank == 1:
                raise
            return {"step": step, "error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - start}
    return {"step": None}


def worker_threads_of_groups() -> dict:
    """Gloo worker threads of the user's group and of the group a prepared model's collectives name."""
    from fxshard.runtime.groups import gloo_worker_threads
    from fxshard.runtime.param import spec_of

    model = build_model("mlp")
    fxshard.backend(compiler="eager", stage=3).prepare(model)
    return {"user": gloo_worker_threads(torch.distributed.group.WORLD.group_name),
            "fxshard": gloo_worker_threads(spec_of(model.fc1._parameters["weight"]).group_name)}


def sleep_on_rank(sleeper: int, seconds: float) -> str:
    """Rank ``sleeper`` sleeps ``seconds`` (past a pool's timeout), the others return at once."""
    import time

    rank, _ = rank_and_world()
    if rank == sleeper:
        time.sleep(seconds)
    return f"rank {rank} returned"


def abort_once(marker: str) -> str:
    """Rank 1 aborts (SIGABRT, as glibc's heap checks do) unless ``marker`` exists, which it creates first: a pool
    that ran the function again after the death would see every rank return."""
    import os

    rank, _ = rank_and_world()
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        print("rank 1: last words before SIGABRT", flush=True)
        os.abort()
    return f"rank {rank} returned"


def _group_name_of(node: torch.fx.Node) -> str:
    """The process group a functional collective node names (its ``group_name`` argument)."""
    names = [argument.name for argument in node.target._schema.arguments]
    return {**dict(zip(names, node.args)), **node.kwargs}["group_name"]


class _CollectiveGroups(TorchDispatchMode):
    """Records the group of every functional collective run under it (the optimizer step's run eagerly)."""

    def __init__(self):
        super().__init__()
        self.groups: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "_c10d_functional" and func._schema.name != "_c10d_functional::wait_tensor":
            names = [argument.name for argument in func._schema.arguments]
            self.groups.append({**dict(zip(names, args)), **kwargs}["group_name"])
        return func(*args, **kwargs)


def worker_threads_of_every_collective(stages=(2, 3)) -> dict:
    """Per stage, the gloo worker threads of the group of every collective fxshard ran in one training step of
    the MLP with prefetch: the compiled graphs' (``backend.graphs``) and the optimizer step's, and how many of each
    there were; and the user's group's threads."""
    from fxshard.runtime.groups import gloo_worker_threads
    from fxshard.runtime.collectives import COLLECTIVE_ROLES

    rank, _ = rank_and_world()
    found = {"user": gloo_worker_threads(torch.distributed.group.WORLD.group_name)}
    for stage in stages:
        torch._dynamo.reset()
        model = build_model("mlp")
        backend = fxshard.backend(compiler="eager", stage=stage, prefetch=1)
        model, opt = backend.prepare(model, make_optimizer("sgd", model.parameters()))
        inputs, targets = global_batch("mlp", PER_RANK_BATCH, torch.Generator().manual_seed(rank))
        F.mse_loss(torch.compile(model, backend=backend)(inputs), targets).backward()
        in_graphs = [_group_name_of(node) for record in backend.graphs if record.final is not None
                     for node in record.final.graph.nodes
                     if node.meta.get("fxshard", {}).get("role") in COLLECTIVE_ROLES]
        with _CollectiveGroups() as step:
            opt.step()
        found[stage] = {
            "graph collectives": len(in_graphs),
            "graph threads": sorted({gloo_worker_threads(name) for name in in_graphs}),
            "step collectives": len(step.groups),
            "step threads": sorted({gloo_worker_threads(name) for name in step.groups}),
        }
    return found


def example_output(example: str, argv: list[str]) -> str:
    """What ``examples/<example>.py``'s ``train`` prints on this rank, run with ``argv`` on this pool's ranks (the
    example's own launch paths, torchrun and spawning, are tested by running the scripts)."""
    import importlib
    import io

    module = importlib.import_module(f"examples.{example}")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        module.train(module.parse_args(argv))
    return printed.getvalue()


class TwoScales(torch.nn.Module):
    """``a · x1 + b · x2``, summed: a large ``x2`` overflows ``b``'s gradient alone, where ``x2`` is large."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.full((16,), 0.01))
        self.b = torch.nn.Parameter(torch.full((16,), 0.01))

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        return (self.a * x1).sum() + (self.b * x2).sum()


def _scaled_sgd_step(scaler, optimizer, module, x1: torch.Tensor, x2: torch.Tensor) -> float:
    """One loss-scaled step on the mean loss of these rows (averaged over ranks, a rank's mean is the global one);
    the scale after it."""
    scaler.scale(module(x1, x2) / len(x1)).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return scaler.get_scale()


def train_with_grad_scaler(stage: int, scaler_class: str, steps: int = 3) -> dict:
    """Loss scaling with torch's ``GradScaler`` or ``ShardedGradScaler`` (``scaler_class``) beside one process with
    a GradScaler on the whole batch. In the first step the last rank's slice overflows the first half of ``b``'s
    gradient: at stage 1 only that rank's gradients hold the inf, after a reduce-scatter (stages 2, 3) only the rank
    holding that half. Returns each step's scale and both models' parameters."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    scaler_of = {"GradScaler": torch.amp.GradScaler, "ShardedGradScaler": ShardedGradScaler}[scaler_class]
    rank, world = rank_and_world()
    model, reference = TwoScales(), TwoScales()
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    backend = fxshard.backend(compiler="eager", stage=stage)
    model, opt = backend.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = scaler_of("cpu", init_scale=1024.0)
    run = torch.compile(model, backend=backend, fullgraph=True)
    scales, reference_scales = [], []
    local = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
    for step in range(steps):
        x1 = torch.randn(world * PER_RANK_BATCH, 16, generator=torch.Generator().manual_seed(step))
        x2 = x1.flip(0)
        if step == 0:
            x2[-PER_RANK_BATCH:, :8] = 1e38
        scales.append(_scaled_sgd_step(scaler, opt, run, x1[local], x2[local]))
        reference_scales.append(_scaled_sgd_step(reference_scaler, reference_opt, reference, x1, x2))
    return {"scales": scales, "reference_scales": reference_scales, "final": full_state(model),
            "expected": reference.state_dict()}


def decay_groups_by_ndim(stage: int, steps: int = 3) -> dict:
    """The nanoGPT / HuggingFace weight-decay rule (a parameter of 2 or more dimensions decays, the rest not) applied
    to what prepare left of an MLP with a learned 0-d temperature: at stages 0 and 3 the optimizer is built after
    prepare, as an FSDP2 script builds it after ``fully_shard``; at stages 1 and 2, whose communication runs in the
    prepared optimizer's step, before prepare and passed to it. Trained beside a single process with the same rule; also returns, after the first backward,
    whether every gradient has its parameter's shape and each parameter's gradient norm (what a script logs)."""
    from torch.distributed.tensor import DTensor

    rank, world = rank_and_world()
    model = build_model("mlp_temperature")
    reference = copy.deepcopy(model)
    initial = {k: v.clone() for k, v in reference.state_dict().items()}

    def grouped(module: torch.nn.Module) -> torch.optim.Optimizer:
        named = list(module.named_parameters())
        return torch.optim.SGD([{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": 0.5},
                                {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}],
                               lr=LR["sgd"], momentum=0.9)

    backend = fxshard.backend(stage=stage, compiler="eager")
    if stage in (0, 3):
        model, _ = backend.prepare(model)
        opt = grouped(model)
    else:
        model, opt = backend.prepare(model, grouped(model))
    decayed = sorted(n for n, p in model.named_parameters() if any(p is q for q in opt.param_groups[0]["params"]))
    reference_opt = grouped(reference)
    run = torch.compile(model, backend=backend, fullgraph=True)
    generator = torch.Generator().manual_seed(1)
    for step in range(steps):
        batch = global_batch("mlp_uneven", world * PER_RANK_BATCH, generator)
        local = tuple(t[rank * PER_RANK_BATCH : (rank + 1) * PER_RANK_BATCH] for t in batch)
        loss_of("mlp_uneven", run, local).backward()
        loss_of("mlp_uneven", reference, batch).backward()
        if step == 0:
            grads_shaped = all(p.grad.shape == p.shape for p in model.parameters())
            # as an FSDP2 script logs it: a DTensor norm (stages 2, 3) is this rank's part until full_tensor()
            reference_grad_norms = {n: p.grad.norm().item() for n, p in reference.named_parameters()}
            grad_norms = {n: (norm.full_tensor() if isinstance(norm := p.grad.norm(), DTensor) else norm).item()
                          for n, p in model.named_parameters()}
        opt.step()
        if step == 0:  # what a script logs after the step finds every gradient still there, as under DDP
            grads_kept = all(p.grad is not None for p in model.parameters())
        opt.zero_grad()
        reference_opt.step()
        reference_opt.zero_grad()
    return {"initial": initial, "final": full_state(model), "expected": reference.state_dict(), "decayed": decayed,
            "grads_kept": grads_kept,
            "expected_decayed": sorted(n for n, p in reference.named_parameters() if p.ndim >= 2),
            "grads_shaped": grads_shaped, "grad_norms": grad_norms, "reference_grad_norms": reference_grad_norms}


def skip_a_step_on_one_rank(stage: int, build_optimizer_after_prepare: bool = False, steps: int = 3) -> dict:
    """Train the MLP where rank 1 skips ``optimizer.step()`` in step 1 (as a script that steps only when its own
    loss looks finite would); returns the step each rank raised in and its FxShardError, or no step. At stages 0
    and 3 the optimizer may be built after prepare (``build_optimizer_after_prepare``), as FSDP2 scripts do."""
    rank, _ = rank_and_world()
    model = build_model("mlp")
    backend = fxshard.backend(compiler="eager", stage=stage)
    if build_optimizer_after_prepare:
        model, _ = backend.prepare(model)
        opt = make_optimizer("sgd", model.parameters())
    else:
        model, opt = backend.prepare(model, make_optimizer("sgd", model.parameters()))
    run = torch.compile(model, backend=backend)
    generator = torch.Generator().manual_seed(rank)
    for step in range(steps):
        try:
            inputs, targets = global_batch("mlp", PER_RANK_BATCH, generator)
            F.mse_loss(run(inputs), targets).backward()
            if (rank, step) != (1, 1):
                opt.step()
            opt.zero_grad()
        except fxshard.FxShardError as error:
            return {"step": step, "error": str(error)}
    return {"step": None}
