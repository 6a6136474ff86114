"""Machines as data: presets for the GPU systems users rent, stated from vendor figures, and JSON files for one's own.

A preset is a node of 8 GPUs joined by NVLink (NVSwitch), each GPU with a network link of its own to the other
nodes: a ring over more than one node runs at the network's pace, a re-gather inside a node
(``reshard_after_forward=k``) on NVLink. Each figure is the vendor's peak times a stated efficiency
(``Efficiency``): what a dense bf16 matmul, a copy or a NCCL ring reaches of the peak. Stated, not yet fitted to a
run: docs/simulate.md says where each figure comes from.

``load_machine("h100-sxm-400g")`` gives a preset by name; ``load_machine("my_cluster.json")`` reads a JSON object
of ``Machine``'s fields (any it leaves out keep ``Machine``'s defaults).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from fxshard.errors import FxShardError

from fxshard.passes.cost_model import GLOO_ON_CPU, NCCL_ON_GPU, Machine


@dataclasses.dataclass(frozen=True)
class GPU:
    """A GPU's datasheet peaks: dense bf16 FLOP/s, memory bytes/s, NVLink bytes/s each way."""

    name: str
    bf16_flops_per_s: float
    memory_bytes_per_s: float
    nvlink_bytes_per_s: float


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """The share of each peak a training step's kernels reach: a dense bf16 matmul of a transformer's shapes, a
    copy, a NCCL ring's bus bandwidth."""

    compute: float = 0.7
    memory: float = 0.8
    link: float = 0.8


# NVIDIA's datasheets: A100 80GB SXM (312 TFLOP/s bf16 dense, 2,039 GB/s HBM2e, NVLink 600 GB/s both ways),
# H100 SXM5 80GB (989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, NVLink 900 GB/s both ways)
A100_80GB_SXM = GPU("A100 80GB SXM", 312e12, 2.039e12, 300e9)
H100_80GB_SXM = GPU("H100 80GB SXM", 989e12, 3.35e12, 450e9)
NETWORK_GBITS = (100, 200, 400)  # per GPU: one 100/200/400 Gb/s InfiniBand or RoCE port each
NODE_RANKS = 8
# Stated round figures, not measured here: a ring hop across nodes 5 µs, inside a node 2 µs; launching a collective
# 10 µs; a compiled graph's kernel launch 5 µs
NETWORK_LATENCY, NVLINK_LATENCY, COLLECTIVE_OVERHEAD, OP_OVERHEAD = 5e-6, 2e-6, 1e-5, 5e-6


def ring_bus_bandwidth(gpu: GPU, network_gbits: float) -> float:
    """Bytes/s a ring over several nodes moves (its bus bandwidth: ``(N-1)/N`` of the buffer per second): NCCL runs
    one ring per network port, each carrying its share of the buffer through every GPU, so the node's ports add up
    (``NODE_RANKS`` times one GPU's) until each GPU's NVLink, which every ring crosses, is full."""
    return min(NODE_RANKS * network_gbits / 8 * 1e9, gpu.nvlink_bytes_per_s)


def gpu_node(gpu: GPU, network_gbits: float, efficiency: Efficiency = Efficiency()) -> Machine:
    """A node of ``NODE_RANKS`` ``gpu``s over NVLink, each with a ``network_gbits`` Gb/s port to other nodes."""
    return Machine(
        flops_per_s=gpu.bf16_flops_per_s * efficiency.compute,
        peak_flops_per_s=gpu.bf16_flops_per_s,
        memory_bandwidth=gpu.memory_bytes_per_s * efficiency.memory,
        bandwidth=ring_bus_bandwidth(gpu, network_gbits) * efficiency.link,
        latency=NETWORK_LATENCY,
        node_bandwidth=gpu.nvlink_bytes_per_s * efficiency.link,
        node_latency=NVLINK_LATENCY,
        collective_overhead=COLLECTIVE_OVERHEAD,
        op_overhead=OP_OVERHEAD,
        overlap=1.0,  # NCCL moves the bytes on its own channels while the compute stream runs
        name=f"{gpu.name} x{NODE_RANKS} NVLink, {network_gbits:g} Gb/s per GPU (stated)",
    )


PRESETS: dict[str, Machine] = {
    "gloo-cpu": GLOO_ON_CPU,
    "nccl-gpu": NCCL_ON_GPU,
    **{f"{key}-{gbits}g": gpu_node(gpu, gbits) for key, gpu in (("a100-sxm", A100_80GB_SXM), ("h100-sxm", H100_80GB_SXM))
       for gbits in NETWORK_GBITS},
}


def load_machine(name_or_path: str) -> Machine:
    """A preset by name (``PRESETS``), or the machine a JSON file of ``Machine``'s fields describes."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = pathlib.Path(name_or_path)
    if not path.suffix == ".json":
        raise FxShardError(f"no machine preset named {name_or_path!r}: use one of {', '.join(PRESETS)}, or a .json "
                           "file of Machine's fields")
    try:
        fields = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise FxShardError(f"cannot read the machine file {path}: {error}") from None
    known = [f.name for f in dataclasses.fields(Machine)]
    if not isinstance(fields, dict):
        raise FxShardError(f"{path} must hold a JSON object of Machine's fields: {', '.join(known)}")
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise FxShardError(f"{path}: {', '.join(unknown)} is not a field of Machine ({', '.join(known)})")
    return Machine(**{"name": path.stem, **fields})
