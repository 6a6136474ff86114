"""The sympy ledger: memory per rank and bytes communicated per step, read off the rewritten graphs.

Nothing here is a table keyed by ZeRO stage. Every term comes from a node (or the prepared optimizer):

- the AOT joint graph's ``fxshard.unshard`` markers say which graph input is a parameter's trainable leaf
  (``local``) and which is a separate full copy (``resident``), and whether the graph reads the leaf whole or
  gathers it from shards; a graph without markers (stage 1) reads every input that receives a gradient as a
  plain parameter;
- the backward graph's outputs (``GradAOTOutput``) are the gradients that stay resident, full or sharded;
- every collective node (``meta["fxshard"]["role"]`` of ``all_gather`` / ``reduce_scatter`` / ``all_reduce``)
  contributes its input buffer, expressed in the element counts of the parameters its ``params`` name;
- the forward graph's outputs marked ``SavedForBackwardsAOTOutput`` that are not graph inputs are the activations
  saved for backward;
- the gathered buffers (``wait`` of an all-gather, the per-parameter copies after it) alive at once, walked in
  graph order, give the transient peak under the schedule the passes chose;
- the prepared model says whether prepare materialised it from the meta device and its largest unit: the prepare
  peak (fxshard/budget/prepare_terms.py);
- the prepared optimizer gives the tensors it updates (the master copy: the shard leaf, the stage-1 master shard,
  or the full parameter) and, from its class, the state kinds it keeps per element (Adam: ``exp_avg`` and
  ``exp_avg_sq``); where the master is not what the graph reads, its update is followed by an all-gather into the
  copy the graph reads, and where a gradient arrives full but the master is a shard, by a reduce-scatter.

Symbols: ``N`` (the ranks a parameter is sharded over: the world size, or a 2-D mesh's shard dimension), ``R``
(hybrid sharding only: the replicas of each shard, the mesh's replicate dimension), ``T`` (tensor parallelism
only: the ranks of the tp dimension, which DTensor's own collectives span; their buffers are activations, counted
at their size), one element count ``ψ[name]`` per trainable parameter (under tensor parallelism: of this tp rank's
piece; ``Ψ`` is their sum), byte widths ``b_param`` (the copy the graph reads), ``b_grad``,
``b_master``, ``b_state``, and with dynamic shapes the graph's size symbols, named ``batch``/``seq`` after the model
input dimension they come from. A shard of ``ψ`` elements holds ``ceiling(ψ/N)`` (flat padded sharding);
:meth:`Ledger.closed_form` assumes N divides every parameter and writes the sum as Ψ.

Where each part lives: the symbols, ``Term`` and ``Ledger`` in fxshard/budget/symbols.py; reading the graphs in
fxshard/budget/graph_terms.py; the optimizer's terms in fxshard/budget/optimizer_terms.py; here, the step put together from them
(``ledger``, ``ledger_of_graphs``) and one lowered graph's bytes (``graph_ledger``, what budget_pass checks).
"""

from __future__ import annotations

import sympy
from torch import fx

from fxshard.errors import FxShardError
from fxshard.passes.fx_utils import size_hint
from fxshard.runtime.optimizer_record import updating_optimizer
from fxshard.runtime.param import module_records, spec_of
from fxshard.runtime.prepare import materialised_units, sharded_world_size, tensor_parallel_of

from .graph_terms import (
    Param,
    Sizes,
    collective_terms,
    gradient_terms,
    input_index,
    live_peak,
    merge_sizes,
    parameters_of_joint,
    saved_activations,
)
from .optimizer_terms import optimizer_terms, step_peaks
from .prepare_terms import born_on_meta_terms, built_whole_terms
from .symbols import (
    B_MASTER,
    B_PARAM,
    U,
    WIDTHS,
    Ledger,
    Term,
    sizes_at,
)

# -- the step: graphs + optimizer ---------------------------------------------------------------------------


