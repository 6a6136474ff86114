"""Tensor parallelism beside fxshard, on 4 gloo ranks as a (dp=2, tp=2) mesh: functions every rank of a WorkerPool
runs. The tensor-parallel plans are torchtitan's: Colwise into a block, Rowwise out of it, and for the Llama also
sequence and loss parallelism."""

from __future__ import annotations

import contextlib
import copy

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fxshard
from examples.models import LlamaConfig, LlamaForCausalLM
from fxshard import budget
from fxshard.runtime.collectives import collective_of
from fxshard.report.measure import CollectiveCounter
from scenarios import (
    PER_RANK_BATCH,
    build_model,
    full_state,
    global_batch,
    loss_of,
    make_optimizer,
    step_the_reference,
)

MESH = (2, 2)  # (dp, tp)


def _llama_plan(model, sequence_parallel: bool = False, loss_parallel: bool = False) -> dict:
    """torchtitan's plan: Colwise into attention and the MLP, Rowwise out of them; with ``sequence_parallel`` the
    embedding, the norms and the residual stream split by sequence (``SequenceParallel``), and with
    ``loss_parallel`` the LM head's logits stay split by vocabulary into the loss."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    sequence = Shard(1) if sequence_parallel else Replicate()
    plan = {}
    if sequence_parallel:
        plan["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=sequence)
        plan["norm"] = SequenceParallel()
        plan["lm_head"] = ColwiseParallel(input_layouts=sequence,
                                          output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                          use_local_output=not loss_parallel)
    for i, _ in enumerate(model.layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel(output_layouts=sequence)
        if sequence_parallel:
            plan[f"layers.{i}.input_layernorm"] = SequenceParallel()
            plan[f"layers.{i}.post_attention_layernorm"] = SequenceParallel()
            plan[f"layers.{i}.self_attn"] = PrepareModuleInput(input_layouts=(sequence, None, None),
                                                               desired_input_layouts=(Replicate(), None, None))
            plan[f"layers.{i}.mlp"] = PrepareModuleInput(input_layouts=(sequence,),
                                                         desired_input_layouts=(Replicate(),))
    return plan


# the Llama under torchtitan's plan: "llama" Colwise / Rowwise only, "llama_sp" with sequence parallelism,
# "llama_lp" with sequence and loss parallelism
LLAMAS = {"llama": {}, "llama_sp": {"sequence_parallel": True},
          "llama_lp": {"sequence_parallel": True, "loss_parallel": True}}


def _model(name: str) -> torch.nn.Module:
    if name in LLAMAS:
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig())
    return build_model(name)


def _plan(name: str, model) -> dict:
    if name in LLAMAS:
        return _llama_plan(model, **LLAMAS[name])
    return {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


def _parallel_loss(name: str):
    """Around forward and backward: ``loss_parallel()`` where the logits stay split by vocabulary."""
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel() if LLAMAS.get(name, {}).get("loss_parallel") else contextlib.nullcontext()


def _batch(name: str, size: int, generator: torch.Generator):
    if name in LLAMAS:
        config = LlamaConfig()
        tokens = torch.randint(config.vocab_size, (size, 9), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]
    return global_batch(name, size, generator)


def _loss(name: str, model, batch) -> torch.Tensor:
    if name in LLAMAS:
        return model(*batch)
    return loss_of(name, model, batch)


def layout_of(value) -> tuple:
    """How a state dict holds one tensor: (placements, mesh dimension names, local shape), or ("plain", shape)."""
    if isinstance(value, DTensor):
        return tuple(str(p) for p in value.placements), value.device_mesh.mesh_dim_names, tuple(value.to_local().shape)
    return "plain", tuple(value.shape)


def _meshes(shape: tuple[int, ...]):
    """A (dp, tp) or (replicate, shard, tp) mesh, the slice the data-parallel sharding takes, and this rank's place
    on it (which slice of each global batch it trains on)."""
    if len(shape) == 2:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        dp_mesh = mesh["dp"]
    else:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard", "tp"))
        dp_mesh = mesh["replicate", "shard"]
    dp_rank = 0
    for coordinate, size in zip(dp_mesh.get_coordinate(), dp_mesh.shape):
        dp_rank = dp_rank * size + coordinate
    return mesh, dp_mesh, dp_rank


def train_against_reference(model_name: str, optimizer: str, stage: int | None, steps: int = 3,
                            clip: float | None = None, mesh_shape: tuple[int, ...] = MESH, born: str = "cpu",
                            micro_batches: int = 1, param_dtype: torch.dtype | None = None) -> dict:
    """A model made tensor-parallel over "tp" (``parallelize_module``) and prepared over the data-parallel
    dimension(s) at ``stage`` (None: FSDP2's ``fully_shard`` over them instead, eager), trained on its dp rank's
    slice of each global batch beside one process on the whole batch; both models' full parameters, the clip norms,
    the graphs compiled, how the state dicts hold each tensor, and the bytes of the last step's collectives,
    measured and the ledger's. ``born="meta"``: fxshard's model is built on the meta device and initialised by
    prepare (one module at a time, each tp rank keeping its piece) from the reference's seed. ``micro_batches``:
    each rank's slice is split into that many, accumulated under ``backend.no_sync``. ``param_dtype``: mixed
    precision, gradients reduced in fp32 (FSDP2: its ``MixedPrecisionPolicy`` of the same dtypes)."""
    mesh, dp_mesh, dp_rank = _meshes(mesh_shape)
    dp = dp_mesh.size()
    model = _model(model_name)
    reference = copy.deepcopy(model)
    initial = {k: v.clone() for k, v in reference.state_dict().items()}
    reference_opt = make_optimizer(optimizer, reference.parameters())
    if stage is None:
        model, opt = _fsdp2_with_tensor_parallel(model_name, mesh, dp_mesh, optimizer, param_dtype)
        backend, run = None, model
    else:
        model, opt, run, backend = _fxshard_with_tensor_parallel(model_name, mesh, dp_mesh, stage, optimizer, born,
                                                                 param_dtype)
    generator = torch.Generator().manual_seed(1)
    norms, reference_norms = [], []
    for i in range(steps):
        batch = _batch(model_name, dp * PER_RANK_BATCH, generator)
        local = tuple(t[dp_rank * PER_RANK_BATCH : (dp_rank + 1) * PER_RANK_BATCH] for t in batch)
        with CollectiveCounter() if i == steps - 1 else contextlib.nullcontext() as counter:
            micro = [tuple(t.chunk(micro_batches)[m] for t in local) for m in range(micro_batches)]
            for m, piece in enumerate(micro):
                with (backend.no_sync(model) if m < micro_batches - 1 else contextlib.nullcontext(),
                      _parallel_loss(model_name)):
                    (_loss(model_name, run, piece) / micro_batches).backward()
            if clip is not None:
                norms.append(backend.clip_grad_norm_(clip).item() if backend else
                             torch.nn.utils.clip_grad_norm_(model.parameters(), clip).full_tensor().item())
            opt.step()
        opt.zero_grad()
        step_the_reference(_loss(model_name, reference, batch), reference, reference_opt, clip, reference_norms)
    return {
        "initial": initial,
        "final": full_state(model),
        "expected": reference.state_dict(),
        "norms": norms,
        "reference_norms": reference_norms,
        "compiled_graphs": sorted({(r.graph_id, r.kind) for r in backend.graphs}) if backend else [],
        "measured": {kind: totals["bytes"] for kind, totals in counter.totals().items()},
        "ledger": _ledger_bytes(backend) if backend else {},
        "report": backend.report() if backend else "",
        "dtensor_collective_threads": _dtensor_collective_threads(backend) if backend else [],
        "forward_collectives": [n.name for r in (backend.graphs if backend else []) if r.kind == "forward"
                                for n in r.final.graph.nodes if str(n.target).startswith("_c10d_functional.")],
        "model_layout": {k: layout_of(v) for k, v in model.state_dict().items()},
        "optimizer_layout": {k: layout_of(v) for k, v in opt.state_dict()["state"][0].items()},
    }


def _ledger_bytes(backend) -> dict:
    """The bytes the ledger says each kind of collective takes per step."""
    ledger = budget.ledger(backend)
    return {kind: ledger.at(ledger.communicated(kind)) for kind in ("all_gather", "reduce_scatter", "all_reduce")
            if ledger.select("comm", kind)}


def _dtensor_collective_threads(backend) -> list:
    """The gloo worker threads of each group the compiled graphs' collectives that are not fxshard's run on."""
    from fxshard.runtime.groups import gloo_worker_threads

    return sorted({gloo_worker_threads(node.args[-1]) for record in backend.graphs
                   if record.kind in ("forward", "backward") for node in record.final.graph.nodes
                   if node.op == "call_function" and collective_of(node.target)
                   and "role" not in node.meta.get("fxshard", {})})


def _fsdp2_with_tensor_parallel(model_name: str, mesh, dp_mesh, optimizer: str = "adamw",
                                param_dtype: torch.dtype | None = None):
    """FSDP2 + TP as torchtitan builds it: parallelize_module over "tp", then fully_shard each block and the root
    over "dp"."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _model(model_name)
    model = parallelize_module(model, mesh["tp"], _plan(model_name, model))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=param_dtype and torch.float32)
    for block in (model.layers if model_name in LLAMAS else [model.fc1, model.fc2]):
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    return model, make_optimizer(optimizer, model.parameters())


