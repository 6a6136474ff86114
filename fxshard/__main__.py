"""``python -m fxshard``: the ledger from the command line.

    python -m fxshard budget --params 7.5e9 (--world 64 | --mesh 8x8 | --mesh 4x8x8) [--tp T --tp-params E]
                             --stage 0,1,2,3 [--optimizer adamw]
                             [--param-bytes 2 --grad-bytes 2 --master-bytes 4 --state-bytes 4] [--unit-params U]
                             [--quantize-weights int8 --quantize-grads int8 --reshard-after-forward K] [--format json]
    python -m fxshard report script.py [script arguments...] [--format json]
    python -m fxshard simulate script.py [script arguments...] [--trace OUT.json] [--world N] [--options [--node K]]
    python -m fxshard simulate --config CONFIG.json --world N [--batch B --seq S --ac none|selective|full]
                             [--machine NAME|FILE] [--param-dtype bf16] [--quantize-weights int8 ...]

``budget`` prints the memory per rank and the bytes sent per step of a model of ``--params`` elements without
running it: it compiles a small stand-in (bias-free linear layers whose backward reads every weight, the ZeRO paper's
assumption) for each stage under a fake process group, takes the ledger's closed form from those graphs and
evaluates it at your sizes, with the peak of building and preparing the model (built on the meta device: its
share plus the largest unit, ``--unit-params`` elements, e.g. one transformer block; built whole). ``--mesh RxS``
is hybrid sharding: R replica groups of S ranks (e.g. 8 nodes of 8 GPUs, 8x8); stages 1-3 shard over S and send
each gradient shard across the R replicas, stage 0 all-reduces over all R*S ranks, and the bytes sent are split into
the two dimensions. ``--tp T`` (or a third size, ``--mesh RxSxT``) puts each data-parallel rank beside T - 1 more
of a tensor-parallel dimension: fxshard shards each tp rank's pieces, ``--tp-params`` elements split over T (all of
``--params`` by default) plus the rest whole, and the table is per rank at that Ψ.

``report`` runs a training script in this process (under ``torchrun``, once per rank)
and prints each prepared backend's ledger beside the collective bytes measured in its last optimizer step (the
script must run two or more: the first compiles, and the profiler also records the collectives that compiling
traces on fake tensors).

``simulate`` runs a training script the same way and writes the step ``fxshard.simulate`` predicts for the graphs
its backend compiled as a Chrome trace-event JSON (``backend.trace``: a compute and a communication lane, an event
per node), to open at ui.perfetto.dev; ``--world N`` predicts for N ranks instead of those the script sharded the
parameters over. Under torchrun rank 0 writes it; a script that prepares several backends gets one file per backend
(OUT-0.json, OUT-1.json, ...). ``--options`` prints the step predicted under each communication option
(``fxshard.simulate.what_if``: quantized gathers and reductions, secondary shards over nodes of ``--node`` ranks) by
world size and inter-node link, and the least world where each is predicted to pay.
``simulate --config`` runs no script: it predicts the step of the model a HuggingFace config describes
(``fxshard.predict``: built on meta and never materialised, compiled at two depths under a fake group of ``--world``
ranks on ``--machine``, scaled to the config's depth) and ends with ``tokens/s per rank X  MFU Y%``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import pathlib
import runpy
import sys

import sympy
import torch
from tabulate import tabulate

import fxshard

from . import api, budget
from .budget.communication_options import sent_form
from .budget.prepare_terms import built_whole_terms
from .errors import FxShardError
from .predict import AC_MODES, PARAM_DTYPES, predict_from_config
from .report.measure import CollectiveCounter
from .report.tables import ledger_report
from .runtime.optimizer_record import steps_inside_another
from .simulate.machines import PRESETS, load_machine
from .simulate.simulator import machine_of
from .simulate.what_if import options_table, swept_links
from .testing import fake_process_group

OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD,
              "adagrad": torch.optim.Adagrad, "rmsprop": torch.optim.RMSprop}


@functools.cache  # its terms are symbolic in Ψ, N, R and K: one compile per stage serves every size asked in a process
def _stand_in_ledger(stage: int, optimizer: str, hybrid: bool = False, reshard: bool | int = True) -> budget.Ledger:
    """The ledger of a 3-layer bias-free linear chain, compiled for ``stage`` on a fake world of 2 ranks (``hybrid``:
    of 4, a 2x2 mesh; stage 3 with ``reshard`` a number of ranks, secondary shards: of 4, re-gathering over 2)."""
    import torch.nn.functional as F

    class StandIn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8, bias=False) for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x

    secondary = stage == 3 and not isinstance(reshard, bool)
    with fake_process_group(4 if hybrid or secondary else 2):
        torch.compiler.reset()
        with torch.device("meta"):  # prepare materialises it: the ledger has the prepare peak of a born-sharded model
            model = StandIn()
        kwargs = {"momentum": 0.9} if optimizer in ("sgd",) else {}
        mesh = None
        if hybrid:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        # the ledger reads the rewritten graphs: run them op by op, not through Inductor's C++ compile (seconds each)
        knobs = {"reshard_after_forward": 2 if secondary else reshard} if stage == 3 else {}
        backend = fxshard.backend(stage=stage, mesh=mesh, compiler="eager", **knobs)
        model, _ = backend.prepare(model, OPTIMIZERS[optimizer](model.parameters(), lr=1e-3, **kwargs))
        run = torch.compile(model, backend=backend, fullgraph=True)
        F.mse_loss(run(torch.randn(2, 8, requires_grad=True)), torch.zeros(2, 8)).backward()
        return budget.ledger(backend)


def _bytes(value: float) -> str:
    return f"{value / 1e9:,.2f} GB ({value / 2**30:,.2f} GiB)"


def budget_rows(params: float, world: int, stages: list[int], optimizer: str, widths: dict,
                replicas: int = 1, unit_params: float | None = None, quantize_weights: str | None = None,
                quantize_grads: str | None = None, reshard: bool | int = True) -> list[dict]:
    """Per stage: each memory item, the total and the bytes sent per step (``sent_shard``: within the groups a
    parameter is sharded over, ``sent_replicas``: across replicas), at ``params`` elements on ``world`` ranks
    (``replicas`` > 1: a hybrid mesh of ``replicas`` groups of ``world / replicas``). With a master wider than
    the parameters (mixed precision) the compute copy is counted apart from it. The prepare peak of the model
    built on the meta device (``prepare_meta``, evaluated where ``unit_params``, the largest unit's elements, is
    given) and built whole (``prepare_whole``). ``quantize_weights`` / ``quantize_grads``: the bytes sent with
    stage 3's gathers / stages 2 and 3's reductions packed (``communication_options.sent_form``); ``reshard``:
    stage 3's ``reshard_after_forward`` (a number k of ranks: backward re-gathers over K = k)."""
    rows = []
    for stage in stages:
        hybrid = replicas > 1 and stage > 0  # stage 0 on a mesh all-reduces over every rank
        ledger = _stand_in_ledger(stage, optimizer, hybrid, reshard)
        mixed = widths[budget.B_MASTER] != widths[budget.B_PARAM]
        terms = ledger.select("memory") + (ledger.mixed_precision_copies if mixed else [])
        items = {}
        for term in terms:
            group = "optimizer state" if term.item not in ("compute copy", "master", "gradients") else term.item
            items[group] = items.get(group, 0) + term.bytes
        values = {budget.PSI: params, budget.N: world // replicas if hybrid else world, budget.R: replicas,
                  budget.K: reshard if not isinstance(reshard, bool) else 1, **widths}
        row = {"stage": stage}
        for item in ("compute copy", "master", "gradients", "optimizer state"):
            form = ledger.closed_form(items.get(item, sympy.Integer(0)))
            row[item] = float(form.subs(values))
        total = ledger.closed_form(sympy.Add(*items.values()))
        row.update(total=float(total.subs(values)), total_form=str(sympy.factor(total.subs(widths))))
        for name, ranks in (("sent", None), ("sent_shard", budget.N), ("sent_replicas", budget.R)):
            sent = ledger.closed_form(sent_form(ledger, quantize_weights, quantize_grads, ranks=ranks))
            row.update({name: float(sent.subs(values)), f"{name}_form": str(sympy.factor(sent.subs(widths)))})
        whole = built_whole_terms(ledger.select("memory"), list(ledger.params.values()))
        for name, form in (("prepare_meta", ledger.prepare_peak()),
                           ("prepare_whole", sympy.Add(*(t.bytes for t in whole)))):
            closed = ledger.closed_form(form).subs(widths)
            row[f"{name}_form"] = str(sympy.expand(closed))
            unknown = budget.U in closed.free_symbols and unit_params is None
            row[name] = None if unknown else float(closed.subs({**values, budget.U: unit_params or 0}))
        rows.append(row)
    return rows


