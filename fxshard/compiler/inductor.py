"""The rewritten graphs compiled by Inductor, as ``torch.compile``'s default backend compiles them."""

from __future__ import annotations

from torch import fx

from fxshard.torch_compat import (
    inductor_backward,
    inductor_compiler_config,
    inductor_decompositions,
    inductor_forward,
    inductor_partition,
    inductor_segment,
    inductor_virtualized,
    model_outputs,
    report_output_strides,
)

from .segments import SegmentPlan, plan_segments, segmented_callable


class InductorCompiler:
    """Compiles the graphs AOT derives from one Dynamo graph with Inductor, as ``torch.compile(backend="inductor")``
    would compile them.

    ``compile_fx_inner``, Inductor's per-graph entry point, takes every graph for a forward unless told otherwise: a
    backward graph would miss Inductor's backward-only rules (contiguous inputs for fallback kernels, symbolic sizes
    of dynamic shapes), and no output would be marked user-visible, which is what keeps eager's output strides.
    Inductor's own forward and backward wrappers set those from facts about the Dynamo graph, shared by both.
    """

    def __init__(self, dynamo_gm: fx.GraphModule, example_inputs, regional: bool = True):
        self.regional = regional
        self.decompositions = inductor_decompositions()
        self._config = inductor_compiler_config(dynamo_gm)
        self._num_outputs = model_outputs(dynamo_gm)
        self._num_inputs = len(example_inputs)
        self._example_inputs = example_inputs

    def around_aot(self):
        """The context AOT autograd runs in, as under ``torch.compile``'s default backend: Inductor's joint-graph
        passes (in ``partition``) make seeds and pattern values under the graph's fake mode."""
        return inductor_virtualized(self._example_inputs)

    @staticmethod
    def partition(joint: fx.GraphModule, joint_inputs, **kwargs):
        """The joint graph split into forward and backward as Inductor splits it, after its joint-graph passes:
        without them a random op (dropout) reaches Inductor's lowering unreplaced and the compile fails."""
        return inductor_partition(joint, joint_inputs, **kwargs)

    def compile(self, kind: str, gm: fx.GraphModule, example_inputs) -> tuple:
        """``gm`` compiled, and the plan it was compiled by: a segment at a time, each distinct segment once
        (``fxshard.compiler.segments``), or whole (``regional=False``, an inference graph, or where the plan says)."""
        if not self.regional:
            plan = SegmentPlan([], "regional=False")
        elif kind == "inference":
            plan = SegmentPlan([], "an inference graph")
        else:
            plan = plan_segments(gm)
        if plan.whole_because:
            return self._compile_whole(kind, gm, example_inputs), plan
        compiled = segmented_callable(gm, plan, lambda segment, example: inductor_segment(
            segment, example, backward=kind == "backward"))
        report_output_strides(gm)
        return compiled, plan

    def _compile_whole(self, kind: str, gm: fx.GraphModule, example_inputs):
        if kind == "backward":
            return inductor_backward(gm, example_inputs, config=self._config)
        return inductor_forward(gm, example_inputs, model_outputs=self._num_outputs, model_inputs=self._num_inputs,
                                config=self._config, inference=kind == "inference")
