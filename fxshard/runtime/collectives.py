"""The collectives a step runs, named once: each functional collective op (``_c10d_functional``), its kind, the
names torch's profiler records its calls under, and what fxshard uses it for.

Every one of them takes the buffer this rank contributes first and names its process group last; a graph may hold
fxshard's, DTensor's (tensor parallelism) or the user's own. The passes, the ledger, the simulator, the consistency
check, the trace and ``CollectiveCounter`` read them here.
"""

from __future__ import annotations

import dataclasses

from torch import fx

from fxshard.torch_compat import OpOverload, c10d_functional, op_name

WAIT = c10d_functional.wait_tensor.default


@dataclasses.dataclass(frozen=True)
class Collective:
    """``kind``: the op's own (``"all_to_all"`` for ``all_to_all_single``). ``role``: what fxshard uses it for, the
    ``meta["fxshard"]["role"]`` of the nodes it makes and the ledger's kind: an all-to-all is fxshard's
    reduce-scatter (on a gloo group, followed by a local sum; of quantized gradient rows on any group).
    ``profiled_as``: the names its calls have in torch's profiler (Inductor's code calls the ``_out`` and in-place
    variants, into buffers it allocated)."""

    op: OpOverload
    kind: str
    role: str
    profiled_as: tuple[str, ...]


COLLECTIVES = (
    Collective(c10d_functional.all_gather_into_tensor.default, "all_gather", "all_gather",
               ("_c10d_functional::all_gather_into_tensor", "_c10d_functional::all_gather_into_tensor_out")),
    Collective(c10d_functional.reduce_scatter_tensor.default, "reduce_scatter", "reduce_scatter",
               ("_c10d_functional::reduce_scatter_tensor",)),
    Collective(c10d_functional.all_reduce.default, "all_reduce", "all_reduce",
               ("_c10d_functional::all_reduce", "_c10d_functional::all_reduce_")),
    Collective(c10d_functional.all_to_all_single.default, "all_to_all", "reduce_scatter",
               ("_c10d_functional::all_to_all_single",)),
)
# the roles of the nodes fxshard's lowering makes that communicate, the ledger's kinds of collective
COLLECTIVE_ROLES = tuple(dict.fromkeys(c.role for c in COLLECTIVES))

_BY_OP = {c.op: c for c in COLLECTIVES}
_BY_PROFILED_NAME = {name: c for c in COLLECTIVES for name in c.profiled_as}


def collective_of(target) -> Collective | None:
    """The collective a graph node's target (or any op) is, or None."""
    return _BY_OP.get(target)


def profiled_collective(name: str) -> Collective | None:
    """The collective a call torch's profiler recorded under ``name`` is, or None."""
    return _BY_PROFILED_NAME.get(name)


def group_name_of(node: fx.Node) -> str:
    """The process group a functional collective node runs over (its last argument, for every one of them)."""
    return node.args[-1]


def is_any_collective(target) -> bool:
    """Whether ``target`` is a functional collective, one this table names or any other of the namespace (a
    broadcast, a coalesced variant the user's code calls); ``wait_tensor`` is not one."""
    return (collective_of(target) is not None
            or (isinstance(target, OpOverload) and target.namespace == "_c10d_functional" and target is not WAIT))


def kind_of(target) -> str:
    """A collective's kind: this table's, or the op's own name for any other functional collective."""
    collective = collective_of(target)
    return collective.kind if collective is not None else op_name(target)
