"""The one estimator of time: what the prefetch pass places gathers by, and what the simulator, autotune and the
report predict with. ``Machine`` is the only set of constants; ``machine=`` on the backend moves placement and
prediction together (the passes read it as ``PassContext.machine``).

Read from ``meta["val"]`` (FakeTensors) only, so it runs on a CPU-only machine (Inductor's own estimator needs triton
and GPU peak figures):

- a compute node takes ``flops / flops_per_s`` for ops torch's flop counter knows (matmuls, convolutions,
  attention), else its bytes written / ``memory_bandwidth`` (none for a view or a getitem of a multi-output op's
  result), plus ``op_overhead`` (the Python and dispatcher cost of one node of an eager-compiled graph);
- a ring collective on N ranks with a full buffer of B bytes takes ``collective_overhead + (N-1)·latency +
  (N-1)/N·B/bandwidth``, an all-reduce two such ring passes (one overhead); an all-to-all (fxshard's reduce-scatter
  on gloo, and every quantized one) sends the same bytes to every peer at once: ``collective_overhead +
  (N-1)·latency + (N-1)/N·B/all_to_all_bandwidth`` (a message per peer);
- a collective across the replicas of a hybrid mesh runs on their R ranks and the inter-group network
  (``replicate_*``), a re-gather from secondary shards on its k ranks and the node's link (``node_*``);
- waits, and everything else that moves no data, cost nothing.

Scheduling decisions must be the same on every rank (a different collective order on two ranks hangs or mixes up
buffers): a ``Machine`` is a constant, or calibrated and averaged over the group (``fxshard.simulate.calibrate``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx
from torch.utils.flop_counter import flop_registry

from fxshard.runtime.collectives import COLLECTIVE_ROLES, WAIT, collective_of
from fxshard.torch_compat import FLOPS_COUNTED_AS, tree_flatten, tree_map

from .fx_utils import aliases_its_input, replica_ranks, size_hint


@dataclasses.dataclass(frozen=True)
class Machine:
    """What one rank and the network can do. Defaults are round numbers for a CPU host on a fast LAN."""

    flops_per_s: float = 5e10
    """FLOP/s of an op that torch's flop counter knows (matmuls, attention)."""
    memory_bandwidth: float = 1e10
    """Bytes/s written by an op without a flop formula."""
    bandwidth: float = 1e10
    """Bytes/s per rank on the ring."""
    latency: float = 2e-5
    """Seconds per ring hop of one collective."""
    collective_overhead: float = 0.0
    """Seconds per collective at any world size: issuing it, handing it to the backend's thread, waking the rank
    that waits for it."""
    op_overhead: float = 0.0
    """Seconds per compute node of a graph, on top of its work: Python and dispatch of the compiled graph."""
    step_overhead: float = 0.0
    """Seconds per step outside the graphs and the optimizer's update: autograd engine, compiled-function
    wrappers, the optimizer's Python, zero_grad."""
    replicate_bandwidth: float | None = None
    """Bytes/s per rank on the ring across the replica groups of a hybrid mesh (often a slower inter-node network);
    None: ``bandwidth``."""
    replicate_latency: float | None = None
    """Seconds per ring hop across the replica groups of a hybrid mesh; None: ``latency``."""
    node_bandwidth: float | None = None
    """Bytes/s per rank inside a node: what the re-gathers from secondary shards (``reshard_after_forward=k``) run
    on, k ranks of one node; None: ``bandwidth``."""
    node_latency: float | None = None
    """Seconds per ring hop inside a node; None: ``latency``."""
    overlap: float = 1.0
    """Share of a collective's time that can run under compute: 1 where the network moves the bytes on its own
    (NCCL, an RDMA NIC); less where moving them takes the cores compute runs on (gloo between the processes of one
    host: the kernel copies every byte through its sockets). The rest holds the compute stream as well."""
    all_to_all_bandwidth: float | None = None
    """Bytes/s per rank of an all-to-all: fxshard's reduce-scatter on gloo and every quantized one, each rank
    sending its rows to every peer at once (gloo on one host moves them faster than an all-gather's); None:
    ``bandwidth``."""
    gathers_into_staging: bool = False
    """Whether the collectives' backend gathers into a buffer of its own and copies out (gloo), so that a gather in
    flight holds its output twice; NCCL writes in place. The prefetch pass's memory estimate counts it."""
    peak_flops_per_s: float | None = None
    """The datasheet's peak FLOP/s, which model FLOPs utilisation (MFU) is reckoned against; None: ``flops_per_s``."""
    name: str = "custom"
    """What the figures describe, as reports and ``python -m fxshard simulate`` name the machine."""

    def across_replicas(self) -> Machine:
        """This machine with the inter-group network as its ring: what a collective across the replicas of a hybrid
        mesh runs on (the per-collective overhead is the host's, the same on either network)."""
        return dataclasses.replace(
            self, bandwidth=self.bandwidth if self.replicate_bandwidth is None else self.replicate_bandwidth,
            latency=self.latency if self.replicate_latency is None else self.replicate_latency)

    def inside_node(self) -> Machine:
        """This machine with a node's own link as its ring: what a re-gather from secondary shards runs on."""
        return dataclasses.replace(
            self, bandwidth=self.bandwidth if self.node_bandwidth is None else self.node_bandwidth,
            latency=self.latency if self.node_latency is None else self.node_latency)