def _budget(args) -> int:
    try:
        stages = [int(s) for s in args.stage.split(",")]
    except ValueError:
        raise FxShardError(f"--stage takes stages separated by commas, e.g. 0,1,2,3; got {args.stage!r}")
    if any(s not in (0, 1, 2, 3) for s in stages):
        raise FxShardError(f"stages are 0, 1, 2, 3; got {args.stage!r}")
    replicas, world, tp = _mesh_or_world(args)
    if args.params <= 0:
        raise FxShardError("--params must be positive")
    if tp < 1:
        raise FxShardError("--tp must be at least 1")
    split = args.params if args.tp_params is None else args.tp_params
    if not 0 <= split <= args.params:
        raise FxShardError("--tp-params is the elements tensor parallelism splits (the layers of its plan): from 0 "
                           "to --params")
    # what fxshard shards: each tp rank's pieces, a split parameter 1/T of it, the rest (norms, embeddings) whole
    per_tp_rank = split / tp + (args.params - split)
    widths = {budget.B_PARAM: args.param_bytes, budget.B_GRAD: args.grad_bytes, budget.B_MASTER: args.master_bytes,
              budget.B_STATE: args.state_bytes}
    if args.unit_params is not None and not 0 < args.unit_params <= args.params:
        raise FxShardError("--unit-params is the largest unit's elements (one transformer block, say): more than 0 "
                           "and at most --params")
    reshard = _reshard(args.reshard_after_forward)
    reshard = True if reshard is None else reshard
    if not isinstance(reshard, bool) and (reshard < 2 or (world // replicas) % reshard or replicas > 1):
        raise FxShardError(f"--reshard-after-forward {reshard}: a number of ranks k, 1 < k, dividing the world "
                           f"({world // replicas}), on a flat world (not --mesh)")
    rows = budget_rows(per_tp_rank, world, stages, args.optimizer, widths, replicas, args.unit_params,
                       args.quantize_weights, args.quantize_grads, reshard)
    if args.format == "json":
        print(json.dumps({"params": args.params, "world": world, "replicas": replicas, "tp": tp,
                          "params_per_tp_rank": per_tp_rank, "optimizer": args.optimizer,
                          "unit_params": args.unit_params,
                          "widths": {str(k): v for k, v in widths.items()}, "stages": rows}, indent=2))
        return 0
    where = (f"a {replicas}x{world // replicas} mesh (R = {replicas} replicas of shard groups of N = "
             f"{world // replicas}; stage 0: N = {world})" if replicas > 1 else f"N = {world} ranks")
    if tp > 1:
        where += (f", each rank one of T = {tp} tensor-parallel ranks ({world * tp} ranks in all): Ψ per tp rank = "
                  f"{split:,.0f}/T + {args.params - split:,.0f} = {per_tp_rank:,.0f}; DTensor's tp collectives move "
                  "activations, not counted here (backend.report() has them)")
    print(f"Ψ = {args.params:,.0f} parameters on {where}, {args.optimizer}, bytes per element: "
          f"param {args.param_bytes}, grad {args.grad_bytes}, master {args.master_bytes}, state {args.state_bytes}"
          "  (GB = 10^9 bytes, GiB = 2^30 bytes)")
    sent = ([("sent_shard", "sent in shard group"), ("sent_replicas", "sent across replicas")] if replicas > 1
            else [("sent", "sent per step")])
    print(tabulate([(r["stage"], r["total_form"], _bytes(r["compute copy"]), _bytes(r["master"]),
                     _bytes(r["gradients"]), _bytes(r["optimizer state"]), _bytes(r["total"]),
                     *(x for key, _ in sent for x in (r[f"{key}_form"], _bytes(r[key])))) for r in rows],
                   headers=["stage", "memory per rank", "compute copy", "master", "gradients", "optimizer state",
                            "total per rank", *(x for _, title in sent for x in (title, "per rank"))]))
    print("\nprepare peak per rank (building and preparing, before the first step); U: the elements of the "
          "largest unit" + (f" = {args.unit_params:,.0f}" if args.unit_params else " (give --unit-params)"))
    print(tabulate([(r["stage"], r["prepare_meta_form"], "" if r["prepare_meta"] is None else _bytes(r["prepare_meta"]),
                     r["prepare_whole_form"], _bytes(r["prepare_whole"])) for r in rows],
                   headers=["stage", "built on meta", "per rank", "built whole", "per rank"]))
    return 0


def _check_world(world: int | None) -> None:
    if world is not None and world < 1:
        raise FxShardError("--world must be at least 1")


def _mesh_or_world(args) -> tuple[int, int, int]:
    """(replicas, data-parallel ranks in all, tensor-parallel degree) from ``--mesh RxS`` or ``RxSxT``, or
    ``--world N``, and ``--tp T``."""
    if (args.mesh is None) == (args.world is None):
        raise FxShardError("give --world N (one group of N ranks) or --mesh RxS (hybrid: R replicas of S ranks; "
                           "RxSxT: and T tensor-parallel ranks each)")
    _check_world(args.world)
    tp = args.tp
    if args.world is not None:
        return 1, args.world, tp
    try:
        sizes = [int(x) for x in args.mesh.lower().split("x")]
    except ValueError:
        sizes = []
    if len(sizes) not in (2, 3) or (len(sizes) == 3 and tp != 1):
        raise FxShardError(f"--mesh takes RxS (replicas x shard-group size, e.g. 8x8) or RxSxT (and the "
                           f"tensor-parallel degree, e.g. 4x8x8; then no --tp); got {args.mesh!r}")
    if min(sizes) < 1:
        raise FxShardError(f"--mesh needs sizes of at least 1, got {args.mesh!r}")
    replicas, shards, tp = (*sizes, tp)[:3]
    return replicas, replicas * shards, tp


@contextlib.contextmanager
def _recording_backends():
    """Yields the list that every ``Backend`` prepared meanwhile is appended to."""
    backends = []
    original_prepare = api.Backend.prepare

    def recording_prepare(self, *a, **k):
        backends.append(self)
        return original_prepare(self, *a, **k)

    api.Backend.prepare = recording_prepare
    try:
        yield backends
    finally:
        api.Backend.prepare = original_prepare


def _run_script(script: str, script_args: list[str], command: str) -> list:
    """Run ``script`` here with ``script_args``; the backends it prepared in this process (at least one)."""
    sys.argv = [script, *script_args]
    with _recording_backends() as backends:
        runpy.run_path(script, run_name="__main__")
    if not backends:
        raise FxShardError(f"{script} prepared no fxshard backend in this process (scripts that spawn their "
                           f"ranks, e.g. with torch.multiprocessing, give {command} nothing here: run each rank under "
                           f"torchrun: `torchrun --nproc-per-node 2 -m fxshard {command} script.py`)")
    return backends


def _report(args, script_args: list[str]) -> int:
    """Run the script here, recording every backend it prepares and the collectives of each optimizer step."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    with CollectiveCounter() as counter:
        # a step is the script's optimizer's: the one prepare returned steps another over the flat shards inside it
        handle = register_optimizer_step_post_hook(
            lambda optimizer, *a: None if steps_inside_another(optimizer) else counter.mark_step())
        try:
            backends = _run_script(args.script, script_args, "report")
        finally:
            handle.remove()
    if len(backends) > 1 or counter.steps < 2:
        why = "several backends step in one run" if len(backends) > 1 else f"it ran {counter.steps} optimizer step(s)"
        print(f"fxshard: no measured column: {why}; the report measures the last of two or more steps of one "
              "backend (the first step compiles, and the profiler also records the collectives compiling traces)",
              file=sys.stderr)
        counter = None
    for backend in backends:
        ledger = budget.ledger(backend)
        title = f"{args.script}: fxshard stage {backend.stage}"
        if counter is not None:
            title += f", measured in the last of {counter.steps} optimizer steps"
        print(ledger_report(ledger, format=args.format, measured=counter, title=title))
    return 0


def _simulate_config(args, rest: list[str]) -> int:
    """Predict the step of the model a HuggingFace config describes, without running it (``fxshard.predict``)."""
    if rest:
        raise FxShardError(f"simulate --config takes no script; got {' '.join(rest)}")
    if args.world is None:
        raise FxShardError("simulate --config needs --world N, the ranks to predict for")
    machine = load_machine(args.machine or "h100-sxm-400g")
    wire = {k: v for k, v in (("quantize_weights", args.quantize_weights), ("quantize_grads", args.quantize_grads),
                              ("reshard_after_forward", _reshard(args.reshard_after_forward))) if v is not None}
    prediction = predict_from_config(args.config, world=args.world, batch=args.batch, seq=args.seq, ac=args.ac,
                                     machine=machine, param_dtype=PARAM_DTYPES[args.param_dtype], stage=args.stage,
                                     **wire)
    print(f"{args.config}: {prediction.model}, {prediction.layers} layers, stage {args.stage}, {args.world} ranks of "
          f"{machine.name}, {args.batch} x {args.seq} tokens per rank, activation checkpointing {args.ac}")
    print(f"  step {prediction.step_s * 1e3:.1f} ms (compute {prediction.compute_s * 1e3:.1f} ms, "
          f"{prediction.exposed_s * 1e3:.1f} ms of communication exposed), "
          f"{prediction.flops_per_token:.3g} model FLOPs per token")
    print(prediction.summary())
    return 0


def _reshard(value: str | None) -> bool | int | None:
    if value is None:
        return None
    if value in ("true", "false"):
        return value == "true"
    try:
        return int(value)
    except ValueError:
        raise FxShardError(f"--reshard-after-forward takes true, false or a number of ranks; got {value!r}") from None


def _simulate(args, script_args: list[str]) -> int:
    """Run the script here and write the simulated step of each backend it prepared as a Chrome trace."""
    if args.config is not None:
        return _simulate_config(args, script_args)
    if args.script is None:
        raise FxShardError("simulate takes a training script to run, or --config CONFIG.json to predict from")
    _check_world(args.world)  # before the script runs, which may take long
    given = [] if args.machine is None else [load_machine(name) for name in args.machine.split(",")]
    if len(given) > 1 and (args.trace is not None or not args.options):
        raise FxShardError("several machines (--machine A,B) are compared by --options alone; --trace predicts on one")
    if args.trace is None and not args.options:
        raise FxShardError("simulate needs --trace OUT.json (the simulated step for Perfetto), --options (where each "
                           "communication option pays), or both")
    backends = _run_script(args.script, script_args, "simulate")
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun every rank ran the script: rank 0 writes
        return 0
    for index, backend in enumerate(backends):
        if not backend.graphs:
            raise FxShardError(f"{args.script}'s backend (stage {backend.stage}) compiled no graph: run a step "
                               "through torch.compile(model, backend=backend) first")
        machine = given[0] if given else machine_of(backend)
        if args.options:
            swept = given or swept_links(machine)
            print(f"{args.script}: stage {backend.stage}, the step's graphs under each communication option "
                  f"(machine: {', '.join(m.name for m in given) if given else machine.name + ', its link swept'})")
            print(options_table(backend, swept, node=args.node))
        if args.trace is None:
            continue
        trace = pathlib.Path(args.trace)
        path = trace if len(backends) == 1 else trace.with_name(f"{trace.stem}-{index}{trace.suffix}")
        timeline = backend.trace(path, world=args.world, machine=machine)
        print(f"{path}: stage {backend.stage} at {timeline.world} ranks on {machine.name}\n"
              f"  step {timeline.step_time * 1e3:.3f} ms (compute {timeline.compute_time * 1e3:.3f} ms, "
              f"communication {timeline.comm_time * 1e3:.3f} ms, {timeline.exposed_comm * 1e3:.3f} ms of it exposed)")
    if args.trace is not None:
        print("open the simulated steps at ui.perfetto.dev")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fxshard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("budget", help="memory and communication of a hypothetical model, per stage")
    plan.add_argument("--params", type=float, required=True, help="parameter elements, e.g. 7.5e9")
    plan.add_argument("--world", type=int, help="ranks N")
    plan.add_argument("--mesh", help="hybrid sharding: RxS, R replicas of shard groups of S ranks (e.g. 8x8); "
                      "RxSxT: with T tensor-parallel ranks each (e.g. 4x8x8)")
    plan.add_argument("--tp", type=int, default=1, help="tensor-parallel degree T (each of the data-parallel "
                      "ranks is T ranks)")
    plan.add_argument("--tp-params", type=float, help="elements tensor parallelism splits over T (default: all of "
                      "--params; the rest, norms and embeddings, is whole on every tp rank)")
    plan.add_argument("--stage", default="0,1,2,3", help="stages, comma separated")
    plan.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    plan.add_argument("--param-bytes", type=int, default=2, help="bytes per element of the compute copy (2)")
    plan.add_argument("--grad-bytes", type=int, default=2, help="bytes per gradient element (2)")
    plan.add_argument("--master-bytes", type=int, default=4, help="bytes per master element (4)")
    plan.add_argument("--state-bytes", type=int, default=4, help="bytes per optimizer state element (4)")
    plan.add_argument("--unit-params", type=float, help="elements of the largest unit prepare materialises at once "
                      "from the meta device (one transformer block, or the embedding where larger), e.g. 8.6e8")
    plan.add_argument("--quantize-weights", choices=["bf16", "int8", "fp8"], help="stage 3's gathers packed so "
                      "(the bytes sent; memory unchanged)")
    plan.add_argument("--quantize-grads", choices=["bf16", "int8"], help="stages 2 and 3's reductions packed so")
    plan.add_argument("--reshard-after-forward", metavar="true|false|K", help="stage 3: free gathered weights "
                      "after forward (true, the default), keep them (false), or keep secondary shards over K ranks")
    plan.add_argument("--format", choices=["text", "json"], default="text")
    report = commands.add_parser("report", help="run a training script and print each backend's ledger")
    report.add_argument("--format", choices=["text", "json"], default="text")
    report.add_argument("script")
    simulate = commands.add_parser("simulate", help="run a training script and write its simulated step as a "
                                   "Chrome trace (Perfetto)")
    simulate.add_argument("--trace", metavar="OUT.json", help="the trace-event JSON to write")
    simulate.add_argument("--options", action="store_true", help="print where each communication option "
                          "(quantize_weights, quantize_grads, reshard_after_forward=k) is predicted to pay, by world "
                          "size and inter-node link (docs/communication.md)")
    simulate.add_argument("--node", type=int, default=8, help="ranks per node for --options (8)")
    simulate.add_argument("--machine", metavar="NAME|FILE", help="predict on this machine: a preset ("
                          f"{', '.join(PRESETS)}) or a JSON file of Machine's fields (default: the backend's own); "
                          "--options compares several, comma separated, every figure theirs (default: the backend's "
                          "machine at 10, 100 and 400 Gb/s between nodes)")
    simulate.add_argument("--world", type=int, help="ranks to predict for (default: those the script sharded "
                          "the parameters over)")
    simulate.add_argument("--config", metavar="CONFIG.json", help="predict the model a HuggingFace config "
                          "describes instead of running a script: built on meta, never materialised (needs --world)")
    simulate.add_argument("--batch", type=int, default=1, help="--config: sequences per rank (1)")
    simulate.add_argument("--seq", type=int, default=4096, help="--config: tokens per sequence (4096)")
    simulate.add_argument("--ac", choices=AC_MODES, default="none", help="--config: activation checkpointing: "
                          "none, selective (every second layer), full (none)")
    simulate.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=3, help="--config: ZeRO stage (3)")
    simulate.add_argument("--param-dtype", choices=sorted(PARAM_DTYPES), default="bf16",
                          help="--config: the dtype forward and backward compute in (bf16; fp32: no mixed precision)")
    simulate.add_argument("--quantize-weights", choices=["bf16", "int8", "fp8"], help="--config: wire option")
    simulate.add_argument("--quantize-grads", choices=["bf16", "int8"], help="--config: wire option")
    simulate.add_argument("--reshard-after-forward", metavar="true|false|K", help="--config: stage 3's option")
    simulate.add_argument("script", nargs="?")
    args, rest = parser.parse_known_args(argv)
    if args.command == "budget" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    handlers = {"budget": lambda: _budget(args), "report": lambda: _report(args, rest),
                "simulate": lambda: _simulate(args, rest)}
    try:
        return handlers[args.command]()
    except FxShardError as error:
        print(f"fxshard: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
