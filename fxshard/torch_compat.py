"""Every private torch API fxshard calls, in one module that knows torch 2.11 to 2.15.

fxshard lives on torch's internals (Dynamo's sources, AOTAutograd's descriptors and partitioner, Inductor's
per-graph entry points, the profiler's events, and in torch.distributed the process groups by name, gloo's options,
the default store and DCP's flat keys), which move between releases. The rest of fxshard and the passes
import them from here, so a new torch release is one file to read. Where releases differ:

| what | 2.11 | 2.13, 2.15 |
|---|---|---|
| a SymInt's hint | ``symbolic_shapes.size_hint`` | ``symbolic_shapes.optimization_hint`` |
| Inductor's forward/backward config | ``create_compiler_config_extra(inductor.config)`` | ``...(dynamo_gm)`` |
| a profiled op's input dtypes | not on ``FunctionEvent`` | ``FunctionEvent.input_dtypes`` |

The profiler's raw events (``kineto_results``) carry shapes and dtypes on every release, so ``profiled_ops`` reads
those and needs no branch.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import inspect
import os
import traceback

import torch
import torch.distributed as dist
from torch._dynamo.exc import ShortenTraceback
from torch._dynamo.source import ConstantSource, LocalSource, TensorProperty, TensorPropertySource
from torch._functorch._aot_autograd.descriptors import SavedForBackwardsAOTOutput
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._guards import detect_fake_mode
from torch._logging._internal import register_log, trace_log, trace_structured
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental import symbolic_shapes
from torch.utils._pytree import tree_flatten, tree_map

__all__ = [
    "after_grad_scaler_inf_check", "aot_module_simplified", "boxed_freeing_inputs", "c10d_functional",
    "child_modules", "concatenate_meshes", "ConstantSource", "dcp_flat_keys", "default_store", "detect_fake_mode",
    "FakeTensor", "fake_store", "flatten_optimizer_state_dict", "FLOPS_COUNTED_AS", "gloo_threads",
    "gloo_with_options",
    "graph_root", "inductor_backward", "inductor_compiler_config", "inductor_decompositions", "inductor_forward",
    "inductor_partition", "inductor_segment", "inductor_virtualized", "intercept_conversions",
    "is_backend_registered", "is_persistent_buffer", "lazy_graph_module", "LocalSource",
    "min_cut_rematerialization_partition", "model_outputs", "name_parameter_source", "op_arguments", "op_name",
    "OpOverload", "own_buffers", "own_parameters", "profiled_item_size", "profiled_ops", "ProfiledOp",
    "raised_inside_torch", "register_log", "report_output_strides", "resolve_group", "SavedForBackwardsAOTOutput",
    "ShortenTraceback", "strided_shard", "taking_boxed_inputs", "tensor_version", "TensorProperty",
    "TensorPropertySource", "total_norm_from", "trace_log", "trace_structured", "traced_size", "tree_flatten",
    "tree_map", "view_base",
]

# The functional collectives' op namespace: what fxshard's graphs hold (all_gather_into_tensor, reduce_scatter_tensor,
# all_reduce, all_to_all_single, wait_tensor). Its name is private; its ops have been stable since torch 2.3.
c10d_functional = torch.ops._c10d_functional

# torch's flop counter has formulas for the CUDA flash attention ops only; the CPU ones (private names, on every
# release from 2.11 to 2.15) take the same leading arguments (query, key, value; grad_out first in backward) and
# do the same work
FLOPS_COUNTED_AS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: torch.ops.aten._scaled_dot_product_flash_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        torch.ops.aten._scaled_dot_product_flash_attention_backward,
}

_hint = getattr(symbolic_shapes, "optimization_hint", None) or symbolic_shapes.size_hint


def traced_size(value: torch.SymInt) -> int:
    """The size ``value`` had in the example inputs it was traced with, without adding a guard."""
    return int(_hint(value))


def inductor_decompositions() -> dict:
    """The decomposition table Inductor lowers with (AOT must decompose the joint graph with the same one)."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def inductor_compiler_config(dynamo_gm: torch.fx.GraphModule):
    """What Inductor's forward and backward entry points share about one Dynamo graph (cudagraphs, graph id,
    forward device): built from the graph since torch 2.12, from Inductor's config module before."""
    from torch._inductor import compile_fx
    from torch._inductor import config as inductor_config

    create = compile_fx.create_compiler_config_extra
    takes_config = "config" in inspect.signature(create).parameters
    return create(inductor_config if takes_config else dynamo_gm)


