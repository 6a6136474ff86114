"""Testing helpers, public so that users lock in their own models' rewritten graphs the way fxshard's tests do.

- ``graph_summary(gm)``: a compact, stable printout of a rewritten graph (one line per node: name, op, shape,
  unit and role), without the process-group names and Python details that change between torch releases;
- ``assert_graph_snapshot(gm, expected)``: expecttest's inline snapshot of that printout (``EXPECTTEST_ACCEPT=1``
  rewrites the expected string in your test file);
- ``fake_process_group(world_size)``: a single-process stand-in for a process group, so graphs of a world of any
  size can be compiled and snapshotted in plain CI (numbers computed under it are meaningless);
- ``WorkerPool``: long-lived ranks (gloo on CPU, or NCCL with one GPU each) that run test functions, reused across
  tests.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import multiprocessing
import os
import queue
import signal
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
from torch import fx

from fxshard.torch_compat import OpOverload, fake_store, op_name

_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
           torch.int64: "i64", torch.int32: "i32", torch.bool: "b8"}


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{_DTYPES.get(value.dtype, str(value.dtype))}{list(value.shape)}".replace(" ", "")
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_describe(v) for v in value) + ")"
    # a TorchBind object the graph takes (DTensor's process group): its class, not its address
    script_class = getattr(value, "script_class_name", None)
    if script_class is not None or isinstance(value, torch.ScriptObject):
        return (script_class or "ScriptObject").rpartition(".")[2]
    return "-" if value is None else str(value)


def _target_name(node: fx.Node) -> str:
    if node.op == "call_method":  # Dynamo-level graphs (a compiled optimizer step) keep Tensor methods
        return f".{node.target}"
    if node.op != "call_function":
        return node.op
    target = node.target
    if isinstance(target, OpOverload):
        namespace = target.namespace.replace("_c10d_functional", "c10d")
        return f"{namespace}.{op_name(target)}"
    return getattr(target, "__name__", str(target))


def _arg_names(node: fx.Node) -> str:
    names = []
    for arg in node.args:
        if isinstance(arg, fx.Node):
            names.append(arg.name)
        elif isinstance(arg, (list, tuple)) and arg and all(isinstance(a, fx.Node) for a in arg):
            names.append("[" + ", ".join(a.name for a in arg) + "]")
    return ", ".join(names)


def graph_summary(gm: fx.GraphModule | fx.Graph) -> str:
    """One line per node: ``name = op(tensor args) -> dtype[shape]`` plus ``unit/role`` where fxshard acted.

    The output line lists what the graph returns; in a forward graph, everything after the user outputs is saved
    for backward, so a full-shape weight there means it was kept between forward and backward.
    """
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    lines = []
    for node in graph.nodes:
        if node.op == "output":
            outputs = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
            rendered = [f"{o.name}:{_describe(o.meta.get('val'))}" if isinstance(o, fx.Node) else _describe(o) for o in outputs]
            lines.append("return " + ", ".join(rendered))
            continue
        meta = node.meta.get("fxshard", {})
        tag = f"  # {meta['unit']} {meta['role']}" if "role" in meta else ""
        if meta.get("recompute"):
            tag += "  # recomputed"
        shape = _describe(node.meta.get("val", node.meta.get("example_value")))
        if node.op == "placeholder":
            lines.append(f"{node.name}: {shape}")
        else:
            lines.append(f"{node.name} = {_target_name(node)}({_arg_names(node)}) -> {shape}{tag}")
    return "\n".join(lines)


def assert_graph_snapshot(gm: fx.GraphModule | fx.Graph, expected: str, *, skip: int = 0) -> None:
    """Compare ``graph_summary(gm)`` with the inline string literal ``expected`` in the calling test.

    Run the test with ``EXPECTTEST_ACCEPT=1`` to write (or update) the literal in place. ``skip`` counts stack
    frames between the literal and this call when you wrap it in a helper of your own.
    """
    import expecttest

    expecttest.assert_expected_inline(graph_summary(gm), expected, skip=skip + 1)


@contextlib.contextmanager
def fake_process_group(world_size: int = 2, rank: int = 0):
    """A process group of ``world_size`` ranks that lives in this process alone and communicates nothing.

    Enough to prepare a model and compile it (the collectives run but return garbage), so graph snapshots of a
    world of any size run in single-process CI.
    """
    if dist.is_initialized():
        raise RuntimeError("fake_process_group: a process group is already initialized in this process")
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


# A rank that gives no result in time is sent this signal before it is killed: faulthandler writes its threads' stacks
STACKS_SIGNAL = signal.SIGUSR1
STACKS_SHOWN = 6000  # characters of that dump the error shows (each thread's innermost frame comes first)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks, results, timeout_s: float, log_path: str,
            backend: str) -> None:
    # The rank's own output (and glibc's abort message, which LIBC_FATAL_STDERR_ sends to stderr) goes to a file
    # the pool reads back when the rank dies.
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ["LIBC_FATAL_STDERR_"] = "1"  # older glibc writes its abort message to the terminal otherwise
    faulthandler.register(STACKS_SIGNAL, all_threads=True)  # a rank that gives no result shows where it waits
    torch.set_num_threads(1)
    if backend == "nccl":  # one GPU per rank
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    while (task := tasks.get()) is not None:
        fn, args, kwargs = task
        torch.compiler.reset()
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # every failure must reach the test, never a hang
            results.put((rank, False, traceback.format_exc()))
    os._exit(0)  # no process-group teardown: a peer that already left would make it wait for the gloo timeout


class WorkerError(AssertionError):
    """A function failed on one or more ranks of a WorkerPool, or a rank died; the message holds each failing
    rank's traceback and, for a rank that died, its signal and last output lines.

    ``outcomes`` maps each rank that reported to ``(ok, result or traceback)``; ``deaths`` maps each rank that
    died to how (``"SIGKILL"``, ``"exit code 1"``)."""

    def __init__(self, message: str, outcomes: dict | None = None, deaths: dict | None = None):
        super().__init__(message)
        self.outcomes, self.deaths = outcomes or {}, deaths or {}


def _how_it_ended(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


def _last_lines(path: str, count: int = 20) -> str:
    try:
        with open(path, errors="replace") as log:
            return "".join(log.readlines()[-count:])
    except OSError:
        return ""


class WorkerPool:
    """``world_size`` spawned processes, each a rank of one process group on 127.0.0.1, kept for many runs: gloo, or
    with ``backend="nccl"`` NCCL, rank r on GPU r.

    ``pool.run(fn, *args)`` calls ``fn(*args)`` on every rank (``fn`` must be importable: a module-level function)
    and returns the results in rank order, or raises ``WorkerError``. A rank that dies (a signal, or any exit)
    fails the run: the error names the rank, the signal and the rank's last output lines, after the other ranks
    had ``grace_s`` to report (their errors follow from the death and are shown too). Nothing is retried: a crash is
    a bug to find. A run that takes longer than ``timeout_s`` (or ``grace_s`` after one rank failed) kills the pool
    (a hung collective never hangs the caller). After a death or a timeout the next run starts fresh processes.
    Dynamo's caches are reset before each run.
    """

    def __init__(self, world_size: int, timeout_s: float = 300.0, grace_s: float = 20.0, backend: str = "gloo"):
        self.world_size, self.timeout_s, self.grace_s, self.backend = world_size, timeout_s, grace_s, backend
        self._procs: list = []
        self._logs = tempfile.mkdtemp(prefix="fxshard-pool-")

    def _log_path(self, rank: int) -> str:
        return os.path.join(self._logs, f"rank{rank}.log")

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        port = _free_port()
        self._results = context.Queue()
        self._tasks = [context.Queue() for _ in range(self.world_size)]
        self._procs = [
            context.Process(target=_worker, args=(rank, self.world_size, port, self._tasks[rank], self._results,
                                                  self.timeout_s, self._log_path(rank), self.backend), daemon=True)
            for rank in range(self.world_size)
        ]
        for rank, proc in enumerate(self._procs):
            open(self._log_path(rank), "w").close()
            proc.start()

    def run(self, fn, *args, **kwargs) -> list:
        if not self._procs:
            self._start()
        for tasks in self._tasks:
            tasks.put((fn, args, kwargs))
        outcomes: dict[int, tuple[bool, object]] = {}
        deaths: dict[int, str] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(outcomes) + len(deaths) < self.world_size and time.monotonic() < deadline:
            try:
                rank, ok, value = self._results.get(timeout=0.2)
                outcomes[rank] = (ok, value)
                if not ok:  # the other ranks may now wait in a collective forever: give them a short grace
                    deadline = min(deadline, time.monotonic() + self.grace_s)
            except queue.Empty:
                for rank, proc in enumerate(self._procs):
                    if rank not in deaths and rank not in outcomes and not proc.is_alive():
                        deaths[rank] = _how_it_ended(proc.exitcode)
                        deadline = min(deadline, time.monotonic() + self.grace_s)
        name = getattr(fn, "__name__", fn)
        silent = sorted(set(range(self.world_size)) - set(outcomes) - set(deaths))
        failures = [f"--- rank {rank} ---\n{value[-3000:]}" for rank, (ok, value) in sorted(outcomes.items()) if not ok]
        for rank, how in sorted(deaths.items()):
            failures.append(f"--- rank {rank} died ({how}); its last output lines: ---\n"
                            f"{_last_lines(self._log_path(rank))}")
        if silent:
            failures.append(f"ranks {silent} gave no result in time; where each one was:")
            failures += [f"--- rank {rank}'s Python threads ---\n{self._stacks_of(rank)}" for rank in silent]
        if deaths or silent:
            for rank in silent:  # stuck in a collective with a dead or failed peer
                self._procs[rank].kill()
            self.close()
            failures.append("the pool was restarted")
        if failures:
            headline = f"{name}: rank(s) {sorted(deaths)} died" if deaths else f"{name} failed"
            raise WorkerError(f"{headline}:\n" + "\n".join(failures), outcomes, deaths)
        return [outcomes[rank][1] for rank in range(self.world_size)]

    def _stacks_of(self, rank: int) -> str:
        """The Python stack of every thread of a live rank, which its faulthandler writes into its log."""
        with open(self._log_path(rank), "rb") as log:
            written = len(log.read())
        os.kill(self._procs[rank].pid, STACKS_SIGNAL)
        dump, deadline = b"", time.monotonic() + 5.0
        while time.monotonic() < deadline:  # done when it stops growing
            time.sleep(0.2)
            with open(self._log_path(rank), "rb") as log:
                now = log.read()[written:]
            if now and now == dump:
                break
            dump = now
        return dump.decode(errors="replace")[:STACKS_SHOWN] or "(it wrote no stack within 5 s)"

    def close(self) -> None:
        for proc, tasks in zip(self._procs, getattr(self, "_tasks", [])):
            if proc.is_alive():
                tasks.put(None)
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs = []


def rank_and_world() -> tuple[int, int]:
    """This process's rank and world size in the default group (for functions run by a WorkerPool)."""
    return dist.get_rank(), dist.get_world_size()


__all__ = ["WorkerError", "WorkerPool", "assert_graph_snapshot", "fake_process_group", "graph_summary",
           "rank_and_world"]