GLOO_ON_CPU = Machine(flops_per_s=8.75e10, memory_bandwidth=1.0e10, bandwidth=9.75e8, latency=0.0,
                      collective_overhead=2.1e-3, op_overhead=9.0e-6, overlap=0.48, all_to_all_bandwidth=1.27e9,
                      gathers_into_staging=True, name="GLOO_ON_CPU (gloo on one CPU host, calibrated)")
"""gloo between processes of one host, one CPU thread per rank: what ``fxshard.simulate.calibrate`` measured on 2
ranks with the benchmark GPT at stage 3 (the machine, the date and how close its predictions came:
docs/simulate.md). What sets it apart: a per-collective overhead far above the per-hop latency, an all-to-all faster
than an all-gather, less than half of a collective's time hidden by compute (the rest takes the cores compute runs
on), and gloo's staging copy of a gather's output."""

NCCL_ON_GPU = Machine(flops_per_s=5e13, memory_bandwidth=2e12, bandwidth=5e10, latency=5e-6,
                      collective_overhead=2e-5, name="NCCL_ON_GPU (one GPU node, stated figures)")
"""NCCL between GPUs of one node: stated (a ring of ~50 GB/s per rank, ~20 µs to launch a collective), not
calibrated; ``calibrate`` on your own cluster for figures to trust."""


def default_machine(device_type: str) -> Machine:
    """The machine graphs on ``device_type`` are scheduled and predicted on when none is given: ``NCCL_ON_GPU`` for
    ``cuda``, else ``GLOO_ON_CPU``."""
    return NCCL_ON_GPU if device_type == "cuda" else GLOO_ON_CPU


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


def compute_seconds(node: fx.Node, machine: Machine) -> float:
    """``flops / flops_per_s`` where torch's flop counter knows the op, else its bytes written / ``memory_bandwidth``
    (none for a view or a getitem of a multi-output op's result), plus ``op_overhead``; a placeholder or the output
    costs nothing."""
    if node.op != "call_function":
        return 0.0
    flops = node_flops(node)
    if flops:
        return flops / machine.flops_per_s + machine.op_overhead
    written = 0 if aliases_its_input(node) else tensor_bytes(node.meta.get("val"))
    return written / machine.memory_bandwidth + machine.op_overhead