def inductor_forward(gm, example_inputs, *, model_outputs: int, model_inputs: int, config, inference: bool):
    """Inductor's forward (or inference) graph entry point, as ``torch.compile(backend="inductor")`` calls it."""
    from torch._inductor import compile_fx

    return compile_fx.compile_fx_forward(gm, example_inputs, num_orig_model_outputs=model_outputs,
                                         num_example_inputs=model_inputs, compiler_config_extra=config,
                                         is_inference=inference)


def inductor_virtualized(example_inputs):
    """The context Inductor's passes expect around AOT autograd (``torch._inductor.virtualized.V``'s fake mode, which
    its joint-graph passes create seeds and pattern values under): the fake mode of the graph's example inputs."""
    from torch._inductor.virtualized import V

    return V.set_fake_mode(detect_fake_mode(example_inputs))


def inductor_partition(joint: torch.fx.GraphModule, joint_inputs, **kwargs):
    """Inductor's partition of a joint graph, as ``torch.compile(backend="inductor")`` partitions it: its joint-graph
    passes first (random ops replaced by seeded ones that backward can replay, pattern rewrites), then the min-cut
    partitioner with Inductor's rules for what is cheap to recompute."""
    from torch._inductor import compile_fx

    return compile_fx.partition_fn(joint, joint_inputs, **kwargs)


