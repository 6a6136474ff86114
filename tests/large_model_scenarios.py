"""Rank functions of tests/test_large_models.py (module level, so that WorkerPool ranks import them)."""

import ctypes

import torch

import fxshard
from examples.large_model_memory import LARGE, reset_resident_peak, resident_peak, start
from examples.models import GPT, GPTConfig
from fxshard.runtime.param import prepared_param, spec_of
from fxshard.runtime.sharding import shard_of
from fxshard.testing import rank_and_world

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
PLAIN = GPTConfig(gpt2_init=False)  # torch's per-layer init: per module, in module order


def prepare_a_large_model_on_meta(stage: int) -> dict:
    """Build examples/large_model_memory.py's LARGE GPT on the meta device, prepare it at ``stage`` (ranks seeded
    apart: prepare takes the first rank's random state) and measure the resident peak it took; then compare this
    rank's shards with a normal CPU build of the same seed, bit for bit."""
    rank, world = rank_and_world()
    # The pool's ranks ran other tests before: with glibc's mmap threshold fixed at 1 MiB every large tensor is a
    # mapping of its own, so the peak is prepare's, not that of holes earlier work left in the heap.
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 2**20)
    before = reset_resident_peak()
    torch.manual_seed(1234 if rank == 0 else 99)
    _, model = start("fxshard born sharded", stage)
    peak = resident_peak() - before
    held = {name: prepared_param(p).flat if prepared_param(p).flat is not None else p  # stages 2, 3: the flat shard
            for name, p in model.named_parameters()}
    torch.manual_seed(1234)
    reference = GPT(LARGE)
    mismatched = []
    for name, full in reference.named_parameters():
        spec = spec_of(held[name])
        expected = shard_of(full, spec) if spec.trains_shard else full
        if not torch.equal(held[name], expected):
            mismatched.append(name)
    return {"peak": peak, "mismatched": mismatched, "whole": sum(p.numel() for p in reference.parameters()) * 4}


def train_born_on_meta_and_built(stage: int, steps: int = 3, mesh_shape: tuple | None = None,
                                 compiled: bool = True) -> dict:
    """The plain GPT trained ``steps`` AdamW steps twice (on a hybrid mesh of ``mesh_shape``; ``compiled=False``: the
    prepared model run eagerly): built on the meta device (the optimizer built over the meta parameters, as FSDP2
    users write it) and built normally; the losses of each step."""
    from examples.models import gpt_batch

    rank, _ = rank_and_world()
    losses = {}
    for born in ("meta", "cpu"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        backend, model, opt = _gpt_on(born, stage, mesh_shape=mesh_shape)
        run = torch.compile(model, backend=backend, fullgraph=True) if compiled else model
        generator = torch.Generator().manual_seed(rank)
        losses[born] = []
        for _ in range(steps):
            loss = run(*gpt_batch(PLAIN, 4, generator))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[born].append(loss.item())
    return losses



def _tiny_gpt2(n_embd: int = 32):
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=n_embd, n_head=2, n_positions=16, vocab_size=64, bos_token_id=0, eos_token_id=0))


def _meta_gpt2(stage: int):
    with torch.device("meta"):
        model = _tiny_gpt2()
    model, _ = fxshard.backend(compiler="eager", stage=stage).prepare(model, param_init_fn=model._init_weights)
    return model