def _names_from_model(model) -> dict[tuple, str]:
    """(use sites...) -> the name prepare gave the parameter, for tied parameters read at several sites."""
    if model is None:
        return {}
    names = {}
    by_id: dict[int, list[str]] = {}
    for site, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(site)
    for _, laid_out in module_records(model):
        for attr, record in laid_out.params.items():
            site = f"{laid_out.path}.{attr}" if laid_out.path else attr
            names[(site,)] = record.spec.name
    for sites in by_id.values():
        for site in sites:
            names.setdefault((site,), sites[0])
    return names


def _tensor_parallel_groups(model) -> dict[str, int]:
    """{group name: ranks} of the tensor-parallel dimension the model's DTensor parameters lie on ({}: none)."""
    layouts = [] if model is None else tensor_parallel_of(model)
    return {name: tp.degree for tp in layouts for name in (tp.group_name, tp.dtensor_group_name)}


def _rename(params: dict[int, Param], names: dict[tuple, str], optimizer) -> None:
    for param in params.values():
        if param.sites:
            param.name = names.get((param.sites[0],), param.name)
    # no markers: name the graph's inputs after the specs, matched by shape
    if optimizer is not None and any(p.reads == "plain" for p in params.values()):
        specs = [spec_of(p) for g in optimizer.param_groups for p in g["params"]]
        for idx, param in list(params.items()):
            if param.reads != "plain":
                continue
            match = next((s for s in specs if s is not None and s.numel == param.numel), None)
            if match is None:  # an input that requires grad, not a parameter
                del params[idx]
                continue
            specs.remove(match)
            param.name = match.name
            param.sites = [match.name]


def step_records(records) -> dict[int, dict]:
    """The backend's graph records grouped by Dynamo graph: {graph_id: {"joint": <graph before passes>, ...}}."""
    steps: dict[int, dict] = {}
    for record in records:
        if record.final is None:
            continue
        graphs = steps.setdefault(record.graph_id, {})
        graphs[record.kind] = record.passes[0].before if record.kind == "joint" and record.passes else record.final
    return steps