def lazy_graph_module(root: torch.nn.Module, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A GraphModule that generates its Python code when first run or read (``.code``), not when built or
    recompiled (``torch.fx._lazy_graph_module``, private, on 2.11 to 2.15; what Dynamo and AOT autograd hand
    backends): a copy the passes rewrite and nobody runs costs no code generation."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    return _LazyGraphModule(root, graph)


def inductor_segment(gm: torch.fx.GraphModule, example_inputs, *, backward: bool):
    """One segment of a forward or backward graph compiled by Inductor's per-graph entry point, every output keeping
    the strides its example value has (the next segment was compiled for them), without cudagraphs (a segment's
    inputs come from eager collectives). The strides Inductor reports for AOT autograd are the whole graph's, set by
    ``report_output_strides``, not a segment's."""
    from torch._guards import TracingContext
    from torch._inductor import compile_fx
    from torch._inductor.utils import BoxedBool

    output = gm.graph.output_node()
    output.meta["user_visible_output_idxs"] = list(range(len(output.args[0])))
    with TracingContext.report_output_strides():
        return compile_fx.compile_fx_inner(gm, example_inputs, is_backward=backward, cudagraphs=BoxedBool(False))


def report_output_strides(gm: torch.fx.GraphModule) -> None:
    """Tell AOT autograd the strides of a compiled graph's outputs (it restrides the saved activations it hands the
    backward by them), as Inductor does for a graph it compiled whole: here, each output's example value's."""
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    if context is None or context.output_strides is None:
        return
    values = [node.meta.get("val") if isinstance(node, torch.fx.Node) else node
              for node in gm.graph.output_node().args[0]]
    context.output_strides.extend(v.stride() if isinstance(v, torch.Tensor) else None for v in values)


def inductor_backward(gm, example_inputs, *, config):
    from torch._inductor import compile_fx

    return compile_fx.compile_fx_backward(gm, example_inputs, compiler_config_extra=config)


def model_outputs(dynamo_gm: torch.fx.GraphModule) -> int:
    """How many outputs the user's (Dynamo's) graph returns, as Inductor counts them."""
    from torch._inductor import compile_fx

    return compile_fx.get_num_model_outputs(dynamo_gm)


@dataclasses.dataclass(frozen=True)
class ProfiledOp:
    name: str
    start_ns: int
    input_shapes: list
    input_dtypes: list  # the C++ type names: "float", "c10::BFloat16", ...


# The C++ type names torch's profiler gives each dtype (torch 2.11-2.15), by bytes per element
_PROFILED_ITEM_SIZES = {
    "double": 8, "float": 4, "c10::Half": 2, "c10::BFloat16": 2,
    "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1, "c10::Float8_e4m3fnuz": 1, "c10::Float8_e5m2fnuz": 1,
    "c10::Float8_e8m0fnu": 1,
    "long int": 8, "int": 4, "short int": 2, "signed char": 1,
    "long unsigned int": 8, "unsigned int": 4, "short unsigned int": 2, "unsigned char": 1, "bool": 1,
    "c10::complex<double>": 16, "c10::complex<float>": 8, "c10::complex<c10::Half>": 4,
}


def profiled_item_size(type_name: str) -> int | None:
    """Bytes per element of a dtype as torch's profiler names it (``ProfiledOp.input_dtypes``); None for a name
    this table lacks."""
    return _PROFILED_ITEM_SIZES.get(type_name)


def op_name(op: OpOverload) -> str:
    """An op's name without its namespace and overload: ``"all_gather_into_tensor"``."""
    return op._opname


def profiled_ops(profiled: torch.profiler.profile) -> list[ProfiledOp]:
    """The CPU ops a finished ``torch.profiler.profile(record_shapes=True)`` recorded, in the order they began."""
    events = profiled.profiler.kineto_results.events()
    ops = [ProfiledOp(e.name(), e.start_ns(), e.shapes(), e.dtypes()) for e in events]
    return sorted(ops, key=lambda op: op.start_ns)


# --- nn.Module, Tensor and FX internals -------------------------------------------------------------------------


def own_parameters(module: torch.nn.Module) -> dict:
    """The parameter slots of ``module`` itself (not its children), by name, writable: prepare and materialisation
    put a tensor in a slot without ``register_parameter``'s checks (a DTensor leaf, a meta placeholder)."""
    return module._parameters


def own_buffers(module: torch.nn.Module) -> dict:
    """The buffer slots of ``module`` itself, by name, writable."""
    return module._buffers


def child_modules(module: torch.nn.Module) -> dict:
    """``module``'s direct children by attribute name (None where a slot is empty)."""
    return module._modules


def is_persistent_buffer(module: torch.nn.Module, name: str) -> bool:
    """Whether ``module``'s own buffer ``name`` goes into its state dict."""
    return name not in module._non_persistent_buffers_set


def intercept_conversions(module: torch.nn.Module, apply) -> None:
    """Make ``apply(fn, recurse=True)`` what ``module``'s ``.to()``, ``.double()``, ``.cuda()`` ... run in place of
    ``nn.Module._apply`` (for this instance only)."""
    module.__dict__["_apply"] = apply


def raised_inside_torch(error: BaseException) -> bool:
    """Whether the deepest frame of ``error``'s traceback is in torch's own files."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(os.path.dirname(torch.__file__))


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``tensor`` is a view of, or None."""
    return tensor._base


def tensor_version(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter: it grows with every in-place write."""
    return tensor._version


def name_parameter_source(gm: torch.fx.GraphModule, name: str, source) -> None:
    """Tell AOT where the attribute ``name`` of a Dynamo graph came from (it asks Dynamo's record), for a tensor
    the backend added to the graph itself."""
    if hasattr(gm, "_param_name_to_source"):
        gm._param_name_to_source[name] = source


def op_arguments(op: OpOverload) -> list:
    """The schema's arguments of an op (each with ``name``, ``has_default_value()``, ``default_value``)."""
    return op._schema.arguments


def graph_root(graph: torch.fx.Graph) -> torch.fx.Node:
    """The sentinel node an FX graph's node list starts at: ``append`` to it to insert at the top."""
    return graph._root


# --- torch.distributed internals ---------------------------------------------------------------------------------


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The live process group registered under ``group_name``; RuntimeError or ValueError once it is destroyed."""
    return dist.distributed_c10d._resolve_process_group(group_name)


def after_grad_scaler_inf_check(hook) -> None:
    """Call ``hook(optimizer, found_inf_per_device)`` each time a ``torch.amp.GradScaler`` (``torch.cuda.amp``'s
    too) has unscaled an optimizer's gradients and flagged inf/NaN, before it decides to step: its private
    ``_unscale_grads_`` is what both ``unscale_`` and ``step`` call. ``ShardedGradScaler`` has a method of its own
    and reduces its flags itself. Installed once per hook."""
    from torch.amp import GradScaler

    checked = GradScaler._unscale_grads_
    if hook in getattr(checked, "fxshard_hooks", ()):
        return

    @functools.wraps(checked)
    def unscale_grads(self, optimizer, inv_scale, found_inf, allow_fp16):
        found_inf_per_device = checked(self, optimizer, inv_scale, found_inf, allow_fp16)
        hook(optimizer, found_inf_per_device)
        return found_inf_per_device

    unscale_grads.fxshard_hooks = (*getattr(checked, "fxshard_hooks", ()), hook)
    GradScaler._unscale_grads_ = unscale_grads


def total_norm_from(hook) -> None:
    """``torch.nn.utils.get_total_norm`` (and ``clip_grad_norm_``, which calls it through its module's private
    ``_get_total_norm``) asks ``hook(tensors, norm_type)`` first and takes a tensor it returns as the total norm;
    None leaves the computation to torch. ``error_if_nonfinite`` holds either way. Installed once per hook."""
    from torch.nn.utils import clip_grad

    computed = clip_grad._get_total_norm
    if hook in getattr(computed, "fxshard_hooks", ()):
        return

    @functools.wraps(computed)
    def get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        listed = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        total = hook(listed, float(norm_type)) if listed else None
        if total is None:
            return computed(listed, norm_type, error_if_nonfinite, foreach)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                               "non-finite, so it cannot be clipped")
        return total

    get_total_norm.fxshard_hooks = (*getattr(computed, "fxshard_hooks", ()), hook)
    clip_grad._get_total_norm = get_total_norm
    torch.nn.utils.get_total_norm = get_total_norm


def default_store() -> dist.Store:
    """The store the default process group was built on (every rank of the job reaches it)."""
    return dist.distributed_c10d._get_default_store()


def is_backend_registered(name: str) -> bool:
    return name.upper() in dist.Backend._plugins


def gloo_with_options(store, rank: int, world_size: int, *, timeout: datetime.timedelta, threads: int):
    """A gloo backend with ``threads`` worker threads: init_process_group and new_group take no gloo options, so
    the options object (private on every release) is filled in here."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._threads = threads
    options._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(store, rank, world_size, options)


def gloo_threads(group: dist.ProcessGroup) -> int | None:
    """How many worker threads ``group``'s CPU backend runs, if it is gloo (None: not gloo, or no CPU backend)."""
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:  # no CPU backend (NCCL only)
        return None
    return backend.options._threads if isinstance(backend, dist.ProcessGroupGloo) else None


def flatten_optimizer_state_dict(state_dict: dict) -> dict:
    """``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``'s layout of an optimizer state dict."""
    from torch.distributed.checkpoint.state_dict import _flatten_optim_state_dict

    return _flatten_optim_state_dict(state_dict)


def dcp_flat_keys(state_dict: dict) -> dict:
    """The flat keys DCP stores a nested state dict under (``optim.state.fc1.weight.exp_avg``), with their values."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state_dict)
    return flat


def fake_store() -> dist.Store:
    """The store torch's single-process ``fake`` backend is initialised with."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def concatenate_meshes(meshes: list) -> "torch.distributed.device_mesh.DeviceMesh":
    """One DeviceMesh whose dimensions are those of ``meshes`` (slices of one mesh, on no common dimension), as
    FSDP2 joins its data-parallel mesh to a tensor-parallel one; RuntimeError for slices of different meshes, or
    slices that overlap."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh._concatenate(meshes)


def strided_shard(dim: int, split_factor: int):
    """``_StridedShard(dim, split_factor)``: a dimension split over one mesh dimension AFTER another mesh dimension
    to its right has split it ``split_factor`` ways (FSDP2's data-parallel placement of a dim-0 tensor-parallel
    shard)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def reset_compiled() -> None:
    """Forget every frame Dynamo compiled (a fresh trace of the next call)."""
    torch._dynamo.reset()


def flash_attention(query, key, value, dropout_p: float, is_causal: bool, scale):
    """The flash attention kernel's (output, logsumexp) of (batch, heads, seq, dim) inputs: the CPU op, which has a
    meta kernel and which ``FLOPS_COUNTED_AS`` counts as CUDA's."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal,
                                                                      scale=scale)


def boxed_freeing_inputs(gm: torch.fx.GraphModule):
    """``gm`` as a boxed compiled graph (the list AOTAutograd hands it is emptied on entry) whose code drops each
    input after its last reader, as Inductor's compiled graphs do: a backward's saved activations then die where the
    ledger and the prefetch pass say (``passes.fx_utils.storage_lifetimes``), not when the backward returns. ``gm``
    itself keeps its own calling convention (its code is what reports print)."""
    graph = torch.fx.Graph()
    graph.set_codegen(torch.fx.graph._BoxedCodeGen())  # private, on 2.11 to 2.15
    graph.output(graph.graph_copy(gm.graph, {}))
    boxed = torch.fx.GraphModule(gm, graph)

    def run(args: list):
        return boxed(args)

    return taking_boxed_inputs(run)


def taking_boxed_inputs(compiled):
    """Mark ``compiled`` as a compiled graph that takes its inputs as one list and empties it, as AOT autograd calls
    Inductor's graphs (``_boxed_call``): AOT then hands it the list and drops its own references."""
    compiled._boxed_call = True
    return compiled
