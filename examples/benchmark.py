"""Benchmark fxshard's ZeRO stages against DDP and FSDP2 on the same GPT, side by side, in one invocation.

    python examples/benchmark.py [--steps 40] [--warmup 3] [--configs ddp,fsdp2,fxshard-3-prefetch,...]
                                 [--world-size 2] [--compiler eager|inductor] [--skip-exposed]
                                 [--out benchmark-results.txt] [--trace DIR] [--layers N --d-model D]

Compile time against depth (the first step: Dynamo, AOT, fxshard's passes, Inductor), side by side with DDP +
torch.compile, in the warm-up column:

    python examples/benchmark.py --layers 24 --d-model 64 --warmup 1 --steps 3 --skip-exposed --fresh-compile-cache \
        --configs ddp+compile,fxshard-0-prefetch,fxshard-3-prefetch

Every configuration trains the same GPT (examples/models.py, ~3.7M parameters) from the same initial weights on the
same batches, on ``--world-size`` gloo ranks of this machine with one thread per rank. Each configuration runs in a
fresh set of processes (so its peak RSS is its own), one configuration after the other. Per configuration:
``--warmup`` steps (they include compilation), then ``--steps`` timed steps, each started by a barrier, then one
untimed, profiled step that counts the collectives and the memory. Unless ``--skip-exposed``, a second fresh run of
the configuration replaces every collective by a local operation with the same output shape and times the same
steps: the difference of the two medians is the communication the step does not hide.

The losses of all configurations must agree (same weights, same batches); a configuration whose loss does not, or
that fails, is reported below the table instead of in it, and the exit status is 1. docs/benchmark.md explains
each column.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import math
import os
import pathlib
import platform
import resource
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tabulate import tabulate
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter  # set_custom_* interfaces
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import fxshard  # noqa: E402
from examples.launch import refuse_torchrun  # noqa: E402
from fxshard.simulate import calibrate  # noqa: E402
from examples.models import GPT, GPTConfig  # noqa: E402
from examples.train_gpt import batches  # noqa: E402
from fxshard.passes import PassContext  # noqa: E402
from fxshard.runtime.optimizer_record import updating_optimizer  # noqa: E402

# vocab 2048 x d_model 256 embedding (tied with the LM head) + 4 blocks of 789,760 + positions and final LayerNorm
MODEL = GPTConfig(vocab_size=2048, block_size=64, n_layer=4, n_head=4, d_model=256)
LR = 1e-3
# The backend's own prefetch depth: the "prefetch" rows leave the knob alone, the "no-prefetch" rows set it to 0.
DEFAULT_PREFETCH = next(f.default for f in dataclasses.fields(PassContext) if f.name == "prefetch")

# First losses come from the same weights and batch before any update: only the order of floating-point sums
# differs. Final losses drift apart by AdamW's amplification of last-bit gradient differences (DESIGN.md), which
# stays orders of magnitude below these bounds; real bugs (e.g. a tied weight sharded twice: 0.33 relative parameter
# error after 3 steps) land far above them.
FIRST_LOSS_RTOL = 1e-5
FINAL_LOSS_RTOL = 1e-3
# Medians of the first and second half of the timed steps further apart than this: the median has not settled.
SETTLED_RTOL = 0.05


@dataclasses.dataclass(frozen=True)
class Config:
    """One row of the table. ``kind`` says how the model is made data parallel; ``options`` go to
    ``fxshard.backend(stage, **options)`` (the ``--compiler`` flag adds ``compiler``)."""

    name: str
    kind: str  # "ddp", "fsdp2" or "fxshard"
    compiled: bool = False
    stage: int | None = None
    options: dict = dataclasses.field(default_factory=dict)
    # fxshard only: communicate on the user's own gloo group (torch's two worker threads, exposed to the race of
    # docs/known-issues.md) instead of fxshard's one-thread twin, to measure what the twin costs; may kill a rank
    on_users_gloo_group: bool = False


CONFIGS = [
    Config("ddp", "ddp"),
    Config("ddp+compile", "ddp", compiled=True),
    Config("fsdp2", "fsdp2"),
    Config("fsdp2+compile", "fsdp2", compiled=True),
    *(
        config
        for stage in fxshard.api.STAGES
        for config in (
            Config(f"fxshard-{stage}-prefetch", "fxshard", compiled=True, stage=stage),
            Config(f"fxshard-{stage}-no-prefetch", "fxshard", compiled=True, stage=stage, options={"prefetch": 0}),
        )
    ),
    # one collective per module that owns parameters, instead of the default per repeated block (bucket="auto")
    *(Config(f"fxshard-{stage}-layer-buckets", "fxshard", compiled=True, stage=stage, options={"bucket": "layer"})
      for stage in (2, 3)),
    # stage 0 all-reduces per module instead of its default DDP-sized buckets (25 MiB)
    Config("fxshard-0-layer-buckets", "fxshard", compiled=True, stage=0, options={"bucket": "layer"}),
    Config("fxshard-3-prefetch-users-group", "fxshard", compiled=True, stage=3, on_users_gloo_group=True),
    # every graph compiled whole by Inductor instead of a repeated segment once (regional=False)
    *(Config(f"fxshard-{stage}-whole", "fxshard", compiled=True, stage=stage, options={"regional": False})
      for stage in (0, 3)),
    # the default knobs run op by op whatever --compiler says, to compare both compilers in one invocation
    *(Config(f"fxshard-{stage}-eager", "fxshard", compiled=True, stage=stage, options={"compiler": "eager"})
      for stage in fxshard.api.STAGES),
]
BY_NAME = {config.name: config for config in CONFIGS}


# -- measuring -----------------------------------------------------------------------------------------------------
# What gloo runs, whoever asked for it. DDP's reducer calls c10d::allreduce_ (whose tensor-list inputs the profiler
# records without shapes), FSDP2 calls c10d::_allgather_base_ / _reduce_scatter_base_, fxshard's graphs call
# _c10d_functional ops that reach c10d::*_coalesced_; all of them end in a "gloo:<collective>" event, recorded on
# gloo's worker threads with the tensor gloo actually moves. gloo has no reduce-scatter: it runs one as an
# all-reduce of the whole input and keeps its slice, and the event says so (fxshard's runs an all-to-all instead).
_C10D_KINDS = {  # c10d op -> the collective it asks for
    "c10d::allreduce_": "AR",
    "c10d::_allgather_base_": "AG",
    "c10d::allgather_": "AG",
    "c10d::allgather_into_tensor_coalesced_": "AG",
    "c10d::_reduce_scatter_base_": "RS",
    "c10d::reduce_scatter_": "RS",
    "c10d::reduce_scatter_tensor_coalesced_": "RS",
    "c10d::alltoall_base_": "RS",  # fxshard's reduce-scatter on gloo: an all-to-all, then a local sum
}
_GLOO_KINDS = {"gloo:all_reduce": "AR", "gloo:all_gather": "AG", "gloo:all_to_all": "A2A"}
_ITEM_BYTES = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4}


def count_collectives(prof: profile) -> tuple[dict[str, int], dict[str, list[int]]]:
    """From a profile: {kind: calls} asked of c10d, and {kind: [calls, bytes of the tensors]} that gloo ran."""
    asked: collections.Counter = collections.Counter()
    ran: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for event in prof.events():
        if event.name in _C10D_KINDS:
            asked[_C10D_KINDS[event.name]] += 1
        elif event.name.startswith("gloo:"):
            kind = _GLOO_KINDS.get(event.name)
            if kind is None:
                raise ValueError(f"{event.name}: a gloo collective the benchmark does not count; add it to _GLOO_KINDS")
            dtype = event.input_dtypes[0] if event.input_dtypes and event.input_dtypes[0] else "float"
            ran[kind][0] += 1
            ran[kind][1] += math.prod(event.input_shapes[0]) * _ITEM_BYTES[dtype]
    return dict(asked), dict(ran)


def ring_bytes_sent(collectives: dict[str, list[int]], world: int) -> int:
    """Bytes one rank sends in a ring implementation of the collectives gloo ran: an all-reduce of B bytes sends
    2(N-1)/N B, an all-gather of a B-byte input sends (N-1) B, an all-to-all of B bytes (N-1)/N B."""
    sent = 0.0
    for kind, (_, nbytes) in collectives.items():
        sent += {"AR": 2 * (world - 1) / world, "AG": world - 1, "A2A": (world - 1) / world}[kind] * nbytes
    return round(sent)


def peak_of_running_sum(deltas: list[int]) -> int:
    """The highest point a running sum of allocations (+) and frees (-) reaches above its start (0 if it never
    rises)."""
    peak = total = 0
    for delta in deltas:
        total += delta
        peak = max(peak, total)
    return peak


def peak_allocated_during(prof: profile) -> int:
    """Bytes the CPU allocator held at most during a ``profile_memory=True`` profile, above what it held before.

    The raw memory events (public ``prof.events()`` folds allocations into the ops that made them) carry +bytes per
    allocation and -bytes per free of a block allocated while profiling; frees of older blocks are not reported,
    which can only overstate the peak (by the old blocks a step frees: the previous step's loss, a few bytes)."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    return peak_of_running_sum([e.nbytes() for e in sorted(events, key=lambda e: e.start_ns())])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor  # FSDP2 keeps DTensors


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's parameters, buffers (fxshard stage 2's resident full copies), optimizer parameters
    (stage 1's master shards), gradients and optimizer state, each storage counted once."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p for group in updating_optimizer(optimizer).param_groups for p in group["params"]]
    tensors += [t.grad for t in tensors if t.grad is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    storages = {}
    for tensor in tensors:
        storage = _local(tensor).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def held_between_steps(config: Config, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes a rank holds when no step runs: its training state, plus DDP's gradient buckets (one flat buffer per
    bucket, covering every trainable parameter, allocated when DDP wraps the model and kept by its C++ reducer,
    where ``state_bytes`` cannot see them)."""
    held = state_bytes(model, optimizer)
    if config.kind == "ddp":
        held += sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return held


# -- collectives replaced by local operations of the same shape (the "exposed communication" runs) -----------------
# fxshard: every collective, in the compiled graphs and in the marker ops' eager implementations (stage 1's and
# 2's optimizer hooks), is a _c10d_functional op. Their kernel is registered for CompositeExplicitAutograd, so a
# CPU kernel registered here takes precedence over it for CPU tensors; fake tensors still use the Meta kernel, so
# compilation sees the real ops. The values are wrong; the shapes, the copies and the rest of the step are real.
# ``wait_tensor`` stays: with no work registered for its tensor it returns it unchanged.
def _gathered(input, group_size, group_name):
    return torch.cat([input] * group_size)


def _gathered_out(input, group_size, group_name, *, out):
    return torch.cat([input] * group_size, out=out)


def _scattered(input, reduce_op, group_size, group_name):
    return input.narrow(0, 0, input.shape[0] // group_size).clone()


def _scattered_out(input, reduce_op, group_size, group_name, *, out):
    return out.copy_(input.narrow(0, 0, input.shape[0] // group_size))


_LOCAL_COLLECTIVES = {
    "all_gather_into_tensor": _gathered,
    "all_gather_into_tensor_out": _gathered_out,
    "all_gather_into_tensor_coalesced": lambda inputs, n, group: [_gathered(x, n, group) for x in inputs],
    "reduce_scatter_tensor": _scattered,
    "reduce_scatter_tensor_out": _scattered_out,
    "reduce_scatter_tensor_coalesced": lambda inputs, op, n, group: [_scattered(x, op, n, group) for x in inputs],
    "all_to_all_single": lambda input, output_sizes, input_sizes, group: input.clone(),
    "all_reduce": lambda input, op, group: input.clone(),
    "all_reduce_": lambda input, op, group: input,
    "all_reduce_coalesced": lambda inputs, op, group: [x.clone() for x in inputs],
    "all_reduce_coalesced_": lambda inputs, op, group: inputs,
}
_local_collectives_library = None  # kept alive: dropping a torch.library.Library removes its kernels


def use_local_functional_collectives() -> None:
    """Process-wide: only in a process that runs nothing else (each configuration gets fresh processes)."""
    global _local_collectives_library
    _local_collectives_library = torch.library.Library("_c10d_functional", "IMPL")
    for name, kernel in _LOCAL_COLLECTIVES.items():
        _local_collectives_library.impl(name, kernel, "CPU")


class LocalAllGather(AllGather):
    """FSDP2's all-gather with no communication: the other ranks' slots of the output get this rank's shard (FSDP2
    copies the input into this rank's slot before it calls the all-gather; the input is a view of it)."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        slots = output_tensor.view(group.size(), -1)
        for rank in range(group.size()):
            if rank != group.rank():
                slots[rank].copy_(input_tensor.view(-1))


class LocalReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter with no communication: this rank's slice of its own gradients."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()])


# -- the configurations --------------------------------------------------------------------------------------------
def model_config(args: argparse.Namespace) -> GPTConfig:
    """The benchmark GPT, with ``--layers`` blocks and ``--d-model`` width where given."""
    return dataclasses.replace(MODEL, n_layer=args.layers or MODEL.n_layer, d_model=args.d_model or MODEL.d_model)


def build(config: Config, args: argparse.Namespace, no_comm: bool):
    """(model, optimizer, the callable a step runs, fxshard's backend or None) for ``config``, from the same initial
    weights on every rank."""
    torch.manual_seed(0)
    model = GPT(model_config(args))
    compiler = "aot_eager" if args.compiler == "eager" else "inductor"
    if config.kind == "ddp":
        model = DistributedDataParallel(model)
        if no_comm:
            model.register_comm_hook(None, noop_hook)  # torch's own "no all-reduce" hook
        run = torch.compile(model, backend=compiler) if config.compiled else model
        return model, torch.optim.AdamW(model.parameters(), lr=LR), run, None
    if config.kind == "fsdp2":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        if no_comm:
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_custom_all_gather(LocalAllGather())
                    module.set_custom_reduce_scatter(LocalReduceScatter())
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        return model, optimizer, torch.compile(model, backend=compiler) if config.compiled else model, None
    if no_comm:
        use_local_functional_collectives()
    if config.on_users_gloo_group:  # this process runs this configuration alone
        fxshard.runtime.prepare.collective_group = lambda group, timeout_s: group
    backend = fxshard.backend(config.stage, **{"compiler": args.compiler, **config.options})
    model, optimizer = backend.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    return model, optimizer, torch.compile(model, backend=backend, fullgraph=True), backend


def worker(rank: int, world: int, port: int, name: str, no_comm: bool, args, out_dir: str) -> None:
    torch.set_num_threads(1)  # the ranks share this machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    config = BY_NAME[name]
    model, optimizer, run, backend = build(config, args, no_comm)
    data = batches(model_config(args), args.batch_size, rank, world, torch.Generator().manual_seed(1))

    def train_step(inputs, targets):
        loss = run(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    times, losses = [], []
    total = args.warmup + args.steps
    for index in range(total):
        inputs, targets = next(data)
        dist.barrier()  # every step starts together: a rank's time is its own, not the other's lag
        start = time.perf_counter()
        losses.append(train_step(inputs, targets))
        times.append(time.perf_counter() - start)
        if rank == 0 and (index + 1 == args.warmup or (index + 1 - args.warmup) % 10 == 0 or index + 1 == total):
            print(f"    {name}: step {index + 1}/{total} ({sum(times):.1f} s)", file=sys.stderr, flush=True)
    mean_losses = torch.stack(losses)
    dist.all_reduce(mean_losses, op=dist.ReduceOp.AVG)

    # One more step, untimed (the profiler slows it down), for what it communicates and the memory it needs.
    inputs, targets = next(data)
    held = held_between_steps(config, model, optimizer)
    dist.barrier()
    prof = profiled(lambda: train_step(inputs, targets))
    asked, ran = count_collectives(prof)
    if args.trace and not no_comm:
        write_traces(name, prof, backend, lambda: train_step(*next(data)), world, pathlib.Path(args.trace))
    if no_comm and ran:
        raise RuntimeError(f"{name}: the run without communication still sent {ran} through gloo")
    result = {
        "times": times,
        "losses": mean_losses.tolist(),
        "asked": asked,
        "ran": ran,
        "peak_tensor_bytes": held + peak_allocated_during(prof),
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux reports KiB
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
    }
    results = [None] * world
    dist.all_gather_object(results, result)
    if rank == 0:
        pathlib.Path(out_dir, f"{name}-{no_comm}.json").write_text(json.dumps(results))
    # No process-group teardown: ProcessGroupGloo's destructor joins gloo's threads while it holds the GIL, and a
    # gloo thread waiting for the GIL then hangs it forever (seen after the profiled step).
    os._exit(0)


def profiled(step) -> profile:
    """``step()`` under the profiler: CPU ops with their inputs' shapes (what the collectives move) and every
    allocation (the peak)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True) as prof:
        step()
    return prof


def write_traces(name: str, prof, backend, step, world: int, directory: pathlib.Path) -> None:
    """Rank 0's profiled step as ``<name>-measured.json`` (torch.profiler's Chrome trace) and, for fxshard, the
    simulated step of the same graphs as ``<name>-simulated.json``, on a machine calibrated on this configuration
    (``calibrate``: a collective, it trains a few more steps). Open both in Perfetto."""
    rank = dist.get_rank()
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(directory / f"{name}-measured.json"))
    if backend is not None:
        machine = calibrate(backend=backend, step=step, steps=5, repeats=5)
        if rank == 0:
            backend.trace(directory / f"{name}-simulated.json", world=world, machine=machine)


def launch(name: str, no_comm: bool, args, out_dir: str) -> list[dict]:
    """Run one configuration on fresh processes; per rank, what ``worker`` measured."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as cache:
        if args.fresh_compile_cache:  # inherited by the spawned ranks
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        mp.spawn(worker, args=(args.world_size, port, name, no_comm, args, out_dir), nprocs=args.world_size)
    return json.loads(pathlib.Path(out_dir, f"{name}-{no_comm}.json").read_text())


def progress_line(done: int, runs: int, label: str, warmup: int, steps: int, elapsed: float) -> str:
    """What the run about to start is, after ``done`` of ``runs`` runs took ``elapsed`` seconds: "[3/8] ddp: 3 warm-up
    + 40 timed steps; elapsed 0:01:10, remaining ~0:03:30" (the runs left at the finished ones' mean)."""
    remaining = f"~{datetime.timedelta(seconds=round(elapsed / done * (runs - done)))}" if done else "?"
    return (f"[{done + 1}/{runs}] {label}: {warmup} warm-up + {steps} timed steps; elapsed "
            f"{datetime.timedelta(seconds=round(elapsed))}, remaining {remaining}")


# -- the table -----------------------------------------------------------------------------------------------------
def slowest_rank_times(per_rank: list[dict]) -> list[float]:
    """Per step, the time of its slowest rank: a data-parallel step is over when every rank is done."""
    return [max(step) for step in zip(*(r["times"] for r in per_rank))]


def median_step(per_rank: list[dict], warmup: int) -> float:
    return statistics.median(slowest_rank_times(per_rank)[warmup:])


def unsettled(times: list[float]) -> tuple[float, float] | None:
    """(median of the first half, of the second half) of the timed steps when they differ by more than
    ``SETTLED_RTOL``, else None."""
    half = len(times) // 2
    if half < 2:
        return None
    first, second = statistics.median(times[:half]), statistics.median(times[half:])
    return (first, second) if abs(first - second) > SETTLED_RTOL * min(first, second) else None


def loss_disagreements(losses: dict[str, list[float]]) -> dict[str, str]:
    """{config: why} for each configuration whose first or final loss is off the median of all configurations
    (with fewer than three, a single wrong one cannot be told apart: both are named)."""
    problems = {}
    for index, rtol, which in ((0, FIRST_LOSS_RTOL, "first"), (-1, FINAL_LOSS_RTOL, "final")):
        reference = statistics.median(curve[index] for curve in losses.values())
        for name, curve in losses.items():
            if abs(curve[index] - reference) > rtol * abs(reference):
                problems.setdefault(name, f"{which} loss {curve[index]:.6f}, median of all configs {reference:.6f} "
                                          f"(relative tolerance {rtol:g})")
    return problems


def collectives_label(asked: dict[str, int], ran: dict[str, list[int]]) -> str:
    """"9 AG + 5 RS (gloo: 9 AG + 5 AR)": the collectives asked for, and what gloo ran where that differs."""
    label = " + ".join(f"{calls} {kind}" for kind, calls in sorted(asked.items())) or "none"
    ran_label = " + ".join(f"{calls} {kind}" for kind, (calls, _) in sorted(ran.items())) or "none"
    return label if ran_label == label else f"{label} (gloo: {ran_label})"


MIB = 2**20
HEADERS = ["config", "step ms (median)", "× DDP", "exposed comm ms", "peak tensors MiB/rank", "peak RSS MiB/rank",
           "sent MiB/rank/step", "collectives/step", "warm-up s", "final loss"]


def row(name: str, real: list[dict], no_comm: list[dict] | None, ddp_median: float | None, args) -> list:
    slowest = slowest_rank_times(real)
    median = statistics.median(slowest[args.warmup:])
    exposed = "n/a" if no_comm is None else f"{1000 * (median - median_step(no_comm, args.warmup)):.0f}"
    first = real[0]  # what every rank communicates is the same
    return [
        name,
        f"{1000 * median:.0f}",
        "n/a" if ddp_median is None else f"{median / ddp_median:.2f}",
        exposed,
        f"{max(r['peak_tensor_bytes'] for r in real) / MIB:.1f}",
        f"{max(r['peak_rss'] for r in real) / MIB:.0f}",
        f"{ring_bytes_sent(first['ran'], args.world_size) / MIB:.1f}",
        collectives_label(first["asked"], first["ran"]),
        f"{sum(slowest[:args.warmup]):.1f}",
        f"{first['losses'][-1]:.4f}",
    ]


def main() -> int:
    refuse_torchrun("examples/benchmark.py")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per configuration (default 40)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first, compilation included (default 3)")
    parser.add_argument("--configs", default=",".join(BY_NAME),
                        help=f"comma-separated subset of {', '.join(BY_NAME)} (default: all)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--layers", type=int, help=f"transformer blocks (default {MODEL.n_layer}): the first step's "
                        "compile time against depth is the warm-up column with --warmup 1")
    parser.add_argument("--d-model", type=int, help=f"width (default {MODEL.d_model})")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step (default 8)")
    parser.add_argument("--compiler", choices=fxshard.api.COMPILERS, default=fxshard.api.DEFAULT_COMPILER,
                        help="fxshard's compiler (default: fxshard's, inductor); FSDP2+compile uses aot_eager with "
                        "eager, inductor with inductor")
    parser.add_argument("--fresh-compile-cache", action="store_true",
                        help="each configuration compiles with an empty Inductor cache of its own (compiled graphs, "
                             "C++ kernels), as on a machine that never compiled the model: the warm-up column is then "
                             "the whole compile time, not a read of what an earlier run left on disk")
    parser.add_argument("--skip-exposed", action="store_true",
                        help="skip the runs without communication (halves the time; exposed comm shows n/a)")
    parser.add_argument("--trace", metavar="DIR", help="write each configuration's profiled step as a Chrome trace "
                        "(DIR/<config>-measured.json) and, for fxshard, its simulated step (<config>-simulated.json)")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parents[1] / "benchmark-results.txt"))
    args = parser.parse_args()
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {', '.join(BY_NAME)}")
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the spawned ranks

    n_params = sum(p.numel() for p in GPT(model_config(args)).parameters())  # the tied embedding / LM head counted once
    header = (
        f"fxshard benchmark, {datetime.datetime.now():%Y-%m-%d %H:%M}: GPT {dataclasses.asdict(model_config(args))}, "
        f"{n_params:,} parameters, AdamW lr {LR}, {args.batch_size} x {MODEL.block_size} tokens per rank per step; "
        f"{args.world_size} gloo ranks x 1 thread on {os.cpu_count()} CPUs ({platform.machine()}); torch "
        f"{torch.__version__}; fxshard compiler {args.compiler} (FSDP2+compile: "
        f"{'aot_eager' if args.compiler == 'eager' else 'inductor'}); prefetch rows: backend default "
        f"(prefetch={DEFAULT_PREFETCH}), no-prefetch rows: prefetch=0; {args.warmup} warm-up + {args.steps} timed steps"
    )
    print(header, flush=True)
    measured: dict[str, tuple[list[dict], list[dict] | None]] = {}
    failed: dict[str, str] = {}
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as out_dir:
        runs = [(name, no_comm) for name in names for no_comm in (False, True) if not (no_comm and args.skip_exposed)]
        started = time.monotonic()

        def launch_with_progress(name: str, no_comm: bool) -> list[dict]:
            label = f"{name}{' without communication' if no_comm else ''}"
            print(progress_line(runs.index((name, no_comm)), len(runs), label, args.warmup, args.steps,
                                time.monotonic() - started), file=sys.stderr, flush=True)
            return launch(name, no_comm, args, out_dir)

        for name in names:
            try:
                real = launch_with_progress(name, False)
                no_comm = None if args.skip_exposed else launch_with_progress(name, True)
            except Exception as error:  # one broken configuration must not cost the others' numbers
                last_line = (str(error).strip().splitlines() or [""])[-1]  # a rank's traceback ends with its error
                failed[name] = f"{type(error).__name__}: {last_line}"
                print(f"{name}: FAILED: {error}", flush=True)
                continue
            measured[name] = (real, no_comm)
            slowest = slowest_rank_times(real)
            losses = real[0]["losses"]
            print(f"{name}: {1000 * statistics.median(slowest[args.warmup:]):.0f} ms/step (warm-up "
                  f"{sum(slowest[:args.warmup]):.1f} s, {real[0]['graphs']} Dynamo graphs), loss {losses[0]:.6f} -> "
                  f"{losses[-1]:.6f}; gloo ran {real[0]['ran']} for {real[0]['asked']} c10d calls", flush=True)
            for which, run in (("", real), (" without communication", no_comm)):
                halves = None if run is None else unsettled(slowest_rank_times(run)[args.warmup:])
                if halves:
                    notes.append(f"{name}{which}: median not settled (first half of the timed steps "
                                 f"{1000 * halves[0]:.0f} ms, second half {1000 * halves[1]:.0f} ms): more --steps")

    disagree = loss_disagreements({name: real[0]["losses"] for name, (real, _) in measured.items()})
    agreeing = {name: runs for name, runs in measured.items() if name not in disagree}
    ddp_median = median_step(agreeing["ddp"][0], args.warmup) if "ddp" in agreeing else None
    rows = [row(name, real, no_comm, ddp_median, args) for name, (real, no_comm) in agreeing.items()]
    table = tabulate(rows, headers=HEADERS, tablefmt="github", disable_numparse=True)
    finals = [losses[-1] for losses in (real[0]["losses"] for real, _ in agreeing.values())]
    if len(finals) > 1:
        notes.append(f"final losses of the {len(finals)} configurations in the table agree within "
                     f"{(max(finals) - min(finals)) / statistics.median(finals):.1e} relative "
                     f"(tolerance {FINAL_LOSS_RTOL:g})")
    notes += [f"{name}: LOSS DISAGREES, left out of the table (a bug): {why}" for name, why in disagree.items()]
    notes += [f"{name}: FAILED, left out of the table: {why}" for name, why in failed.items()]
    report = "\n".join([header, "", table, "", *notes])
    print("\n" + "\n".join([table, "", *notes]))
    pathlib.Path(args.out).write_text(report + "\n")
    print(f"\nwritten to {args.out}")
    return 1 if disagree or failed else 0


if __name__ == "__main__":
    sys.exit(main())
