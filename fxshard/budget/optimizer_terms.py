"""The ledger's optimizer terms: the state each elementwise optimizer keeps per element, the master copies and
state the prepared optimizer holds, its step's eager collectives and their worst points, and the bytes it keeps
outside every graph (see fxshard/budget/step_ledger.py)."""

from __future__ import annotations

import dataclasses

import sympy
import torch

from fxshard.errors import FxShardError
from fxshard.runtime.optim import sharded_step_of
from fxshard.runtime.optimizer_record import updating_optimizer
from fxshard.runtime.param import prepared_param, spec_of
from fxshard.runtime.sharding import row_size

from .graph_terms import Param, Sizes, width_of
from .symbols import B_GRAD, B_MASTER, B_PARAM, B_STATE, N, R, Term, psi, shard


# What each elementwise optimizer keeps per element of what it updates (0-dim "step" counters are not counted).
def optimizer_state_kinds(name: str, group: dict) -> tuple[str, ...]:
    """State tensors an optimizer class (by name: ``"AdamW"``) keeps per element, given a param group's settings."""
    if name in ("Adam", "AdamW"):
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
    if name == "SGD":
        return ("momentum_buffer",) if group.get("momentum", 0) else ()
    if name == "Adagrad":
        return ("sum",)
    if name == "Adamax":
        return ("exp_avg", "exp_inf")
    if name == "RMSprop":
        return (("square_avg",) + (("momentum_buffer",) if group.get("momentum", 0) else ())
                + (("grad_avg",) if group.get("centered") else ()))
    if name in ("NAdam", "RAdam"):
        return ("exp_avg", "exp_avg_sq")
    raise FxShardError(f"the ledger does not know the state of {name}; use an optimizer fxshard supports")


def optimizer_terms(optimizer, params: list[Param], sizes: Sizes,
                    published: set[str] = frozenset()) -> tuple[list, list, list, list]:
    """The master copy and state the optimizer keeps, the optimizer step's eager collectives (one per bucket of
    its ``ShardedStep``; none for what a compiled step graph gathers: ``published`` names those parameters), the
    compute copies mixed precision would add where the graph reads the master itself, and the step's schedule
    rows."""
    by_name = {p.name: p for p in params}

    def count_of(spec) -> sympy.Symbol:
        param = by_name.get(spec.name)
        count = psi(spec.name) if param is None else param.count
        sizes.values.setdefault(count, spec.numel)
        return count

    def shard_of(spec) -> sympy.Expr:
        return shard(count_of(spec), row_size(spec.full_shape))

    memory, copies = [], []
    for group in optimizer.param_groups:
        kinds = optimizer_state_kinds(type(optimizer).__name__, group)
        for tensor in group["params"]:
            spec = spec_of(tensor)
            if spec is None or not tensor.requires_grad:
                continue
            count = count_of(spec)
            elements = shard_of(spec) if spec.stage >= 1 and spec.chunk != spec.numel else count  # a shard's rows
            source = f"optimizer: {spec.name}"
            memory.append(Term("memory", "master", elements, width_of(tensor, B_MASTER, sizes.values), source))
            for kind in kinds:
                memory.append(Term("memory", kind, elements, width_of(tensor, B_STATE, sizes.values), source))
            reads = by_name[spec.name].reads if spec.name in by_name else "local"
            if reads in ("local", "gathered"):  # the graph reads the master: mixed precision adds a compute copy
                read = count if reads == "local" else shard_of(spec)
                copies.append(Term("memory", "compute copy", read, B_PARAM, f"graph reads {spec.name}"))
    comm, rows = [], []
    step = sharded_step_of(optimizer)
    shards = step.shards()
    to_publish = [s for s in shards if spec_of(s).name not in published]
    for kind, role, taken in (("all_gather", B_PARAM, to_publish),
                              ("reduce_scatter", B_GRAD, shards if step.stage == 1 else [])):
        for index, bucket in enumerate(step.buckets(kind, taken)):
            elements = sympy.Add(*(shard_of(spec_of(s)) for s in bucket)) * (1 if kind == "all_gather" else N)
            dtype_of = torch.empty(0, dtype=step.collective_dtype(kind, bucket[0]))
            width = width_of(dtype_of, role, sizes.values)
            comm.append(Term("comm", kind, elements, width, f"optimizer step: {kind} bucket {index}", calls=1,
                             unit=f"step bucket {index}"))
            rows.append({"graph": "optimizer step", "position": index, "collective": kind,
                         "unit": f"step bucket {index}", "params": [spec_of(s).name for s in bucket], "node": "-"})
            replicas = spec_of(bucket[0]).replicate_size
            if kind == "reduce_scatter" and replicas > 1:  # hybrid mesh: the reduced shards, averaged over R ranks
                sizes.values[R] = replicas
                comm.append(Term("comm", "all_reduce", elements / N, width,
                                 f"optimizer step: all_reduce over replicas bucket {index}", calls=1,
                                 unit=f"step bucket {index}", ranks=R))
                rows.append({**rows[-1], "collective": "all_reduce over replicas"})
    return memory, comm, copies, rows


def step_peaks(step_collectives: list[Term], gradients: list[Term]) -> list[list[Term]]:
    """The eager optimizer step's worst points, one per bucket collective: the gradients backward left (held until
    the step), the bucket's input buffer (the shards or padded gradients, concatenated) and its output (the whole
    all-gather, or one rank's share of a reduce-scatter; an all-reduce's is its input's size)."""
    peaks = []
    for term in step_collectives:
        output = {"reduce_scatter": term.elements / N, "all_gather": term.elements * N}.get(term.item, term.elements)
        peaks.append([dataclasses.replace(g, section="peak") for g in gradients] + [
            Term("peak", "step bucket", term.elements, term.width, f"{term.source} input"),
            Term("peak", "step bucket", output, term.width, f"{term.source} output"),
            Term("peak", "peak point", sympy.Integer(0), sympy.Integer(0), term.source),
        ])
    return peaks


def optimizer_bytes(optimizer) -> int:
    """Bytes per rank the optimizer keeps that no graph of the model takes as input: its state for every element
    it updates (the state kinds of ``optimizer_state_kinds``, allocated at the first step), and the tensors it
    updates that are copies of their own, not storage of the model's parameters (stage 1's master shards; stages
    2-3's flat shards are the storage of the leaves)."""
    total = 0
    for group in updating_optimizer(optimizer).param_groups:
        kinds = optimizer_state_kinds(type(optimizer).__name__, group)
        for tensor in group["params"]:
            if not tensor.requires_grad:
                continue
            record = prepared_param(tensor)
            per_element = len(kinds) + (record is not None and record.master is tensor)
            total += per_element * tensor.numel() * tensor.element_size()
    return total