def _fxshard_with_tensor_parallel(model_name: str, mesh, dp_mesh, stage: int, optimizer: str = "adamw",
                                  born: str = "cpu", param_dtype: torch.dtype | None = None):
    """The recipe of docs/tensor-parallel.md: parallelize_module over "tp", then prepare over "dp"."""
    with torch.device(born):
        model = _model(model_name)
    model = parallelize_module(model, mesh["tp"], _plan(model_name, model))
    precision = {} if param_dtype is None else {"param_dtype": param_dtype, "reduce_dtype": torch.float32}
    backend = fxshard.backend(stage=stage, compiler="eager", mesh=dp_mesh, **precision)
    torch.manual_seed(0)  # where a meta-born model's initialisation draws from, as the reference's did
    model, opt = backend.prepare(model, make_optimizer(optimizer, model.parameters()))
    return model, opt, torch.compile(model, backend=backend, fullgraph=True), backend


def _train(model_name: str, mesh, run, opt, generator: torch.Generator, steps: int) -> None:
    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    for _ in range(steps):
        batch = _batch(model_name, dp * PER_RANK_BATCH, generator)
        with _parallel_loss(model_name):
            _loss(model_name, run, tuple(t[dp_rank * PER_RANK_BATCH : (dp_rank + 1) * PER_RANK_BATCH] for t in batch)
                  ).backward()
        opt.step()
        opt.zero_grad()


