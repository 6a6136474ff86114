"""Every pass's graph and decisions in torch's structured trace (what tlparse renders) and TORCH_LOGS="fxshard"."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from fxshard.api import default_passes

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = """
import torch, fxshard
from fxshard.testing import fake_process_group
from scenarios import build_model
with fake_process_group(2):
    backend = fxshard.backend(compiler="eager", stage=3, memory_budget=1 << 40)  # prefetch is chosen
    model, _ = backend.prepare(build_model("mlp"))
    torch.compile(model, backend=backend)(torch.randn(4, 8)).sum().backward()
"""


def structured_entries(log: str) -> list[tuple[dict, str]]:
    """(metadata, payload) of each entry of a TORCH_TRACE log: a ``V... file:line] {json}`` line, then the payload's
    lines, each starting with a tab."""
    entries = []
    for line in log.splitlines():
        if line.startswith("\t"):
            meta, payload = entries[-1]
            entries[-1] = (meta, payload + line[1:] + "\n")
        else:
            entries.append((json.loads(line[line.index("] ") + 2:]), ""))
    return entries


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    trace_dir = tmp_path_factory.mktemp("trace")
    env = {**os.environ, "TORCH_TRACE": str(trace_dir), "TORCH_LOGS": "fxshard",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    (log,) = trace_dir.glob("*.log")
    artifacts = {meta["artifact"]["name"]: payload for meta, payload in structured_entries(log.read_text())
                 if "artifact" in meta}
    return run.stderr, artifacts, structured_entries(log.read_text())


def test_every_pass_of_every_graph_is_an_artifact_beside_dynamos_graphs(traced):
    _, artifacts, entries = traced
    names = ["input", *(p.__name__ for p in default_passes())]
    for kind in ("joint", "forward", "backward"):
        for index, name in enumerate(names):
            assert f"fxshard_{kind}_{index}_{name}" in artifacts, (kind, name)
            assert f"fxshard_{kind}_{index}_{name}_decisions" in artifacts, (kind, name)
    assert {"dynamo_output_graph", "aot_joint_graph"} <= {key for meta, _ in entries for key in meta}
    lowered = artifacts["fxshard_forward_5_lower_collectives_pass"]
    assert "_c10d_functional.all_gather_into_tensor" in lowered
    assert "all_gather_into_tensor" not in artifacts["fxshard_forward_0_input"]  # markers only, before lowering


def test_the_decisions_are_each_nodes_fxshard_record(traced):
    _, artifacts, _ = traced
    decisions = json.loads(artifacts["fxshard_backward_5_lower_collectives_pass_decisions"])
    gathers = {name: record for name, record in decisions.items() if record.get("role") == "all_gather"}
    scatters = [record for record in decisions.values() if record.get("role") == "reduce_scatter"]
    assert [(r["unit"], r["params"]) for r in gathers.values()] == [("fc2", ["fc2.weight"])]
    assert sorted(r["unit"] for r in scatters) == ["fc1", "fc2"]


def test_torch_logs_fxshard_prints_a_line_per_pass(traced):
    stderr, _, _ = traced
    assert "graph 0 forward, after lower_collectives_pass: 2 all_gather, 2 copy_in, 20 copy_out, 2 wait; 2 units" \
        in stderr, stderr[-2000:]
    assert "graph 0 backward, after prefetch_pass: 1 all_gather, 12 copy_in, 8 copy_out, 2 reduce_scatter, 3 wait; " \
        "2 units" in stderr


def test_the_chosen_knobs_are_an_artifact_and_a_log_line(traced):
    stderr, artifacts, _ = traced
    for kind in ("forward", "backward"):
        choice = json.loads(artifacts[f"fxshard_{kind}_choice"])
        knobs = [c["knobs"] for c in choice["candidates"]]
        assert knobs[0] == 'bucket="auto", prefetch=1, max_inflight_gathers=2' and len(knobs) == 3, knobs
        assert choice["memory_budget"] == 1 << 40 and all(c["fits"] for c in choice["candidates"])
        assert f"graph 0 {kind}: chose {knobs[choice['chosen']]}" in stderr
