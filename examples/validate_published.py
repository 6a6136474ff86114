"""Predict published training runs from their model configs alone, and compare (a slow check, not in ``make test``).

    python examples/validate_published.py [--link 200]

Each row is a run someone published with its measured tokens/s per GPU: the model (a config in
``examples/configs/``), the GPUs and their network, the sequences per GPU, the sequence length and the activation
checkpointing. fxshard predicts each with ``fxshard.predict.predict_from_config`` at stage 3 (FSDP over every rank)
in bf16, on a preset node of 8 GPUs (``fxshard.simulate.machines.gpu_node``) with the network the run states, or
``--link`` Gb/s per GPU where it states none. The compute efficiency (the share of the bf16 peak a transformer's
matmuls reach) is fitted once per GPU, on that GPU's first row, by the secant method; every other row is a
prediction. The table goes to docs/simulate.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

import torch
from tabulate import tabulate

from fxshard.predict import predict_from_config
from fxshard.simulate.machines import A100_80GB_SXM, GPU, H100_80GB_SXM, NODE_RANKS, Efficiency, gpu_node

CONFIGS = pathlib.Path(__file__).resolve().parent / "configs"
TORCHTITAN = "torchtitan docs/performance.md, FSDP2 on 64 A100 80GB"
IBM = "PyTorch blog 'Maximizing training throughput using PyTorch FSDP' (IBM, FSDP1)"


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    name: str
    config: str  # a file in examples/configs
    gpu: GPU
    world: int
    batch: int  # sequences per GPU
    seq: int
    ac: str
    tokens_per_s: float  # per GPU, as published
    mfu: float  # as published
    source: str
    link_gbits: float | None = None  # network Gb/s per GPU, where the run states it


# IBM states its networks per node: 400 Gb/s (A100 cluster) and 800 Gb/s (H100 cluster) between nodes of 8 GPUs
IBM_A100_LINK, IBM_H100_LINK = 400 / NODE_RANKS, 800 / NODE_RANKS

ROWS = [
    PublishedRun("Llama 3 8B, selective layer AC", "llama3_8b.json", A100_80GB_SXM, 64, 1, 8192, "selective", 2904,
                 0.568, TORCHTITAN),
    # selective op AC recomputes some ops of every layer; priced as selective layer AC, the nearest fxshard prices
    PublishedRun("Llama 3 8B, selective op AC (as layer AC)", "llama3_8b.json", A100_80GB_SXM, 64, 1, 8192,
                 "selective", 2973, 0.582, TORCHTITAN),
    PublishedRun("Llama 3 70B, full AC", "llama3_70b.json", A100_80GB_SXM, 64, 1, 8192, "full", 331, 0.517,
                 TORCHTITAN),
    PublishedRun("Llama 2 13B, no AC", "llama2_13b.json", A100_80GB_SXM, 64, 2, 4096, "none", 2162, 0.611,
                 TORCHTITAN + " (the Llama 2 table)"),
    PublishedRun("Llama 2 13B, selective layer AC", "llama2_13b.json", A100_80GB_SXM, 64, 2, 4096, "selective", 1914,
                 0.541, TORCHTITAN + " (the Llama 2 table)"),
    PublishedRun("Llama 2 70B, full AC", "llama2_70b.json", A100_80GB_SXM, 64, 2, 4096, "full", 353, 0.505,
                 TORCHTITAN + " (the Llama 2 table)"),
    # another system, another scale: 128 A100s; its 7B and 13B ran hybrid-sharded (shards inside a node), priced
    # here as FSDP over all 128; "selective" there checkpoints every n-th block, priced as every other one
    PublishedRun("IBM Llama 2 7B, no AC", "llama2_7b.json", A100_80GB_SXM, 128, 2, 4096, "none", 3700, 0.57, IBM,
                 IBM_A100_LINK),
    PublishedRun("IBM Llama 2 13B, selective AC", "llama2_13b.json", A100_80GB_SXM, 128, 2, 4096, "selective", 1800,
                 0.51, IBM, IBM_A100_LINK),
    PublishedRun("IBM Llama 2 34B, full AC", "llama2_34b.json", A100_80GB_SXM, 128, 2, 4096, "full", 700, 0.47, IBM,
                 IBM_A100_LINK),
    PublishedRun("IBM Llama 2 70B, full AC", "llama2_70b.json", A100_80GB_SXM, 128, 2, 4096, "full", 370, 0.50, IBM,
                 IBM_A100_LINK),
    # and another GPU: 96 H100s, its compute efficiency fitted on its first row
    PublishedRun("IBM Llama 2 7B, no AC, H100", "llama2_7b.json", H100_80GB_SXM, 96, 2, 4096, "none", 7500, 0.37,
                 IBM, IBM_H100_LINK),
    PublishedRun("IBM Llama 2 13B, selective AC, H100", "llama2_13b.json", H100_80GB_SXM, 96, 2, 4096, "selective",
                 3800, 0.35, IBM, IBM_H100_LINK),
    PublishedRun("IBM Llama 2 34B, full AC, H100", "llama2_34b.json", H100_80GB_SXM, 96, 2, 4096, "full", 1550, 0.32,
                 IBM, IBM_H100_LINK),
    PublishedRun("IBM Llama 2 70B, full AC, H100", "llama2_70b.json", H100_80GB_SXM, 96, 2, 4096, "full", 800, 0.34,
                 IBM, IBM_H100_LINK),
]


def predicted(run: PublishedRun, link_gbits: float, compute_efficiency: float):
    machine = gpu_node(run.gpu, run.link_gbits or link_gbits, Efficiency(compute=compute_efficiency))
    return predict_from_config(CONFIGS / run.config, world=run.world, batch=run.batch, seq=run.seq, ac=run.ac,
                               machine=machine, param_dtype=torch.bfloat16)


def fit_compute_efficiency(run: PublishedRun, link_gbits: float, tolerance: float = 0.005) -> float:
    """The compute efficiency at which ``run`` is predicted at its published tokens/s (secant, from 0.5 and 0.7)."""
    points = [(e, predicted(run, link_gbits, e).tokens_per_s) for e in (0.5, 0.7)]
    for _ in range(6):
        (e0, t0), (e1, t1) = points[-2:]
        if abs(t1 - run.tokens_per_s) <= tolerance * run.tokens_per_s or t1 == t0:
            break
        guess = min(1.0, max(0.05, e1 + (run.tokens_per_s - t1) * (e1 - e0) / (t1 - t0)))
        points.append((guess, predicted(run, link_gbits, guess).tokens_per_s))
    return points[-1][0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--link", type=float, default=200,
                        help="network Gb/s per GPU between nodes, for the runs that do not state theirs (200)")
    args = parser.parse_args()
    start = time.monotonic()
    efficiencies: dict[str, float] = {}
    table = []
    for run in ROWS:
        fitted = run.gpu.name not in efficiencies
        if fitted:
            efficiencies[run.gpu.name] = fit_compute_efficiency(run, args.link)
        prediction = predicted(run, args.link, efficiencies[run.gpu.name])
        error = prediction.tokens_per_s / run.tokens_per_s - 1
        table.append([run.name + (" (fitted)" if fitted else ""), run.world, f"{run.link_gbits or args.link:g}",
                      run.batch, run.seq, f"{run.tokens_per_s:.0f}", f"{prediction.tokens_per_s:.0f}",
                      f"{100 * error:+.1f}%", f"{100 * run.mfu:.1f}%", f"{100 * prediction.mfu:.1f}%",
                      f"{1e3 * prediction.exposed_s:.0f}"])
        print(table[-1], flush=True)
    fits = ", ".join(f"{gpu} {efficiency:.3f}" for gpu, efficiency in efficiencies.items())
    print(f"\nnodes of {NODE_RANKS}; runs that state no network at {args.link:g} Gb/s per GPU; compute efficiency "
          f"(of the bf16 peak) fitted on each GPU's first row: {fits}; {time.monotonic() - start:.0f} s")
    print(tabulate(table, headers=["run", "GPUs", "Gb/s per GPU", "batch", "seq", "published tokens/s", "predicted",
                                   "error", "published MFU", "predicted MFU", "exposed ms"], tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
