"""Predict published training runs from their model configs alone, and compare (a slow check, not in ``make test``).

    python examples/validate_published.py [--link 200] [--rows all]

Each row is a run someone published with its measured tokens/s per GPU: the model (a config in
``examples/configs/``), the GPUs, the sequences per GPU, the sequence length and the activation checkpointing.
fxshard predicts each with ``fxshard.predict.predict_from_config`` at stage 3 (FSDP) in bf16, on a preset node of 8
A100 80GB SXM (``fxshard.simulate.machines``) with a ``--link`` Gb/s network per GPU (the runs do not state theirs).
The compute efficiency (the share of the bf16 peak a transformer's matmuls reach) is fitted on the first row by the
secant method; every other row is then a prediction. The table goes to docs/simulate.md.
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
from fxshard.simulate.machines import A100_80GB_SXM, Efficiency, gpu_node

CONFIGS = pathlib.Path(__file__).resolve().parent / "configs"
TORCHTITAN = "torchtitan docs/performance.md, FSDP2 on 64 A100 80GB"


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    name: str
    config: str  # a file in examples/configs
    world: int
    batch: int  # sequences per GPU
    seq: int
    ac: str
    tokens_per_s: float  # per GPU, as published
    mfu: float  # as published
    source: str


ROWS = [
    PublishedRun("Llama 3 8B, selective layer AC", "llama3_8b.json", 64, 1, 8192, "selective", 2904, 0.568,
                 TORCHTITAN),
    # selective op AC recomputes some ops of every layer; priced as selective layer AC, the nearest fxshard prices
    PublishedRun("Llama 3 8B, selective op AC (as layer AC)", "llama3_8b.json", 64, 1, 8192, "selective", 2973,
                 0.582, TORCHTITAN),
    PublishedRun("Llama 3 70B, full AC", "llama3_70b.json", 64, 1, 8192, "full", 331, 0.517, TORCHTITAN),
    PublishedRun("Llama 2 13B, no AC", "llama2_13b.json", 64, 2, 4096, "none", 2162, 0.611,
                 TORCHTITAN + " (the Llama 2 table)"),
    PublishedRun("Llama 2 13B, selective layer AC", "llama2_13b.json", 64, 2, 4096, "selective", 1914, 0.541,
                 TORCHTITAN + " (the Llama 2 table)"),
    PublishedRun("Llama 2 70B, full AC", "llama2_70b.json", 64, 2, 4096, "full", 353, 0.505,
                 TORCHTITAN + " (the Llama 2 table)"),
]


def predicted(run: PublishedRun, link_gbits: float, compute_efficiency: float):
    machine = gpu_node(A100_80GB_SXM, link_gbits, Efficiency(compute=compute_efficiency))
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
    parser.add_argument("--link", type=float, default=200, help="network Gb/s per GPU between nodes (200)")
    args = parser.parse_args()
    start = time.monotonic()
    efficiency = fit_compute_efficiency(ROWS[0], args.link)
    table = []
    for index, run in enumerate(ROWS):
        prediction = predicted(run, args.link, efficiency)
        error = prediction.tokens_per_s / run.tokens_per_s - 1
        table.append([run.name + (" (fitted)" if index == 0 else ""), run.batch, run.seq, f"{run.tokens_per_s:.0f}",
                      f"{prediction.tokens_per_s:.0f}", f"{100 * error:+.1f}%", f"{100 * run.mfu:.1f}%",
                      f"{100 * prediction.mfu:.1f}%", f"{1e3 * prediction.exposed_s:.0f}"])
        print(table[-1], flush=True)
    print(f"\nA100 80GB SXM nodes of 8, {args.link:g} Gb/s per GPU; compute efficiency fitted on the first row: "
          f"{efficiency:.3f} of the bf16 peak; {time.monotonic() - start:.0f} s")
    print(tabulate(table, headers=["run", "batch", "seq", "published tokens/s", "predicted", "error",
                                   "published MFU", "predicted MFU", "exposed ms"], tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
