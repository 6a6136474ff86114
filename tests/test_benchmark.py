"""The benchmark (examples/benchmark.py): its bookkeeping as pure functions, and the Chrome traces it writes of a
profiled step on a pool of 2 gloo ranks."""

import collections
import json
import pathlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fxshard
from examples.benchmark import (
    CONFIGS, loss_disagreements, peak_of_running_sum, profiled, progress_line, ring_bytes_sent, unsettled, write_traces,
)
from examples.models import MLP
from test_simulate import trace_event_format_errors


def test_every_fxshard_stage_has_a_prefetch_and_a_no_prefetch_row():
    fxshard_rows = {(c.stage, c.options.get("prefetch")) for c in CONFIGS if c.kind == "fxshard"}
    assert fxshard_rows == {(stage, prefetch) for stage in range(4) for prefetch in (None, 0)}
    assert [c.name for c in CONFIGS[:4]] == ["ddp", "ddp+compile", "fsdp2", "fsdp2+compile"]


def test_peak_of_running_sum():
    assert peak_of_running_sum([]) == 0
    assert peak_of_running_sum([-5, -3]) == 0  # frees of blocks from before never go below the start
    assert peak_of_running_sum([10, 20, -20, 5, -15]) == 30


def test_ring_bytes_sent():
    # world 2: an all-reduce sends half its buffer twice, an all-gather sends its whole input once
    assert ring_bytes_sent({"AR": [3, 1000], "AG": [2, 400]}, world=2) == 1000 + 400
    assert ring_bytes_sent({"AG": [1, 300]}, world=4) == 900


def test_loss_disagreements_names_the_outlier_against_the_median():
    good = [7.61, 6.0187]
    losses = {"ddp": good, "fsdp2": [7.61, 6.0187 * (1 + 1e-4)], "fxshard-3-prefetch": [7.61, 6.5]}
    problems = loss_disagreements(losses)
    assert list(problems) == ["fxshard-3-prefetch"] and "final loss 6.500000" in problems["fxshard-3-prefetch"]
    assert "first loss" in loss_disagreements({"a": good, "b": good, "c": [7.62, 6.0187]})["c"]


def test_unsettled_compares_the_medians_of_the_two_halves():
    assert unsettled([0.2, 0.21, 0.2, 0.19, 0.2, 0.2]) is None
    assert unsettled([0.2, 0.2, 0.2, 0.3, 0.3, 0.3]) == (0.2, 0.3)
    assert unsettled([0.2, 0.5]) is None  # too few steps to tell


def test_progress_line_estimates_the_remaining_time_from_the_finished_runs():
    assert progress_line(0, 4, "ddp", 3, 40, 0.4) == \
        "[1/4] ddp: 3 warm-up + 40 timed steps; elapsed 0:00:00, remaining ?"
    assert progress_line(2, 8, "fsdp2 without communication", 1, 5, 70.0) == \
        "[3/8] fsdp2 without communication: 1 warm-up + 5 timed steps; elapsed 0:01:10, remaining ~0:03:30"


def traces_of_a_profiled_step(directory: str) -> None:
    """Every rank: the MLP at stage 3, one step to compile, one profiled as the benchmark profiles its step, then
    ``write_traces`` (which calibrates a machine on this configuration: a few more steps)."""
    torch.manual_seed(0)
    backend = fxshard.backend(compiler="eager", stage=3)
    model = MLP()
    model, optimizer = backend.prepare(model, torch.optim.AdamW(model.parameters()))
    run = torch.compile(model, backend=backend, fullgraph=True)

    def step():
        F.mse_loss(run(torch.randn(4, 8)), torch.randn(4, 5)).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    write_traces("fxshard-3", profiled(step), backend, step, dist.get_world_size(), pathlib.Path(directory))


def test_trace_writes_the_measured_and_the_simulated_step_as_chrome_traces(pools, tmp_path):
    pools(2).run(traces_of_a_profiled_step, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fxshard-3-measured.json", "fxshard-3-simulated.json"]
    measured, simulated = (json.loads((tmp_path / f"fxshard-3-{kind}.json").read_text())
                           for kind in ("measured", "simulated"))
    assert trace_event_format_errors(measured) == [] and trace_event_format_errors(simulated) == []
    ran = [e["name"] for e in measured["traceEvents"] if e.get("ph") == "X"]
    assert "aten::mm" in ran and "Optimizer.step#AdamW.step" in ran, sorted(set(ran))
    # the same step: the simulator's 3 all-gathers and 2 reduce-scatters, and the ones gloo ran (fxshard's
    # reduce-scatter on gloo as an all-to-all), beside the step clock's two checks (the forward's, the step's)
    simulated_collectives = collections.Counter(e["name"].split("_fc")[0] for e in simulated["traceEvents"]
                                                if e["ph"] == "X" and e["args"]["stream"] == "communication")
    assert simulated_collectives == {"all_gather": 3, "reduce_scatter": 2}
    assert collections.Counter(n for n in ran if n.startswith("gloo:")) == {"gloo:all_gather": 3 + 2, "gloo:all_to_all": 2}
    assert simulated["otherData"]["world"] == 2
