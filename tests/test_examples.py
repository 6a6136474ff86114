"""The examples run under torchrun (env://) as well as with plain python (tests/test_checkpoint.py runs
train_gpt.py both ways)."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_custom_schedule_runs_under_torchrun():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "examples" / "custom_schedule.py"), "--steps", "1"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "all issued before the first wait" in run.stdout and run.stdout.rstrip().endswith("True"), run.stdout


def test_train_gpt_trains_on_a_hybrid_mesh_under_torchrun():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               str(ROOT / "examples" / "train_gpt.py"), "--mesh", "2x2", "--steps", "3",
               "--compiler", "eager"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "on 4 gloo ranks as a 2x2 mesh" in run.stdout and "step   2  loss" in run.stdout, run.stdout
    assert "N=2, R=2" in run.stdout and "all_reduce over replicas" in run.stdout, run.stdout