def collective_seconds(kind: str, buffer_bytes: float, world: int, machine: Machine) -> float:
    """Alpha-beta time of one collective whose full (unsharded) buffer has ``buffer_bytes``, plus the machine's
    per-collective overhead: a ring pass, two for an all-reduce (reduce-scatter, then all-gather), or for an
    ``all_to_all`` the same bytes at ``all_to_all_bandwidth``, a message to each of the other ranks (one latency
    each, as a ring pays one per hop)."""
    if world <= 1:
        return 0.0
    if kind == "all_to_all":
        bandwidth = machine.all_to_all_bandwidth or machine.bandwidth
        sent = (world - 1) / world * buffer_bytes
        return machine.collective_overhead + (world - 1) * machine.latency + sent / bandwidth
    one_pass = (world - 1) * machine.latency + (world - 1) / world * buffer_bytes / machine.bandwidth
    return machine.collective_overhead + (2 if kind == "all_reduce" else 1) * one_pass


def collective_role(node: fx.Node) -> str | None:
    return node.meta.get("fxshard", {}).get("role")


def full_bytes(node: fx.Node, role: str) -> float:
    """Bytes of a collective's full buffer: the gathered output, or what is reduced (across replicas: the gradient
    shard)."""
    return tensor_bytes((node.meta if role == "all_gather" else node.args[0].meta).get("val"))


def ring_of(node: fx.Node, world: int, machine: Machine) -> tuple[int, Machine]:
    """(ranks, machine) a collective node runs on: across the replicas of a hybrid mesh, their ranks on the
    inter-group network; a re-gather from secondary shards, its ranks on the node's link; else the ``world``
    ranks on the ring's own figures."""
    meta = node.meta.get("fxshard", {})
    if meta.get("across") == "secondary":
        return meta["ranks"], machine.inside_node()
    return replica_ring(replica_ranks(node), world, machine)


def replica_ring(replicas: int | None, world: int, machine: Machine) -> tuple[int, Machine]:
    """(ranks, machine) of a collective across ``replicas`` ranks of a hybrid mesh (the inter-group network), or
    where ``replicas`` is None of one over the ``world`` ranks on the ring's own figures."""
    return (world, machine) if replicas is None else (replicas, machine.across_replicas())


def node_collective_seconds(node: fx.Node, world: int, machine: Machine) -> float:
    """Time of a collective node as the graph holds it (its op's kind, bytes and group; a node a pass marked with a
    collective role, but whose op is none torch has, by its role) over ``world`` ranks."""
    role = collective_role(node)
    collective = collective_of(node.target)
    return collective_seconds(role if collective is None else collective.kind, full_bytes(node, role),
                              *ring_of(node, world, machine))


def exposed_communication(gm: fx.GraphModule, world_size: int, machine: Machine = GLOO_ON_CPU) -> dict:
    """Estimate, for a lowered graph in its current order, how much communication compute hides.

    A collective overlaps the compute between it and its ``wait``; what it does not cover is exposed. Collectives
    are taken one at a time (a real link runs them in sequence, so this is a lower bound on exposed time).
    Returns ``{"compute_s", "communication_s", "exposed_s"}``.
    """
    compute = communication = exposed = 0.0
    pending: dict[fx.Node, list[float]] = {}  # collective -> [its time, compute seen since it was issued]
    for node in gm.graph.nodes:
        role = collective_role(node)
        if role in COLLECTIVE_ROLES:
            pending[node] = [node_collective_seconds(node, world_size, machine), 0.0]
            communication += pending[node][0]
        elif node.target is WAIT and node.args and node.args[0] in pending:
            needed, covered = pending.pop(node.args[0])
            exposed += max(0.0, needed - covered)
        elif node.op == "call_function":
            seconds = compute_seconds(node, machine)
            compute += seconds
            for entry in pending.values():
                entry[1] += seconds
    exposed += sum(needed - covered for needed, covered in pending.values() if needed > covered)
    return {"compute_s": compute, "communication_s": communication, "exposed_s": exposed}
