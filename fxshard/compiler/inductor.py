"""The rewritten graphs compiled by Inductor, as ``torch.compile``'s default backend compiles them."""

from __future__ import annotations

from torch import fx


class InductorCompiler:
    """Compiles the graphs AOT derives from one Dynamo graph with Inductor, as ``torch.compile(backend="inductor")``
    would compile them.

    ``compile_fx_inner``, Inductor's per-graph entry point, takes every graph for a forward unless told otherwise: a
    backward graph would miss Inductor's backward-only rules (contiguous inputs for fallback kernels, symbolic sizes
    of dynamic shapes), and no output would be marked user-visible, which is what keeps eager's output strides.
    Inductor's own forward and backward wrappers set those from facts about the Dynamo graph, shared by both.
    """

    def __init__(self, dynamo_gm: fx.GraphModule, example_inputs):
        from torch._inductor import compile_fx
        from torch._inductor.decomposition import select_decomp_table

        self.decompositions = select_decomp_table()
        self._extra = compile_fx.create_compiler_config_extra(dynamo_gm)
        self._num_outputs = compile_fx.get_num_model_outputs(dynamo_gm)
        self._num_inputs = len(example_inputs)

    def compile(self, kind: str, gm: fx.GraphModule, example_inputs):
        from torch._inductor import compile_fx

        if kind == "backward":
            return compile_fx.compile_fx_backward(gm, example_inputs, compiler_config_extra=self._extra)
        return compile_fx.compile_fx_forward(
            gm,
            example_inputs,
            num_orig_model_outputs=self._num_outputs,
            num_example_inputs=self._num_inputs,
            compiler_config_extra=self._extra,
            is_inference=kind == "inference",
        )
