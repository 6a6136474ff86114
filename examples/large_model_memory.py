"""Resident memory per rank of starting a large model, three ways side by side on the same GPT (418 MiB of fp32
parameters, d=1024, 8 blocks, a tied vocabulary of 8192):

- fxshard, born sharded: built under torch.device("meta"), then backend.prepare (stage 3);
- fxshard, built whole: built on the CPU, then backend.prepare (stage 3);
- FSDP2: built under torch.device("meta"), fully_shard per block and the root, to_empty, reset_parameters.

Each rank reports the peak of its resident set (VmHWM, reset before the start) above where it began, beside the
ledger's prepare peak (``backend.report()``'s "prepare peak" line, read after one compiled step); every way runs in
fresh processes.

    python examples/large_model_memory.py --world-size 4
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import pathlib
import sys

import torch
import torch.distributed as dist
from tabulate import tabulate

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import fxshard  # noqa: E402
from examples.launch import refuse_torchrun, run_ranks  # noqa: E402
from examples.models import GPT, GPTConfig, gpt_batch  # noqa: E402

LARGE = GPTConfig(vocab_size=8192, block_size=64, n_layer=8, n_head=16, d_model=1024, gpt2_init=False)
WAYS = ("fxshard born sharded", "fxshard built whole", "FSDP2 meta + to_empty")
MIB = 2**20


def resident_peak() -> int:
    """This process's peak resident set, in bytes (Linux: VmHWM)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def reset_resident_peak() -> int:
    """Free what earlier work left (a prepared model lives in reference cycles until the collector runs), hand the
    heap's free memory back to the system (glibc's malloc_trim: it would otherwise be reused without growing the
    resident set) and make the peak resident set the current one (Linux: clear_refs 5); returns it."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    return resident_peak()


def start(way: str, stage: int = 3):
    """Build LARGE and prepare it ``way`` (a name of WAYS); the backend (None for FSDP2) and the model."""
    # The grouping does not change what prepare holds; "layer" compiles the step the ledger reads without the
    # autotuner's trials of every grouping.
    backend = fxshard.backend(stage=stage, compiler="eager", bucket="layer")
    if way == "fxshard built whole":
        return backend, backend.prepare(GPT(LARGE))[0]
    with torch.device("meta"):
        model = GPT(LARGE)
    if way == "fxshard born sharded":
        return backend, backend.prepare(model)[0]
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    for module in model.modules():
        if callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
    return None, model


def ledger_prepare_peak(backend, model) -> int:
    """The ledger's prepare peak in bytes, after one compiled forward and backward (the ledger reads the graphs)."""
    from fxshard import budget

    batch = gpt_batch(LARGE, 1, torch.Generator().manual_seed(0))
    torch.compile(model, backend=backend, fullgraph=True)(*batch).backward()
    ledger = budget.ledger(backend)
    return ledger.at(ledger.prepare_peak())


def measure(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    before = reset_resident_peak()
    backend, model = start(args.way)
    peak = resident_peak() - before
    predicted = -1 if backend is None else ledger_prepare_peak(backend, model)
    figures = torch.tensor([peak, predicted], dtype=torch.float64)
    gathered = [torch.zeros(2, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, figures)
    if dist.get_rank() == 0:
        args.out.write_text("\n".join(" ".join(str(int(x)) for x in g.tolist()) for g in gathered))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp/fxshard-large-model-peaks"))
    args = parser.parse_args()
    refuse_torchrun("large_model_memory.py")
    with torch.device("meta"):
        whole = sum(p.numel() for p in GPT(LARGE).parameters()) * 4
    rows = []
    for way in WAYS:
        run_ranks(measure, argparse.Namespace(way=way, out=args.out), args.world_size)
        ranks = [[int(x) / MIB for x in line.split()] for line in args.out.read_text().splitlines()]
        peaks, predicted = [r[0] for r in ranks], ranks[0][1]
        rows.append([way, f"{max(peaks):.0f}", f"{min(peaks):.0f}", f"{predicted:.0f}" if predicted >= 0 else "-"])
    print(f"parameters {whole / MIB:.0f} MiB, share per rank {whole / args.world_size / MIB:.0f} MiB, "
          f"world {args.world_size}")
    print(tabulate(rows, headers=["start", "peak MiB (max rank)", "peak MiB (min rank)", "ledger's prepare peak"]))


if __name__ == "__main__":
    main()
