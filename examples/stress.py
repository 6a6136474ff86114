"""Stress and soak fxshard's sharded training step on real gloo ranks, and count the ranks that die.

    python examples/stress.py --runs 200
    python examples/stress.py --runs 60 --models gpt,llama --stages 3 --prefetch 1,2 --compilers eager
    python examples/stress.py --soak [--steps 2000]

**Stress** (``--runs N``): N short trainings (``--steps``, 60 by default) on 2 gloo ranks, each in a fresh pair of
processes, as a user's job starts. The runs cycle through every configuration of the matrix ``--models`` (the
example GPT and a Llama-style decoder with grouped-query attention, RMSNorm, rotary embeddings and a SwiGLU MLP,
both from examples/models.py) x ``--stages`` x ``--prefetch`` x ``--compilers``, each run one
``fxshard.backend(stage=s, prefetch=p, compiler=c)`` training with AdamW. A run ends in one of three outcomes:

- ``ok``: every rank finished its steps with a finite loss and exited 0;
- ``death``: a rank was killed by a signal (SIGABRT from glibc's heap checks, SIGSEGV, ...). The rank, the signal,
  the fatal message and the rank's last output lines are printed as soon as it happens. Its peer then fails
  ("Connection reset by peer"): that is a consequence, and the run counts once, as a death;
- ``failure``: no rank died, but one raised (exit status 1), or the run outlived ``--run-timeout`` (a hang).

Progress is printed per run (configuration, run i/N, outcome, elapsed, estimated remaining), then a table of runs,
deaths and failures per configuration and the total. Nothing is retried; the exit status is 1 if any run died or
failed. Every rank's output is kept in ``--log-dir`` (a fresh folder under /tmp by default), with one JSON line per
run in ``results.jsonl``.

**Soak** (``--soak``): one long training of the example GPT (the stress runs' ``gpt``, examples/train_gpt.py's
configuration) at stage 3 with the backend's default prefetch on 2 ranks, ``--steps`` 2000 by default. It passes
when no rank dies or fails, each rank's resident memory (RSS, read from /proc/self/statm after every step) stays
within 2% (max over min) from step 100 on, and Dynamo compiles no new graph after the first step
(``torch._dynamo.utils.counters["stats"]["unique_graphs"]``; torch 2.13 keeps no counter of recompilations as
such, and a recompilation is a new graph). Every 30 s it prints the steps done, elapsed and remaining time; at the
end, those figures per rank, and it exits 1 if a criterion fails.

Both modes set ``LIBC_FATAL_STDERR_=1`` so that glibc writes its abort message ("malloc(): unaligned tcache chunk
detected") to the rank's captured stderr instead of the terminal, and enable ``faulthandler`` in the ranks, which
adds the Python stack of every thread to a dying rank's output. docs/stress.md has the measured figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import faulthandler
import itertools
import json
import math
import multiprocessing.connection
import os
import pathlib
import re
import signal
import socket
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tabulate import tabulate

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import fxshard  # noqa: E402
from examples.launch import refuse_torchrun  # noqa: E402
from examples.models import GPT, GPTConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

WORLD_SIZE = 2
PER_RANK_BATCH = 8  # sequences per rank per step
MODELS = {  # small enough that a run is mostly collectives, not matmuls: the race needs collectives in flight
    "gpt": lambda: GPT(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, d_model=64)),  # train_gpt.py's
    "llama": lambda: LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=176,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                  max_position_embeddings=32)),
}
SEQ_LEN = 32
VOCAB_SIZE = 128
SOAK_STAGE = 3
SOAK_RSS_FROM_STEP = 100  # the first steps allocate caches, arenas and the compiled graphs: memory settles by then
SOAK_RSS_TOLERANCE = 0.02  # max / min - 1 of each rank's RSS from SOAK_RSS_FROM_STEP on
PEER_GRACE_S = 60.0  # after one rank ends badly, how long its peer may take to notice before it is killed
# Lines of a rank's output that say why it died: glibc's heap checks, Python's fatal errors, faulthandler.
FATAL_LINE = re.compile(r"malloc\(\)|free\(\)|double free|corrupted|tcache|fastbin|munmap_chunk|"
                        r"Fatal Python error|Segmentation fault|Aborted|terminate called")


# -- what a run is and how it ended ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StressConfig:
    model: str
    stage: int
    prefetch: int
    compiler: str

    @property
    def label(self) -> str:
        return f"{self.model} stage {self.stage} prefetch {self.prefetch} {self.compiler}"

    @property
    def slug(self) -> str:
        return f"{self.model}-s{self.stage}-p{self.prefetch}-{self.compiler}"


@dataclasses.dataclass
class RankExit:
    """How one rank's process ended. ``exitcode`` is multiprocessing's: negative for a signal, None if it had to be
    killed by this command (``killed_because`` says why: its peer had died, or the run hung). ``output`` is
    everything the rank wrote to stdout and stderr."""

    rank: int
    exitcode: int | None
    log: str
    output: list[str]
    killed_because: str | None = None

    @property
    def signal_name(self) -> str | None:
        if self.exitcode is None or self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    @property
    def fatal_message(self) -> str:
        """The line that says why the process died (glibc's message, else Python's fatal error), or ''."""
        fatal = [line.strip() for line in self.output if FATAL_LINE.search(line)]
        return next((line for line in fatal if not line.startswith("Fatal Python error")), fatal[0] if fatal else "")

    @property
    def crashed_thread(self) -> str:
        """Where the signal arrived, from faulthandler's dump: the innermost Python frame of the thread it marks
        as current, or a thread that runs no Python at all (a C++ thread, such as gloo's workers)."""
        if not any(line.startswith("Fatal Python error") for line in self.output):
            return ""
        for i, line in enumerate(self.output):
            if line.startswith("Current thread"):
                frame = self.output[i + 1].strip() if i + 1 < len(self.output) else ""
                return f"the main Python thread, in {frame}" if frame else "a Python thread"
        return "a thread without Python frames (C++: e.g. a gloo worker thread)"

    def last_lines(self, count: int = 10) -> list[str]:
        """The rank's own last lines: before faulthandler's dump of the thread stacks, if it made one."""
        own = list(itertools.takewhile(lambda line: not line.startswith("Fatal Python error"), self.output))
        return own[-count:]


@dataclasses.dataclass
class RunResult:
    index: int
    config: StressConfig
    seconds: float
    ranks: list[RankExit]

    @property
    def outcome(self) -> str:
        """``death`` if a rank was killed by a signal, else ``failure`` if a rank failed or hung, else ``ok``."""
        if any(r.signal_name for r in self.ranks):
            return "death"
        if any(r.exitcode != 0 for r in self.ranks):
            return "failure"
        return "ok"

    def explain(self) -> str:
        """What went wrong, rank by rank, with the last output lines of the ranks that caused it."""
        lines = []
        culprits = [r for r in self.ranks if r.signal_name] or [r for r in self.ranks if r.exitcode not in (0, None)]
        for r in self.ranks:
            if r.signal_name:
                what = f"killed by {r.signal_name}" + (f": {r.fatal_message}" if r.fatal_message else "")
                what += f"; on {r.crashed_thread}" if r.crashed_thread else ""
            elif r.killed_because:
                what = f"killed by this command ({r.killed_because})"
            elif r.exitcode:
                what = f"exited with status {r.exitcode}"
            else:
                what = "finished"
            lines.append(f"  rank {r.rank}: {what}  [{r.log}]")
        for r in culprits or self.ranks:
            lines.append(f"  rank {r.rank}'s last output lines:")
            lines.extend(f"    | {line}" for line in r.last_lines())
        return "\n".join(lines)

    def as_json(self) -> dict:
        return {"run": self.index, "config": dataclasses.asdict(self.config), "outcome": self.outcome,
                "seconds": round(self.seconds, 2),
                "ranks": [{"rank": r.rank, "exitcode": r.exitcode, "signal": r.signal_name,
                           "fatal_message": r.fatal_message, "crashed_thread": r.crashed_thread,
                           "killed_because": r.killed_because, "log": r.log}
                          for r in self.ranks]}


def summary_rows(results: list[RunResult], configs: list[StressConfig]) -> list[list]:
    """One row (configuration, runs, deaths, failures) per configuration in matrix order, then the total."""
    rows = []
    for config in configs:
        mine = [r for r in results if r.config == config]
        if mine:
            rows.append([config.label, len(mine), sum(r.outcome == "death" for r in mine),
                         sum(r.outcome == "failure" for r in mine)])
    rows.append(["total", len(results), sum(r.outcome == "death" for r in results),
                 sum(r.outcome == "failure" for r in results)])
    return rows


def soak_failures(rss: list[int], graphs_after_first_step: int, graphs_at_end: int) -> list[str]:
    """The soak's criteria that one rank's figures break (an empty list: the rank passed). ``rss``: its resident
    bytes after each step. Its RSS from step ``SOAK_RSS_FROM_STEP`` on must stay within ``SOAK_RSS_TOLERANCE``
    (max over min), and Dynamo must compile no graph after the first step (``unique_graphs`` then and at the end)."""
    broken = []
    settled = rss[SOAK_RSS_FROM_STEP:]
    if not settled:
        broken.append(f"only {len(rss)} steps: RSS is judged from step {SOAK_RSS_FROM_STEP} on")
    elif max(settled) / min(settled) - 1 > SOAK_RSS_TOLERANCE:
        broken.append(f"RSS varied by {100 * (max(settled) / min(settled) - 1):.2f}% (max/min - 1) from step "
                      f"{SOAK_RSS_FROM_STEP} on, more than {100 * SOAK_RSS_TOLERANCE:.0f}%")
    new_graphs = graphs_at_end - graphs_after_first_step
    if new_graphs:
        broken.append(f"{new_graphs} graph(s) compiled after the first step (a recompilation)")
    return broken


# -- the ranks -----------------------------------------------------------------------------------------------------
def capture_output(log_path: str) -> None:
    """Send this process's file descriptors 1 and 2 to ``log_path``, line-buffered: what C++ and glibc write
    arrives there too, and Python's lines are on disk before a signal can kill the process."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    faulthandler.enable(all_threads=True)  # on SIGSEGV/SIGABRT: every thread's Python stack, then the signal


def token_batches(rank: int, generator: torch.Generator):
    """Endless (inputs, next-token targets) of random tokens: this rank's slice of each global batch."""
    while True:
        tokens = torch.randint(0, VOCAB_SIZE, (PER_RANK_BATCH * WORLD_SIZE, SEQ_LEN + 1), generator=generator)
        mine = tokens[rank * PER_RANK_BATCH : (rank + 1) * PER_RANK_BATCH]
        yield mine[:, :-1], mine[:, 1:]


def fxshard_origin() -> str:
    """Where fxshard and its passes were imported from: a checkout beside the installed one is easy to mix up."""
    import fxshard.passes

    return (f"fxshard from {pathlib.Path(fxshard.__file__).parent}, passes from "
            f"{pathlib.Path(fxshard.passes.__file__).parent}, torch {torch.__version__}")


def resident_bytes() -> int:
    """This process's resident set size now (not the peak that ``resource.getrusage`` reports)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rank_main(rank: int, port: int, log_path: str, job: dict) -> None:
    """One rank of a stress run (``job["mode"] == "stress"``) or of the soak; writes ``<log>.json`` for the soak."""
    capture_output(log_path)
    torch.set_num_threads(1)  # the ranks share this machine's cores
    print(f"rank {rank}: {fxshard_origin()}; {job}")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    torch.manual_seed(0)  # the same initial model on every rank
    model, backend, data = build(job, rank)
    model, optimizer = backend.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    step = torch.compile(model, backend=backend, fullgraph=True)

    rss, graphs_after_first_step = [], None
    start = time.perf_counter()
    for i in range(job["steps"]):
        loss = step(*next(data))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if not math.isfinite(loss.item()):
            raise RuntimeError(f"step {i}: loss is {loss.item()}")
        rss.append(resident_bytes())
        if i == 0:
            graphs_after_first_step = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        if i % job["print_every"] == 0 or i == job["steps"] - 1:
            print(f"rank {rank}: step {i} loss {loss.item():.4f} rss {rss[-1] / 2**20:.1f} MiB "
                  f"{time.perf_counter() - start:.1f} s")
    if job["mode"] == "soak":
        pathlib.Path(log_path + ".json").write_text(json.dumps({
            "rank": rank, "rss": rss, "seconds": time.perf_counter() - start,
            "graphs_after_first_step": graphs_after_first_step,
            "graphs_at_end": torch._dynamo.utils.counters["stats"]["unique_graphs"],
            "fxshard_graphs": len(backend.graphs),
        }))
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: done")


def build(job: dict, rank: int):
    """(model, backend, batches) of a stress run's configuration, or of the soak."""
    if job["mode"] == "soak":
        backend = fxshard.backend(stage=SOAK_STAGE, compiler=job["compiler"])
        return MODELS["gpt"](), backend, token_batches(rank, torch.Generator().manual_seed(1))
    backend = fxshard.backend(stage=job["stage"], prefetch=job["prefetch"], compiler=job["compiler"])
    return MODELS[job["model"]](), backend, token_batches(rank, torch.Generator().manual_seed(1))


# -- launching a run ---------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_output(path: str) -> list[str]:
    try:
        return pathlib.Path(path).read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return ["(no output: the process died before it opened its log)"]


def launch(job: dict, log_stem: str, timeout_s: float | None,
           while_running: Callable[[list[str], float], None] | None = None) -> tuple[list[RankExit], float]:
    """Run ``rank_main`` on WORLD_SIZE fresh processes; how each ended, and the seconds the run took.
    ``while_running(logs, elapsed)`` is called about once a second meanwhile (the soak's progress).

    A rank that ends badly gets its peer ``PEER_GRACE_S`` to end too (it normally fails within seconds, on
    "Connection reset by peer"); a peer still running after that, or any rank still running after ``timeout_s``,
    is killed, and recorded as killed by this command, not as a death.
    """
    port = free_port()
    context = mp.get_context("spawn")
    logs = [f"{log_stem}-rank{rank}.log" for rank in range(WORLD_SIZE)]
    processes = [context.Process(target=rank_main, args=(rank, port, logs[rank], job)) for rank in range(WORLD_SIZE)]
    start = time.monotonic()
    for process in processes:
        process.start()
    killed_because: dict[int, str] = {}
    bad_since = None
    try:
        while any(p.is_alive() for p in processes):
            multiprocessing.connection.wait([p.sentinel for p in processes if p.is_alive()], timeout=1.0)
            now = time.monotonic()
            if while_running is not None:
                while_running(logs, now - start)
            if bad_since is None and any(p.exitcode not in (None, 0) for p in processes):
                bad_since = now
            for rank, process in enumerate(processes):
                if not process.is_alive():
                    continue
                if bad_since is not None and now - bad_since > PEER_GRACE_S:
                    killed_because[rank] = f"still running {PEER_GRACE_S:.0f} s after its peer ended"
                elif timeout_s is not None and now - start > timeout_s:
                    killed_because[rank] = f"hung: the run outlived --run-timeout {timeout_s:.0f} s"
                else:
                    continue
                process.kill()
                process.join()
    finally:  # interrupted (Ctrl-C): leave no rank behind
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
    exits = [RankExit(rank, None if rank in killed_because else p.exitcode, logs[rank], read_output(logs[rank]),
                      killed_because.get(rank)) for rank, p in enumerate(processes)]
    return exits, time.monotonic() - start


# -- the two commands ----------------------------------------------------------------------------------------------
def clock(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))