def _full(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from fxshard.checkpoint import get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def huggingface_round_trip(directory: str, stage: int) -> dict:
    """A GPT-2 saved by ``save_pretrained`` loads into a meta-born prepared model; exported consolidated, it loads
    back with ``from_pretrained``; exported sharded, into another meta-born model; other models' checkpoints are
    refused before anything changes."""
    import pathlib

    import torch.distributed as dist
    import transformers

    from fxshard.checkpoint import load_huggingface, save_huggingface

    root = pathlib.Path(directory)
    rank, _ = rank_and_world()
    torch.manual_seed(5)
    source = _tiny_gpt2()
    if rank == 0:
        source.save_pretrained(root / "source")
        _tiny_gpt2(n_embd=48).save_pretrained(root / "wider")
    dist.barrier()
    expected = {k: v for k, v in source.state_dict().items()}
    model = _meta_gpt2(stage)
    load_huggingface(model, root / "source")
    loaded = _full(model)
    save_huggingface(model, root / "consolidated")
    save_huggingface(model, root / "sharded", consolidated=False)
    reread = transformers.GPT2LMHeadModel.from_pretrained(root / "consolidated").state_dict()
    again = _meta_gpt2(stage)
    load_huggingface(again, root / "sharded")
    before = _full(again)
    errors = []
    for bad in ("wider", "missing"):
        try:
            load_huggingface(again, root / bad)
        except fxshard.FxShardError as error:
            errors.append(str(error))
    unchanged = all(torch.equal(v, before[k]) for k, v in _full(again).items())
    mismatched = [k for k, v in expected.items() if not (torch.equal(loaded[k], v) and torch.equal(reread[k], v)
                                                          and torch.equal(before[k], v))]
    return {"mismatched": mismatched, "errors": errors, "unchanged": unchanged,
            "files": sorted(p.name for p in (root / "consolidated").iterdir())}


def _gpt_on(born: str, stage: int, config: GPTConfig = PLAIN, mesh_shape: tuple | None = None):
    """A GPT of ``config`` built on ``born`` ("meta" or "cpu") and prepared at ``stage`` (on a hybrid mesh of
    ``mesh_shape``), with AdamW built over its parameters before prepare: (backend, model, optimizer)."""
    from scenarios import hybrid_mesh

    with torch.device(born):
        model = GPT(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    backend = fxshard.backend(compiler="eager", stage=stage, mesh=hybrid_mesh(mesh_shape))
    model, opt = backend.prepare(model, opt)
    return backend, model, opt


def _full_optimizer(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from fxshard.checkpoint import get_optimizer_state_dict

    return get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))


def save_a_trained_gpt(directory: str, stage: int) -> dict:
    """The plain GPT built whole, trained one compiled step and saved with ``fxshard.checkpoint.save``; its full
    model and optimizer state."""
    from examples.models import gpt_batch
    from fxshard.checkpoint import save

    rank, _ = rank_and_world()
    torch._dynamo.reset()
    torch.manual_seed(0)
    backend, model, opt = _gpt_on("cpu", stage)
    batch = gpt_batch(PLAIN, 4, torch.Generator().manual_seed(rank))
    torch.compile(model, backend=backend, fullgraph=True)(*batch).backward()
    opt.step()
    save(model, opt, f"{directory}/step-1")
    return {"model": _full(model), "optim": _full_optimizer(model, opt)}


def load_into_a_meta_born_gpt(directory: str, stage: int) -> dict:
    """A meta-born GPT, prepared (its optimizer not stepped yet), loads the checkpoint ``save_a_trained_gpt``
    wrote; a meta-born GPT of another width refuses it and keeps its values. Full states and the refusal."""
    from fxshard.checkpoint import load

    torch.manual_seed(1)
    _, model, opt = _gpt_on("meta", stage)
    load(model, opt, f"{directory}/step-1")
    _, wider, wider_opt = _gpt_on("meta", stage, GPTConfig(d_model=48, gpt2_init=False))
    before = _full(wider)
    try:
        load(wider, wider_opt, f"{directory}/step-1")
        error = ""
    except fxshard.FxShardError as refused:
        error = str(refused)
    unchanged = all(torch.equal(v, before[k]) for k, v in _full(wider).items())
    return {"model": _full(model), "optim": _full_optimizer(model, opt), "error": error, "unchanged": unchanged}


def load_a_sharded_export(directory: str, stage: int) -> dict:
    """``huggingface_round_trip``'s sharded export (written by other ranks) loaded into a meta-born GPT-2 here:
    the parameters that differ from the source model's."""
    from fxshard.checkpoint import load_huggingface

    torch.manual_seed(5)
    expected = _tiny_gpt2().state_dict()
    model = _meta_gpt2(stage)
    load_huggingface(model, f"{directory}/sharded")
    loaded = _full(model)
    return {"mismatched": [k for k, v in expected.items() if not torch.equal(loaded[k], v)]}
