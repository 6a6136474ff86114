"""python -m fxshard budget / report / simulate."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from fxshard import FxShardError
from fxshard.__main__ import main
from test_simulate import trace_event_format_errors


def test_budget_reproduces_the_zero_paper_table(capsys):
    # ZeRO paper, Table 1: 7.5B parameters, 64 ranks, mixed-precision Adam: 120, 31.4, 16.6, 1.88 GB per rank
    assert main(["budget", "--params", "7.5e9", "--world", "64", "--stage", "0,1,2,3", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)["stages"]
    assert [round(r["total"] / 1e9, 2) for r in rows] == [120.0, 31.41, 16.64, 1.88]
    assert [r["total_form"] for r in rows] == ["16*Ψ", "4*Ψ*(N + 3)/N", "2*Ψ*(N + 7)/N", "16*Ψ/N"]
    assert [r["sent"] / (2 * 7.5e9 * 63 / 64) for r in rows] == pytest.approx([2, 2, 2, 3])


@pytest.mark.parametrize("options, per_psi_ring", [
    ([], [2, 2, 3]),  # bytes per element in units of b_param (N - 1)/N: the ZeRO paper's 2Ψ, 2Ψ, 3Ψ
    # a byte and a block's scale per element; stage 2's step gathers unpacked, stage 1's communication all runs there
    (["--quantize-grads", "int8"], [2, 1 + (1 + 4 / 256) / 2, 2 + (1 + 4 / 256) / 2]),
    (["--quantize-weights", "int8", "--quantize-grads", "int8"], [2, 1 + (1 + 4 / 256) / 2, 3 * (1 + 4 / 256) / 2]),
    (["--reshard-after-forward", "false"], [2, 2, 2]),  # backward reads the weights forward gathered
])
def test_budget_prices_the_wire_options_and_reshard_after_forward(capsys, options, per_psi_ring):
    assert main(["budget", "--params", "7.5e9", "--world", "64", "--stage", "1,2,3", "--format", "json",
                 *options]) == 0
    rows = json.loads(capsys.readouterr().out)["stages"]
    assert [r["sent"] / (2 * 7.5e9 * 63 / 64) for r in rows] == pytest.approx(per_psi_ring)


def test_budget_prices_reshard_after_forward_over_k_ranks(capsys):
    # hpZ: forward gathers over N, backward re-gathers over the K ranks of a node, reductions over N
    assert main(["budget", "--params", "7.5e9", "--world", "64", "--stage", "3", "--reshard-after-forward", "8",
                 "--format", "json"]) == 0
    row = json.loads(capsys.readouterr().out)["stages"][0]
    assert row["sent"] == pytest.approx(2 * 7.5e9 * (2 * 63 / 64 + 7 / 8))
    assert main(["budget", "--params", "7.5e9", "--world", "64", "--stage", "3", "--reshard-after-forward", "6"]) == 2


def test_budget_text_labels_decimal_and_binary_units(capsys):
    assert main(["budget", "--params", "1e9", "--world", "8", "--stage", "3"]) == 0
    out = capsys.readouterr().out
    assert "2.00 GB (1.86 GiB)" in out and "GiB = 2^30 bytes" in out


def test_budget_prints_the_prepare_peak_of_a_model_built_on_meta_and_built_whole(capsys):
    # 70B parameters on 8 ranks, bf16 compute copy and fp32 master, a block of 0.86B the largest unit: stage 3
    # starts within 80 GB born on meta (its share 35 GB + one block 3.44 GB), never built whole (280 GB + share)
    args = ["budget", "--params", "7e10", "--world", "8", "--stage", "0,3", "--unit-params", "8.6e8"]
    assert main([*args, "--format", "json"]) == 0
    rows = {r["stage"]: r for r in json.loads(capsys.readouterr().out)["stages"]}
    assert rows[3]["prepare_meta_form"] == "4*U + 4*Ψ/N" and rows[3]["prepare_meta"] == pytest.approx(38.44e9)
    assert rows[3]["prepare_whole_form"] == "4*Ψ + 4*Ψ/N" and rows[3]["prepare_whole"] == pytest.approx(315e9)
    assert rows[0]["prepare_meta"] == pytest.approx(4 * (7e10 + 8.6e8)) and rows[0]["prepare_whole"] == 2.8e11
    assert main(args) == 0
    assert "38.44 GB (35.80 GiB)" in capsys.readouterr().out
    assert main(["budget", "--params", "7e10", "--world", "8", "--stage", "3", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["stages"][0]["prepare_meta"] is None  # U unknown: the form alone
    assert main([*args[:-1], "8e10"]) == 2
    assert "--unit-params" in capsys.readouterr().err


def test_budget_takes_the_tensor_parallel_degree(capsys):
    # 70B parameters of which TP splits 68B over T = 8 (the rest, embeddings and norms, whole on every tp rank):
    # fxshard shards 68e9/8 + 2e9 = 10.5e9 elements per tp rank over N = 8, 16 bytes each with mixed-precision Adam
    assert main(["budget", "--params", "7e10", "--world", "8", "--tp", "8", "--tp-params", "6.8e10", "--stage", "3",
                 "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params_per_tp_rank"] == 10.5e9 and out["stages"][0]["total"] == pytest.approx(16 * 10.5e9 / 8)
    assert main(["budget", "--params", "7e10", "--mesh", "4x8x8", "--tp-params", "6.8e10", "--stage", "3"]) == 0
    assert "T = 8 tensor-parallel ranks (256 ranks in all)" in capsys.readouterr().out
    assert main(["budget", "--params", "7e10", "--mesh", "4x8x8", "--tp", "2"]) == 2
    assert "then no --tp" in capsys.readouterr().err
    assert main(["budget", "--params", "7e10", "--world", "8", "--tp", "8", "--tp-params", "8e10"]) == 2
    assert "--tp-params" in capsys.readouterr().err


def test_budget_rejects_bad_stages(capsys):
    assert main(["budget", "--params", "1e9", "--world", "8", "--stage", "0,4"]) == 2
    assert "stages are 0, 1, 2, 3" in capsys.readouterr().err


SCRIPT = textwrap.dedent('''
    import datetime, tempfile, torch, torch.distributed as dist, torch.nn.functional as F
    import fxshard
    from examples.models import MLP
    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    backend = fxshard.backend(compiler="eager", stage=3)
    model = MLP()
    model, opt = backend.prepare(model, torch.optim.AdamW(model.parameters()))
    run = torch.compile(model, backend=backend, fullgraph=True)
    for _ in range(2):
        F.mse_loss(run(torch.randn(4, 8)), torch.randn(4, 5)).backward()
        opt.step()
        opt.zero_grad()
''')


def _fxshard(*arguments: str) -> subprocess.CompletedProcess:
    root = pathlib.Path(__file__).parents[1]
    return subprocess.run([sys.executable, "-m", "fxshard", *arguments], capture_output=True, text=True, timeout=120,
                          cwd=root, env={**os.environ, "PYTHONPATH": str(root)})


def _report(script: pathlib.Path) -> subprocess.CompletedProcess:
    return _fxshard("report", "--format", "json", str(script))


def test_report_runs_a_script_and_prints_its_ledger(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = _report(script)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout[out.stdout.index("{"):])
    comm = [r for r in report["ledger"] if r["what"].endswith("calls)")]
    assert {r["what"].split()[0] for r in comm} == {"all_gather", "reduce_scatter"}
    for row in comm:  # the last of the two steps: the profiler also saw the first one's compile-time tracing
        assert row["measured"] == row["bytes"] > 0, row
    assert report["schedule"][0]["collective"] == "all_gather"
    assert "measured in the last of 2 optimizer steps" in report["title"]


def test_report_of_a_single_step_has_no_measured_column(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace("range(2)", "range(1)"))
    out = _report(script)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "no measured column: it ran 1 optimizer step(s)" in out.stderr
    report = json.loads(out.stdout[out.stdout.index("{"):])
    assert all(r["measured"] is None for r in report["ledger"])


# a script that compiles a step of the MLP per stage, under a fake process group of 2 ranks (one process)
SIMULATED_SCRIPT = textwrap.dedent('''
    import sys, torch, torch.nn.functional as F
    import fxshard
    from examples.models import MLP
    from fxshard.testing import fake_process_group
    with fake_process_group(2):
        for stage in map(int, sys.argv[1:]):
            torch._dynamo.reset()
            backend = fxshard.backend(compiler="eager", stage=stage)
            model = MLP()
            model, _ = backend.prepare(model, torch.optim.AdamW(model.parameters()))
            run = torch.compile(model, backend=backend, fullgraph=True)
            F.mse_loss(run(torch.randn(4, 8)), torch.randn(4, 5)).backward()
''')
COMMUNICATED = {  # the MLP's collectives per stage, (graph, node)
    3: {("graph 0 forward", "all_gather_fc1"), ("graph 0 forward", "all_gather_fc2"),
        ("graph 0 backward", "all_gather_fc2"), ("graph 0 backward", "reduce_scatter_fc2"),
        ("graph 0 backward", "reduce_scatter_fc1")},
    2: {("graph 0 backward", "reduce_scatter_fc2"), ("graph 0 backward", "reduce_scatter_fc1"),
        ("optimizer step", "all_gather")},  # the updated shards, gathered back into the full parameters
}


@pytest.mark.parametrize("stages, files", [((3,), ["step.json"]), ((3, 2), ["step-0.json", "step-1.json"])])
def test_simulate_writes_each_backends_simulated_step_as_a_chrome_trace(stages, files, tmp_path, capsys,
                                                                         monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the command hands the script its own
    script = tmp_path / "train.py"
    script.write_text(SIMULATED_SCRIPT)
    assert main(["simulate", str(script), *map(str, stages), "--trace", str(tmp_path / "step.json"),
                 "--world", "8"]) == 0
    out = capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.glob("*.json")) == files
    for stage, name in zip(stages, files):
        assert f"{tmp_path / name}: stage {stage} at 8 ranks on GLOO_ON_CPU (gloo on one CPU host, calibrated)\n" \
               "  step " in out, out
        trace = json.loads((tmp_path / name).read_text())
        assert trace_event_format_errors(trace) == []
        assert trace["otherData"]["world"] == 8
        lanes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
        assert lanes == {"compute", "communication"}
        communicated = {(e["cat"], e["name"]) for e in trace["traceEvents"]
                        if e["ph"] == "X" and e["args"]["stream"] == "communication"}
        assert communicated == COMMUNICATED[stage]


@pytest.mark.parametrize("machine", ["h100-sxm-400g", "file"])
def test_simulate_predicts_on_the_machine_given_by_preset_or_json_file(machine, tmp_path, capsys, monkeypatch):
    from fxshard.simulate.machines import PRESETS, load_machine

    monkeypatch.setattr(sys, "argv", list(sys.argv))
    script = tmp_path / "train.py"
    script.write_text(SIMULATED_SCRIPT)
    if machine == "file":
        machine = str(tmp_path / "my_cluster.json")
        pathlib.Path(machine).write_text(json.dumps({"flops_per_s": 1e12, "bandwidth": 1e8, "latency": 1e-5}))
    assert main(["simulate", str(script), "3", "--trace", str(tmp_path / "step.json"), "--world", "8",
                 "--machine", machine]) == 0
    out = capsys.readouterr().out
    expected = load_machine(machine)
    assert f"at 8 ranks on {expected.name}\n" in out, out
    assert expected is PRESETS[machine] if machine in PRESETS else expected.name == "my_cluster"
    written = json.loads((tmp_path / "step.json").read_text())
    step_ms = float(out.split("  step ")[1].split(" ms")[0])
    assert step_ms == pytest.approx(max(e["ts"] + e["dur"] for e in written["traceEvents"] if e["ph"] == "X") / 1e3,
                                    abs=1e-3)
    assert written["otherData"]["world"] == 8


def test_simulate_options_compares_the_machines_named(tmp_path, capsys, monkeypatch):
    from fxshard.simulate.machines import PRESETS

    monkeypatch.setattr(sys, "argv", list(sys.argv))
    script = tmp_path / "train.py"
    script.write_text(SIMULATED_SCRIPT)
    assert main(["simulate", str(script), "3", "--options", "--node", "2", "--machine",
                 "a100-sxm-100g,h100-sxm-400g"]) == 0
    out = capsys.readouterr().out
    for name in ("a100-sxm-100g", "h100-sxm-400g"):
        assert f"{PRESETS[name].name}: predicted step (ms)" in out, out
    assert main(["simulate", str(script), "3", "--trace", str(tmp_path / "t.json"), "--machine",
                 "a100-sxm-100g,h100-sxm-400g"]) == 2
    assert "--trace predicts on one" in capsys.readouterr().err


def test_a_machine_that_is_neither_a_preset_nor_a_file_of_its_fields_is_refused(tmp_path):
    from fxshard.simulate.machines import load_machine

    with pytest.raises(FxShardError, match=r"no machine preset named 'h200'.*h100-sxm-400g"):
        load_machine("h200")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"flops": 1e12}))
    with pytest.raises(FxShardError, match=r"flops is not a field of Machine \(flops_per_s, "):
        load_machine(str(bad))


def test_simulate_of_a_script_that_prepares_no_backend_says_so(tmp_path):
    script = tmp_path / "nothing.py"
    script.write_text("print('no fxshard here')")
    assert main(["simulate", str(script), "--trace", str(tmp_path / "step.json")]) == 2
    assert not (tmp_path / "step.json").exists()