def stress(args: argparse.Namespace, log_dir: pathlib.Path) -> int:
    configs = [StressConfig(m, s, p, c) for m, s, p, c in itertools.product(args.models, args.stages, args.prefetch,
                                                                            args.compilers)]
    print(f"stress: {args.runs} runs of {args.steps} steps on {WORLD_SIZE} gloo ranks, cycling through "
          f"{len(configs)} configurations; {fxshard_origin()}; logs in {log_dir}", flush=True)
    results: list[RunResult] = []
    started = time.monotonic()
    with open(log_dir / "results.jsonl", "w") as journal:
        for index, config in zip(range(args.runs), itertools.cycle(configs)):
            job = {"mode": "stress", "model": config.model, "stage": config.stage, "prefetch": config.prefetch,
                   "compiler": config.compiler, "steps": args.steps, "print_every": 10}
            ranks, seconds = launch(job, str(log_dir / f"run{index:04d}-{config.slug}"), args.run_timeout)
            result = RunResult(index, config, seconds, ranks)
            results.append(result)
            journal.write(json.dumps(result.as_json()) + "\n")
            journal.flush()
            elapsed = time.monotonic() - started
            remaining = estimated_remaining(results, configs, args.runs)
            print(f"[{index + 1:4d}/{args.runs}] {config.label:34s} {result.outcome:7s} {seconds:6.1f} s   "
                  f"elapsed {clock(elapsed)}  remaining ~{clock(remaining)}", flush=True)
            if result.outcome != "ok":
                print(result.explain(), flush=True)

    print(f"\n{fxshard_origin()}; {clock(time.monotonic() - started)} in all")
    print(tabulate(summary_rows(results, configs), headers=["configuration", "runs", "deaths", "failures"]))
    incidents = [r for r in results if r.outcome != "ok"]
    if incidents:
        print(f"\n{len(incidents)} run(s) did not end well:")
        for result in incidents:
            print(f"run {result.index + 1} ({result.config.label}): {result.outcome}")
            print(result.explain())
    print(f"\nlogs and results.jsonl: {log_dir}")
    return 1 if incidents else 0