def checkpoints_between_fxshard_and_fsdp2(model_name: str, stage: int, directory: str) -> dict:
    """Each side trains 2 AdamW steps and saves (fxshard: ``fxshard.checkpoint.save``; FSDP2: torch's
    ``get_state_dict`` and ``dcp.save``); the other side loads that checkpoint its own way and trains 2 more steps
    beside the saving side going on: the full parameters each pair ends with."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from fxshard import checkpoint

    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("dp", "tp"))
    fsdp2, fsdp2_opt = _fsdp2_with_tensor_parallel(model_name, mesh, mesh["dp"])
    generator = torch.Generator().manual_seed(1)
    _train(model_name, mesh, fsdp2, fsdp2_opt, generator, 2)
    fsdp2_saved = f"{directory}/fsdp2"
    dcp.save(dict(zip(("model", "optim"), get_state_dict(fsdp2, fsdp2_opt))), checkpoint_id=fsdp2_saved)
    at_save = full_state(fsdp2)
    ahead = generator.get_state()
    _train(model_name, mesh, fsdp2, fsdp2_opt, generator, 2)
    model, opt, run, _ = _fxshard_with_tensor_parallel(model_name, mesh, mesh["dp"], stage)
    checkpoint.load(model, opt, fsdp2_saved)
    _train(model_name, mesh, run, opt, torch.Generator().set_state(ahead), 2)
    fxshard_from_fsdp2 = (full_state(model), full_state(fsdp2))

    model, opt, run, _ = _fxshard_with_tensor_parallel(model_name, mesh, mesh["dp"], stage)
    generator = torch.Generator().manual_seed(1)
    _train(model_name, mesh, run, opt, generator, 2)
    fxshard_saved = checkpoint.save(model, opt, f"{directory}/fxshard_stage_{stage}")
    ahead = generator.get_state()
    _train(model_name, mesh, run, opt, generator, 2)
    fsdp2, fsdp2_opt = _fsdp2_with_tensor_parallel(model_name, mesh, mesh["dp"])
    template = dict(zip(("model", "optim"), get_state_dict(fsdp2, fsdp2_opt)))
    dcp.load(template, checkpoint_id=fxshard_saved)
    set_state_dict(fsdp2, fsdp2_opt, model_state_dict=template["model"], optim_state_dict=template["optim"])
    _train(model_name, mesh, fsdp2, fsdp2_opt, torch.Generator().set_state(ahead), 2)
    return {"fxshard_from_fsdp2": fxshard_from_fsdp2, "fsdp2_from_fxshard": (full_state(fsdp2), full_state(model)),
            "at_save": at_save}


def checkpoints_between_tensor_parallel_and_plain(stage: int, directory: str) -> dict:
    """A checkpoint of the (dp=2, tp=2) model, trained 2 steps and saved with ``fxshard.checkpoint.save``, loads into
    the plain model prepared over all 4 ranks (dp=4, no TP); one of that plain model, trained 2 steps further,
    loads back into a fresh (dp=2, tp=2) model. The full parameters and optimizer states on each side."""
    from fxshard import checkpoint

    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("dp", "tp"))
    model, opt, run, backend = _fxshard_with_tensor_parallel("mlp", mesh, mesh["dp"], stage)
    _train("mlp", mesh, run, opt, torch.Generator().manual_seed(1), 2)
    saved = checkpoint.save(model, opt, f"{directory}/tensor_parallel")
    plain_backend = fxshard.backend(stage=stage, compiler="eager")
    plain = _model("mlp")
    plain, plain_opt = plain_backend.prepare(plain, make_optimizer("adamw", plain.parameters()))
    checkpoint.load(plain, plain_opt, saved)
    result = {"saved": _full(model, backend), "loaded_plain": _full(plain, plain_backend)}
    generator = torch.Generator().manual_seed(7)
    for _ in range(2):
        loss_of("mlp", plain, global_batch("mlp", PER_RANK_BATCH, generator)).backward()
        plain_opt.step()
        plain_opt.zero_grad()
    saved_plain = checkpoint.save(plain, plain_opt, f"{directory}/plain")
    again, again_opt, _, again_backend = _fxshard_with_tensor_parallel("mlp", mesh, mesh["dp"], stage)
    checkpoint.load(again, again_opt, saved_plain)
    return {**result, "trained_plain": _full(plain, plain_backend), "loaded_back": _full(again, again_backend)}


def _full(model, backend) -> tuple[dict, dict]:
    """The model's full parameters and its optimizer's full per-element states, as one process would hold them
    (copies: a stage-0 state dict holds the parameters themselves, which training goes on changing)."""
    optimizer = backend.full_optimizer_state_dict()["state"]
    states = {(name, kind): value for name, kinds in optimizer.items()
              for kind, value in kinds.items() if torch.is_tensor(value) and value.dim()}
    return {k: v.clone() for k, v in full_state(model).items()}, states
