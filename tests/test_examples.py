"""The examples run under torchrun (env://) as well as with plain python, spawning their own ranks
(tests/test_checkpoint.py runs train_gpt.py both ways too), and what they print fits in 120 characters a line."""

import os
import pathlib
import subprocess
import sys

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


def test_custom_schedule_runs_with_python_spawning_its_ranks():
    # torchrun's path through examples/launch.py is the demo's, tested below; the eager compiler: the schedule is
    # the same, and Inductor would compile for about 15 s more on 2 cores
    run = _run([sys.executable, str(ROOT / "examples" / "custom_schedule.py"), "--steps", "1", "--compiler", "eager"])
    assert "all issued before the first wait" in run.stdout and run.stdout.rstrip().endswith("True"), run.stdout


def test_the_demo_trains_under_torchrun_and_every_line_of_its_report_fits():
    # `make demo`'s command with 2 steps instead of 30 and the eager compiler: Inductor would compile for about 15 s
    # more on 2 cores
    run = _run([*TORCHRUN, "--nproc-per-node", "2", str(ROOT / "examples" / "train_gpt.py"), "--steps", "2",
                "--compiler", "eager"])
    assert "on 2 gloo ranks, ZeRO stage 3" in run.stdout and "step   1  loss" in run.stdout, run.stdout
    assert "collective schedule (graph order)" in run.stdout and "ψ₁ = " in run.stdout, run.stdout
    assert _too_wide(run.stdout) == []


def test_train_gpt_trains_on_a_hybrid_mesh_under_torchrun():
    run = _run([*TORCHRUN, "--nproc-per-node", "4", str(ROOT / "examples" / "train_gpt.py"), "--mesh", "2x2",
                "--steps", "3", "--compiler", "eager"])
    assert "on 4 gloo ranks as a 2x2 mesh" in run.stdout and "step   2  loss" in run.stdout, run.stdout
    assert "N=2, R=2" in run.stdout and "all_reduce over replicas" in run.stdout, run.stdout
    assert _too_wide(run.stdout) == []
