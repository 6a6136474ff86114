"""Resident memory per rank of starting a large model, three ways side by side on the same GPT (418 MiB of fp32
parameters, d=1024, 8 blocks, a tied vocabulary of 8192):

- fxshard, born sharded: built under torch.device("meta"), then backend.prepare (stage 3);
- fxshard, built whole: built on the CPU, then backend.prepare (stage 3);
- FSDP2: built under torch.device("meta"), fully_shard per block and the root, to_empty, reset_parameters.

Each rank reports the peak of its resident set (VmHWM, reset before the step) above where it started, against its
share of the parameters; every way runs in fresh processes.

    python examples/large_model_memory.py --world-size 4
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch
import torch.distributed as dist
from tabulate import tabulate

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import fxshard  # noqa: E402
from examples.launch import refuse_torchrun, run_ranks  # noqa: E402
from examples.models import GPT, GPTConfig  # noqa: E402

LARGE = GPTConfig(vocab_size=8192, block_size=64, n_layer=8, n_head=16, d_model=1024, gpt2_init=False)
WAYS = ("fxshard born sharded", "fxshard built whole", "FSDP2 meta + to_empty")
MIB = 2**20


def _resident_peak() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def _reset_resident_peak() -> int:
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    return _resident_peak()


def _start(way: str) -> None:
    torch.manual_seed(0)
    if way == "fxshard built whole":
        fxshard.backend(stage=3, compiler="eager").prepare(GPT(LARGE))
        return
    with torch.device("meta"):
        model = GPT(LARGE)
    if way == "fxshard born sharded":
        fxshard.backend(stage=3, compiler="eager").prepare(model)
        return
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    for module in model.modules():
        if callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()


def measure(args: argparse.Namespace) -> None:
    before = _reset_resident_peak()
    _start(args.way)
    peak = torch.tensor([_resident_peak() - before], dtype=torch.float64)
    peaks = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, peak)
    if dist.get_rank() == 0:
        args.out.write_text(" ".join(str(int(p.item())) for p in peaks))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp/fxshard-large-model-peaks"))
    args = parser.parse_args()
    refuse_torchrun("large_model_memory.py")
    with torch.device("meta"):
        numels = [p.numel() for p in GPT(LARGE).parameters()]
    whole = sum(numels) * 4
    rows = []
    for way in WAYS:
        run_ranks(measure, argparse.Namespace(way=way, out=args.out), args.world_size)
        peaks = [int(p) / MIB for p in args.out.read_text().split()]
        rows.append([way, f"{max(peaks):.0f}", f"{min(peaks):.0f}"])
    share = whole / args.world_size / MIB
    print(f"parameters {whole / MIB:.0f} MiB, share per rank {share:.0f} MiB, largest unit {max(numels) * 4 / MIB:.0f} "
          f"MiB, world {args.world_size}")
    print(tabulate(rows, headers=["start", "peak MiB (max rank)", "peak MiB (min rank)"]))



if __name__ == "__main__":
    main()
