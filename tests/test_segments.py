"""Regional compilation (``fxshard.compiler.segments``): how a rewritten graph is cut into segments between its
collectives, which segments are one compile, and the runner that calls them (a fake process group, one process)."""

import torch
import torch.distributed as dist

import scenarios
from examples.models import GPT, GPTConfig, gpt_batch
from fxshard.compiler.segments import (
    Segment,
    SegmentPlan,
    plan_segments,
    runs_between_segments,
    segmented_callable,
    split_at_collectives,
)
from fxshard.simulate.simulator import module_of
from fxshard.testing import fake_process_group
from fxshard.torch_compat import boxed_freeing_inputs
from test_graphs import compile_and_step, final_graphs

SHALLOW = GPTConfig(n_layer=4)


def stack_graphs() -> dict:
    """The final graphs of the 32 residual blocks at stage 3: deep enough that three quarters of the segments
    repeat (``MOST_DISTINCT``)."""
    with fake_process_group(2):
        torch.manual_seed(0)
        return final_graphs(compile_and_step(scenarios.build_model("mlp_stack"), torch.randn(4, 8)))


def test_stage_3_graphs_run_as_segments_between_collectives_and_the_middle_blocks_share_them():
    for kind, gm in stack_graphs().items():
        plan = plan_segments(gm)
        assert not plan.whole_because, kind
        # every call node in exactly one step, in graph order; between segments only collectives and waits
        in_steps = [n for step in plan.steps for n in (step.nodes if isinstance(step, Segment) else [step])]
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        assert sorted(in_steps, key=calls.index) == calls and len(in_steps) == len(calls), kind
        assert all(runs_between_segments(s) for s in plan.steps if not isinstance(s, Segment)), kind
        assert not any(runs_between_segments(n) for s in plan.segments for n in s.nodes), kind
        # a middle block's compute is one compile for several blocks (the blocks at either end are scheduled
        # apart: the root's collectives sit beside them)
        by_key: dict = {}
        for segment in plan.segments:
            blocks = {module_of(n).split(".")[1] for n in segment.nodes if module_of(n).startswith("blocks.")}
            by_key.setdefault(segment.key, set()).update(blocks)
        assert any(len(blocks) >= 2 for blocks in by_key.values()), kind
        assert plan.distinct < len(plan.segments), kind


def test_segmented_graph_computes_what_the_whole_graph_computes():
    # the runner (values between steps, freed after their last reader, boxed segments) on real inputs, each
    # segment run op by op: a world of one gloo rank, so the collectives return real values
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        backend = compile_and_step(GPT(SHALLOW), *gpt_batch(SHALLOW, 2, torch.Generator().manual_seed(0)))
        forward = final_graphs(backend)["forward"]
        plan = SegmentPlan(split_at_collectives(forward.graph))  # cut wherever it can be, whatever repeats
        compiles = []

        def compile_segment(segment_gm, example):
            compiles.append(segment_gm)
            return boxed_freeing_inputs(segment_gm)

        run = segmented_callable(forward, plan, compile_segment)
        assert len(compiles) == plan.distinct
        inputs = [torch.randn(p.meta["val"].shape, dtype=p.meta["val"].dtype) if p.meta["val"].is_floating_point()
                  else torch.randint(0, SHALLOW.vocab_size, p.meta["val"].shape)
                  for p in forward.graph.find_nodes(op="placeholder")]
        boxed = list(inputs)
        got = run(boxed)
        assert boxed == []  # boxed: the argument list is emptied
        want = forward(*inputs)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    finally:
        dist.destroy_process_group()
