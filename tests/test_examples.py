"""The examples run under torchrun (env://) as well as with plain python, spawning their own ranks
(tests/test_checkpoint.py spawns train_gpt.py's), and what they print fits in 120 characters a line. Their options
beyond the launch run on the suite's worker pools."""

import os
import pathlib
import subprocess
import sys

import scenarios

ROOT = pathlib.Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
LINE_WIDTH = 120


def _run(command: list[str]) -> subprocess.CompletedProcess:
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def _too_wide(out: str) -> list[str]:
    return [line for line in out.splitlines() if len(line) > LINE_WIDTH]


def test_custom_schedule_issues_every_gather_before_the_first_wait(pools):
    # the eager compiler: the schedule is the same, and Inductor would compile for about 15 s more on 2 cores
    out = pools(2).run(scenarios.example_output, "custom_schedule", ["--steps", "1", "--compiler", "eager"])[0]
    assert "all issued before the first wait" in out and out.rstrip().endswith("True"), out


def test_the_demo_trains_under_torchrun_and_every_line_of_its_report_fits():
    # `make demo`'s command with 2 steps instead of 30 and the eager compiler: Inductor would compile for about 15 s
    # more on 2 cores
    run = _run([*TORCHRUN, "--nproc-per-node", "2", str(ROOT / "examples" / "train_gpt.py"), "--steps", "2",
                "--compiler", "eager"])
    assert "on 2 gloo ranks, ZeRO stage 3" in run.stdout and "step   1  loss" in run.stdout, run.stdout
    assert "collective schedule (graph order)" in run.stdout and "ψ₁ = " in run.stdout, run.stdout
    assert _too_wide(run.stdout) == []


def test_train_gpt_trains_on_a_hybrid_mesh(pools):
    argv = ["--mesh", "2x2", "--steps", "3", "--compiler", "eager"]
    out = pools(4).run(scenarios.example_output, "train_gpt", argv)[0]
    assert "on 4 gloo ranks as a 2x2 mesh" in out and "step   2  loss" in out, out
    assert "N=2, R=2" in out and "all_reduce over replicas" in out, out
    assert _too_wide(out) == []
