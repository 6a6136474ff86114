"""A zoo of HuggingFace architectures from tiny configs, trained by fxshard under the default compiler beside torch
DDP + torch.compile on the same data and the same dropout masks (docs/training-scripts.md#models-from-the-zoo).

    python examples/model_zoo.py [--models gpt2,bert,t5,mixtral,vit] [--stages 0,1,2,3] [--steps 3]
    torchrun --standalone --nproc-per-node 2 examples/model_zoo.py

Every family keeps its default dropout (a mixture of experts, whose default is 0, gets attention dropout 0.1). Each
rank seeds its generator with its own seed before each step, in both runs, so each rank draws its own masks, as
under DDP; Dynamo's DDP graph splitting is turned off, so DDP's compiled step is one graph as fxshard's is and
Inductor draws the same masks in both. Rank 0 prints per model and stage the last loss, the largest difference of
any parameter element from DDP's, the first step's time (Dynamo, AOT, passes and Inductor) and the median of the
others. An attention key bias gets a zero gradient, so Adam steps it by rounding noise: where a stage's last bits
differ from DDP's, the difference shows there first.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import fxshard  # noqa: E402
from examples.launch import run_ranks  # noqa: E402

FAMILIES = ("gpt2", "bert", "t5", "mixtral", "vit")  # decoder, encoder, encoder-decoder, mixture of experts, vision
VOCAB = 64
SEQ = 12


def zoo_model(name: str, dropout: bool) -> nn.Module:
    """A tiny HuggingFace model of each family: ``dropout=False`` sets every dropout probability of its config to
    0, ``True`` keeps the family's defaults (a mixture of experts takes attention dropout 0.1: its default is 0)."""
    import transformers as hf

    common = {"vocab_size": VOCAB}
    if name == "gpt2":  # decoder
        config = hf.GPT2Config(n_positions=SEQ, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0,
                               **common)
        off = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
        build = hf.GPT2LMHeadModel
    elif name == "bert":  # encoder
        config = hf.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                               max_position_embeddings=SEQ, **common)
        off = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
        build = hf.BertForMaskedLM
    elif name == "t5":  # encoder-decoder
        config = hf.T5Config(d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2, decoder_start_token_id=0,
                             **common)
        off = {"dropout_rate": 0.0}
        build = hf.T5ForConditionalGeneration
    elif name == "mixtral":  # mixture of experts
        config = hf.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                  max_position_embeddings=SEQ, attention_dropout=0.1, **common)
        off = {"attention_dropout": 0.0}
        build = hf.MixtralForCausalLM
    elif name == "vit":  # vision
        # problem_type given: HuggingFace sets it in the first forward, and Dynamo recompiles for the change
        config = hf.ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                              intermediate_size=64, num_labels=5, problem_type="single_label_classification")
        off = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
        build = hf.ViTForImageClassification
    else:
        raise ValueError(name)
    if not dropout:
        for key, value in off.items():
            setattr(config, key, value)
    torch.manual_seed(0)
    return build(config).train()


def zoo_batch(name: str, size: int, generator: torch.Generator) -> dict:
    """A batch of ``size`` random examples with labels, as the family's ``forward`` takes them."""
    if name == "vit":
        return {"pixel_values": torch.randn(size, 3, 16, 16, generator=generator),
                "labels": torch.randint(0, 5, (size,), generator=generator)}
    labels = torch.randint(0, VOCAB, (size, SEQ // 2 if name == "t5" else SEQ), generator=generator)
    return {"input_ids": torch.randint(0, VOCAB, (size, SEQ), generator=generator), "labels": labels}


def _train(run, optimizer, name: str, steps: int, per_rank: int) -> tuple[list[float], list[float]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(1)
    losses, seconds = [], []
    for step in range(steps):
        batch = zoo_batch(name, per_rank * world, generator)
        local = {k: v[rank * per_rank:(rank + 1) * per_rank] for k, v in batch.items()}
        torch.manual_seed(100 * step + rank)
        start = time.perf_counter()
        loss = run(**local).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
    return losses, seconds


def compare(args: argparse.Namespace) -> None:
    import transformers

    torch._dynamo.config.ignore_logging_functions.add(transformers.utils.logging.warning_once)
    torch._dynamo.config.optimize_ddp = False  # DDP's compiled step as one graph: Inductor draws fxshard's masks
    say = print if dist.get_rank() == 0 else (lambda *a, **k: None)
    say(f"{'model':8} {'stage':>5} {'loss':>9} {'max abs diff vs DDP':>20} {'first step s':>13} {'step ms':>8}")
    for name in args.models.split(","):
        torch._dynamo.reset()
        model = zoo_model(name, dropout=True)
        ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
        ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        _, ddp_seconds = _train(torch.compile(ddp), ddp_opt, name, args.steps, args.per_rank)
        expected = {k.removeprefix("module."): v for k, v in ddp.state_dict().items()}
        say(f"{name:8} {'DDP':>5} {'':>9} {'':>20} {ddp_seconds[0]:13.1f} "
            f"{1000 * statistics.median(ddp_seconds[1:]):8.1f}")
        for stage in (int(s) for s in args.stages.split(",")):
            torch._dynamo.reset()
            prepared = copy.deepcopy(model)
            backend = fxshard.backend(stage=stage, compiler=args.compiler)
            prepared, opt = backend.prepare(prepared, torch.optim.AdamW(prepared.parameters(), lr=1e-3))
            run = torch.compile(prepared, backend=backend, fullgraph=True)
            losses, seconds = _train(run, opt, name, args.steps, args.per_rank)
            # the right form of a DDP script's `model.state_dict()` (docs/training-scripts.md#saving-the-model)
            got = get_model_state_dict(prepared, options=StateDictOptions(full_state_dict=True))
            worst = max((got[k] - v).abs().max().item() for k, v in expected.items())
            say(f"{name:8} {stage:5d} {losses[-1]:9.4f} {worst:20.2e} {seconds[0]:13.1f} "
                f"{1000 * statistics.median(seconds[1:]):8.1f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(FAMILIES))
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--per-rank", type=int, default=2, help="sequences (images) per rank per step")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--compiler", choices=fxshard.api.COMPILERS, default=fxshard.api.DEFAULT_COMPILER)
    args = parser.parse_args()
    run_ranks(compare, args, args.world_size)


if __name__ == "__main__":
    main()