def ledger_of_graphs(records, *, world_size: int, optimizer=None, model=None) -> Ledger:
    """The ledger of one training step: every forward/backward pair the backend compiled, plus the optimizer.

    Several Dynamo graphs (graph breaks) add their terms; a graph id without a backward (an inference graph)
    contributes only its collectives to the schedule. A compiled ``optimizer.step`` contributes the collectives of
    its graph (of the latest compile, where it was recompiled) in place of the eager step's per-parameter gathers."""
    optimizer = None if optimizer is None else updating_optimizer(optimizer)
    names = _names_from_model(model)
    tensor_parallel = _tensor_parallel_groups(model)
    terms, schedule, copies = [], [], []
    all_params: dict[str, Param] = {}
    sizes, peaks, with_gradients = None, [], set()
    for graph_id, graphs in sorted(step_records(records).items()):
        if "joint" not in graphs or "forward" not in graphs or "backward" not in graphs:
            continue
        params = parameters_of_joint(graphs["joint"])
        _rename(params, names, optimizer)
        # a parameter an earlier graph read too (a weight tied across a graph break) is one tensor, held once
        first_read = [p for p in params.values() if p.name not in all_params]
        all_params.update({p.name: p for p in params.values()})
        sizes = Sizes(all_params.values(), world_size) if sizes is None else merge_sizes(sizes, params.values())
        for param in first_read:
            if param.reads in ("resident", "plain"):  # a full copy the graph reads, not what the optimizer updates
                read = f"graph {graph_id} reads {param.name}"
                terms.append(Term("memory", "compute copy", param.count, B_PARAM, read))
            if optimizer is None and param.reads in ("local", "gathered"):
                read = param.count if param.reads == "local" else param.shard
                terms.append(Term("memory", "master", read, B_MASTER, f"graph {graph_id}: {param.name}"))
        produced: dict[fx.Node, sympy.Expr] = {}
        terms += gradient_terms(graphs["backward"], params, sizes, produced, with_gradients)
        terms += saved_activations(graphs["forward"], sizes)
        for kind in ("forward", "backward"):
            comm, rows = collective_terms(graphs[kind], f"graph {graph_id} {kind}", sizes, tensor_parallel)
            terms += comm
            schedule += rows
            peaks.append(live_peak(graphs[kind], f"graph {graph_id} {kind}", sizes, produced))
    if sizes is None:
        raise FxShardError("no forward/backward graph was compiled yet: run one training step (forward and "
                           "backward) through torch.compile(model, backend=backend) before asking for the ledger")
    for param in all_params.values():
        sizes.values.setdefault(param.count, param.numel)
    published: set[str] = set()
    for graph_id, graphs in sorted(step_records(records).items(), reverse=True):
        if "optimizer" not in graphs or "inference" not in graphs:
            continue
        comm, rows = collective_terms(graphs["inference"], f"optimizer step graph {graph_id}", sizes)
        gathered = {name for row in rows for name in row["params"]}
        if gathered & published:  # recompiled: the later graph replaced this one
            continue
        published |= gathered
        terms += comm
        schedule += rows
    if optimizer is not None:
        memory, comm, copies, rows = optimizer_terms(optimizer, list(all_params.values()), sizes, published)
        terms += memory + comm
        peaks += step_peaks(comm, [t for t in terms if t.section == "memory" and t.item == "gradients"])
        schedule += [{**row, "bytes": sizes_at(t.bytes, sizes.values)} for row, t in zip(rows, comm)]
    if model is not None:
        memory, units = [t for t in terms if t.section == "memory"], materialised_units(model)
        if units:
            largest = max(units, key=units.get)
            sizes.values[U] = units[largest]
            terms += born_on_meta_terms(memory, largest)
        else:
            terms += built_whole_terms(memory, [p.count for p in all_params.values()])
    # graphs and the step's buckets run one after the other: the step's worst point is the worst of theirs
    terms += max(peaks, key=lambda p: sum(sizes_at(t.bytes, sizes.values) for t in p))
    for width in WIDTHS:
        sizes.values.setdefault(width, 4)
    params_by_name = {p.name: p.count for p in all_params.values()}
    return Ledger(terms, sizes.values, params_by_name, copies, schedule)


def graph_ledger(gm: fx.GraphModule, graph: str, world_size: int, optimizer_bytes: int = 0) -> dict:
    """What one lowered graph (of kind ``graph``) needs per rank, in bytes, with ``optimizer_bytes`` kept outside it:
    ``{"inputs", "peak", "peak_at", "optimizer", "total", "terms": [(item, node, bytes)]}`` (see budget_pass.py)."""
    sizes = Sizes([], world_size)
    held = live_peak(gm, graph, sizes, grads={})
    peak_terms = [t for t in held if t.item != "peak point"]
    inputs = [p for p in gm.graph.find_nodes(op="placeholder")
              if input_index(p) is not None and hasattr(p.meta.get("val"), "element_size")]
    terms = [("input", p.name, size_hint(p.meta["val"].numel()) * p.meta["val"].element_size()) for p in inputs]
    input_bytes = sum(nbytes for _, _, nbytes in terms)
    terms += [(t.item, t.source.split(": ", 1)[1], sizes_at(t.bytes, sizes.values)) for t in peak_terms]
    peak = sum(b for item, _, b in terms if item != "input")
    if optimizer_bytes:
        terms.append(("optimizer", "state and masters", optimizer_bytes))
    return {"inputs": input_bytes, "peak": peak, "peak_at": held[-1].source, "optimizer": optimizer_bytes,
            "total": input_bytes + peak + optimizer_bytes, "terms": terms}


def ledger(backend) -> Ledger:
    """The ledger of a backend's compiled step (``backend.prepare`` and one forward/backward run first)."""
    if backend.model is None:
        raise FxShardError("the backend has no prepared model: call `model, opt = backend.prepare(model, opt)` and "
                           "run a step through torch.compile(model, backend=backend) first")
    world = sharded_world_size(backend.model) or 1
    return ledger_of_graphs(backend.graphs, world_size=world, optimizer=backend.optimizer, model=backend.model)
