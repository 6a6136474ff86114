"""A cost model that works on CPU: seconds per graph node from FLOPs, bytes touched and bytes sent.

Inductor's overlap scheduler estimates collectives with NCCL formulas and compute with GPU peak numbers
(``get_gpu_dram_gbps`` needs triton), so it cannot run on a CPU-only machine. This model is a roofline of four numbers,
read from ``meta["val"]`` (FakeTensors) only:

- a compute node takes ``max(flops / flops_per_s, bytes / memory_bytes_per_s)``: FLOPs from
  ``torch.utils.flop_counter.flop_registry`` (matmuls, convolutions, attention), bytes = its tensor inputs and outputs;
  views and ``getitem`` are free;
- a collective takes ``latency_s + sent / link_bytes_per_s``, where a ring all-gather or reduce-scatter sends
  (N-1)/N of the full buffer per rank and an all-reduce twice that;
- waits and everything else that moves no data cost nothing.

The defaults are round numbers for one CPU thread per rank and gloo over loopback; ``CostModel.measured(group)``
times a matmul, a copy and an all-gather on this machine instead. Scheduling decisions must be the same on every
rank (a different collective order on two ranks hangs or mixes up buffers), so ``measured`` averages its
measurements over the group and the defaults are constants.
"""

from __future__ import annotations

import dataclasses
import time

import torch
from torch import fx
from fxshard.runtime.collectives import COLLECTIVE_ROLES
from fxshard.torch_compat import FLOPS_COUNTED_AS, tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from .fx_utils import aliases_its_input, replica_ranks, size_hint


def tensor_bytes(value) -> int:
    """Bytes of every tensor in ``value`` (a tensor, or a nested list / tuple of them)."""
    leaves, _ = tree_flatten(value)
    return sum(size_hint(t.numel()) * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def _values(arg):
    return arg.meta.get("val") if isinstance(arg, fx.Node) else arg


def node_flops(node: fx.Node) -> int:
    """FLOPs of a node by torch's flop counter formulas; 0 for ops it has no formula for."""
    target = node.target
    key = getattr(target, "overloadpacket", None)
    key = FLOPS_COUNTED_AS.get(key, key)
    formula = flop_registry.get(key) or flop_registry.get(target)
    if formula is None or node.meta.get("val") is None:
        return 0
    args = tree_map(_values, node.args)
    kwargs = tree_map(_values, node.kwargs)
    try:
        return size_hint(formula(*args, out_val=node.meta["val"], **kwargs))
    except Exception:  # a formula that rejects these arguments (shapes it does not expect): count no FLOPs
        return 0


def _is_free(node: fx.Node) -> bool:
    return node.op != "call_function" or aliases_its_input(node)


def best_time(fn, repeats: int = 5) -> float:
    """The shortest of ``repeats`` timed calls of ``fn`` (after one untimed warm-up call), in seconds."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Seconds per node: ``compute_s`` for computation, ``collective_s`` for communication (see the module doc)."""

    flops_per_s: float = 2e10
    memory_bytes_per_s: float = 5e9
    link_bytes_per_s: float = 1e9
    latency_s: float = 1e-4

    def compute_s(self, node: fx.Node) -> float:
        if _is_free(node):
            return 0.0
        touched = tensor_bytes(node.meta.get("val")) + sum(
            tensor_bytes(a.meta.get("val")) for a in node.all_input_nodes)
        return max(node_flops(node) / self.flops_per_s, touched / self.memory_bytes_per_s)

    def collective_s(self, node: fx.Node, world_size: int) -> float:
        """Time of a collective node (role ``all_gather``, ``reduce_scatter`` or ``all_reduce``) over ``world_size``
        ranks, or over the ``ranks`` its meta names (a hybrid mesh's replicas)."""
        role = node.meta["fxshard"]["role"]
        world_size = replica_ranks(node) or world_size
        full = tensor_bytes(node.meta.get("val") if role == "all_gather" else node.args[0].meta.get("val"))
        share = (world_size - 1) / max(world_size, 1)
        sent = full * share * (2 if role == "all_reduce" else 1)
        return self.latency_s + sent / self.link_bytes_per_s

    def node_s(self, node: fx.Node, world_size: int) -> float:
        if node.meta.get("fxshard", {}).get("role") in COLLECTIVE_ROLES:
            return self.collective_s(node, world_size)
        if node.meta.get("fxshard", {}).get("role") == "wait":
            return 0.0
        return self.compute_s(node)

    @classmethod
    def measured(cls, group=None, repeats: int = 5) -> CostModel:
        """Calibrate on this machine: a 256x256 matmul, a 16 MiB copy and (with an initialized process group) a
        1 MiB all-gather, each the best of ``repeats``; averaged over the group so every rank schedules alike."""
        import torch.distributed as dist

        def best(fn) -> float:
            return best_time(fn, repeats)

        a = torch.randn(256, 256)
        flops_per_s = 2 * 256**3 / best(lambda: a @ a)
        source = torch.empty(4 << 20)
        target = torch.empty_like(source)
        memory_bytes_per_s = 2 * source.nbytes / best(lambda: target.copy_(source))
        figures = [flops_per_s, memory_bytes_per_s, cls.link_bytes_per_s, cls.latency_s]
        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size(group)
            shard = torch.empty((1 << 18) // world)
            full = torch.empty(shard.numel() * world)
            tiny, tiny_full = torch.empty(1), torch.empty(world)
            latency = best(lambda: dist.all_gather_into_tensor(tiny_full, tiny, group=group))
            big = best(lambda: dist.all_gather_into_tensor(full, shard, group=group))
            sent = full.nbytes * (world - 1) / world
            figures[2:] = [sent / max(big - latency, 1e-9), latency]
            agreed = torch.tensor(figures, dtype=torch.float64)
            dist.all_reduce(agreed, group=group)
            figures = (agreed / world).tolist()
        return cls(*figures)


def exposed_communication(gm: fx.GraphModule, world_size: int, model: CostModel | None = None) -> dict:
    """Estimate, for a lowered graph in its current order, how much communication compute hides.

    A collective overlaps the compute between it and its ``wait``; what it does not cover is exposed. Collectives
    are taken one at a time (a real link runs them in sequence, so this is a lower bound on exposed time).
    Returns ``{"compute_s", "communication_s", "exposed_s"}``.
    """
    model = model or CostModel()
    compute = communication = exposed = 0.0
    pending: dict[fx.Node, list[float]] = {}  # collective -> [its time, compute seen since it was issued]
    for node in gm.graph.nodes:
        role = node.meta.get("fxshard", {}).get("role")
        if role in COLLECTIVE_ROLES:
            pending[node] = [model.collective_s(node, world_size), 0.0]
            communication += pending[node][0]
        elif role == "wait" and node.args and node.args[0] in pending:
            needed, covered = pending.pop(node.args[0])
            exposed += max(0.0, needed - covered)
        elif node.op == "call_function":
            seconds = model.compute_s(node)
            compute += seconds
            for entry in pending.values():
                entry[1] += seconds
    exposed += sum(needed - covered for needed, covered in pending.values() if needed > covered)
    return {"compute_s": compute, "communication_s": communication, "exposed_s": exposed}