def estimated_remaining(results: list[RunResult], configs: list[StressConfig], runs: int) -> float:
    """Seconds the runs still to come should take: each configuration's mean so far (the overall mean for a
    configuration not run yet; inductor's runs are slower than eager's)."""
    overall = sum(r.seconds for r in results) / len(results)
    mean = {c: [r.seconds for r in results if r.config == c] for c in configs}
    upcoming = (configs[i % len(configs)] for i in range(len(results), runs))
    return sum(sum(mean[c]) / len(mean[c]) if mean[c] else overall for c in upcoming)


SOAK_PROGRESS_EVERY_S = 30.0
_STEP_LINE = re.compile(r"^rank 0: step (\d+) ", re.MULTILINE)


def soak_progress(rank0_output: str, steps: int, elapsed: float) -> str | None:
    """The soak's progress line from rank 0's output so far (it prints every 100th step): steps done, elapsed and
    the remaining time at the pace since the first step; None before rank 0 has printed a step."""
    done = [int(step) for step in _STEP_LINE.findall(rank0_output)]
    if not done:
        return None
    last = max(done) + 1
    pace = elapsed / last
    return f"soak: step {last}/{steps}  elapsed {clock(elapsed)}  remaining ~{clock(pace * (steps - last))}"


def soak(args: argparse.Namespace, log_dir: pathlib.Path) -> int:
    compiler = args.compilers[0]
    print(f"soak: {args.steps} steps of the example GPT at stage {SOAK_STAGE}, default prefetch, {compiler} "
          f"compiler, {WORLD_SIZE} gloo ranks; logs in {log_dir}", flush=True)
    job = {"mode": "soak", "compiler": compiler, "steps": args.steps, "print_every": 100}
    printed_at = [0.0]

    def print_progress(logs: list[str], elapsed: float) -> None:
        if elapsed - printed_at[0] < SOAK_PROGRESS_EVERY_S:
            return
        printed_at[0] = elapsed
        line = soak_progress(pathlib.Path(logs[0]).read_text(errors="replace"), args.steps, elapsed)
        if line:
            print(line, flush=True)

    ranks, seconds = launch(job, str(log_dir / "soak"), timeout_s=None, while_running=print_progress)
    result = RunResult(0, StressConfig("gpt", SOAK_STAGE, -1, compiler), seconds, ranks)
    print(f"soak: {clock(seconds)}, {result.outcome}; {fxshard_origin()}")
    if result.outcome != "ok":
        print(result.explain())
        return 1
    broken_criteria: list[str] = []
    rows = []
    for rank in ranks:
        figures = json.loads(pathlib.Path(rank.log + ".json").read_text())
        settled = figures["rss"][SOAK_RSS_FROM_STEP:]
        low, high, last = min(settled), max(settled), settled[-1]
        spread = high / low - 1
        drift = last / settled[0] - 1
        new_graphs = figures["graphs_at_end"] - figures["graphs_after_first_step"]
        broken = soak_failures(figures["rss"], figures["graphs_after_first_step"], figures["graphs_at_end"])
        broken_criteria.extend(f"rank {rank.rank}: {criterion}" for criterion in broken)
        rows.append([rank.rank, len(figures["rss"]), f"{figures['seconds']:.0f}",
                     f"{1000 * figures['seconds'] / len(figures['rss']):.0f}", f"{settled[0] / 2**20:.1f}",
                     f"{low / 2**20:.1f}", f"{high / 2**20:.1f}", f"{last / 2**20:.1f}", f"{100 * spread:.2f}%",
                     f"{100 * drift:+.2f}%", figures["graphs_after_first_step"], new_graphs,
                     figures["fxshard_graphs"]])
    print(tabulate(rows, headers=["rank", "steps", "s", "ms/step", f"RSS@{SOAK_RSS_FROM_STEP} MiB", "min MiB",
                                  "max MiB", "last MiB", "max/min-1", "last vs first", "graphs@step1",
                                  "new graphs", "fxshard graphs"]))
    for criterion in broken_criteria:
        print(criterion)
    print(f"criteria: no death or failure (ok); RSS max/min - 1 <= {100 * SOAK_RSS_TOLERANCE:.0f}% from step "
          f"{SOAK_RSS_FROM_STEP} on; 0 new graphs after the first step -> "
          f"{'FAILED' if broken_criteria else 'passed'}")
    return 1 if broken_criteria else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    def names(choices):
        def parse(text: str) -> list[str]:
            chosen = text.split(",")
            unknown = sorted(set(chosen) - set(choices))
            if unknown:
                raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {','.join(choices)}")
            return chosen
        return parse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--runs", type=int, help="stress: this many short trainings, each on fresh ranks")
    mode.add_argument("--soak", action="store_true", help="one long stage-3 training of the example GPT")
    parser.add_argument("--steps", type=int, help="steps per run (stress: 60; soak: 2000)")
    parser.add_argument("--models", type=names(tuple(MODELS)), default=list(MODELS), help="comma-separated")
    parser.add_argument("--stages", type=ints, default=[0, 1, 2, 3], help="comma-separated ZeRO stages")
    parser.add_argument("--prefetch", type=ints, default=[0, 1, 2], help="comma-separated prefetch depths")
    parser.add_argument("--compilers", type=names(fxshard.api.COMPILERS), default=list(fxshard.api.COMPILERS),
                        help="comma-separated; the soak uses the first (default: the backend's default)")
    parser.add_argument("--run-timeout", type=float, default=600.0, help="seconds before a stress run counts as hung")
    parser.add_argument("--log-dir", type=pathlib.Path,
                        help="where the ranks' output goes (default: a new /tmp folder)")
    args = parser.parse_args(argv)
    if args.soak and args.compilers == list(fxshard.api.COMPILERS):
        args.compilers = [fxshard.api.DEFAULT_COMPILER]
    if args.steps is None:
        args.steps = 2000 if args.soak else 60
    if args.soak and args.steps <= SOAK_RSS_FROM_STEP:
        parser.error(f"the soak needs more than {SOAK_RSS_FROM_STEP} steps (RSS is judged from that step on)")
    return args


def main(argv: list[str] | None = None) -> int:
    refuse_torchrun("examples/stress.py")
    args = parse_args(argv)
    # glibc writes "malloc(): ..." to /dev/tty unless told otherwise: the ranks inherit this, so it reaches their logs.
    os.environ["LIBC_FATAL_STDERR_"] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    log_dir = args.log_dir or pathlib.Path(f"/tmp/fxshard-{'soak' if args.soak else 'stress'}-{stamp}")
    log_dir.mkdir(parents=True, exist_ok=True)
    return soak(args, log_dir) if args.soak else stress(args, log_dir)


if __name__ == "__main__":
    sys.exit(main())
