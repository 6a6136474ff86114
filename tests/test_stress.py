"""examples/stress.py's verdicts, on made-up rank exits and soak figures, and one real short run of the command
(the real stress runs and the soak are a command, not a test)."""

import json

import fxshard
from examples import stress
from examples.stress import (
    RankExit, RunResult, StressConfig, parse_args, soak_failures, soak_progress, summary_rows,
)

STAGE3 = StressConfig("gpt", 3, 1, "eager")
STAGE0 = StressConfig("llama", 0, 0, "inductor")
# What a rank killed by glibc's heap check on a gloo worker thread leaves in its log (faulthandler's dump after it).
GLOO_RACE_DEATH = [
    "rank 1: step 10 loss 4.8795 rss 433.7 MiB 12.6 s",
    "malloc(): unaligned tcache chunk detected",
    "Fatal Python error: Aborted",
    "",
    "Thread 0x00007f6b925bab80 (most recent call first):",
    '  File "examples/stress.py", line 224 in rank_main',
]
PEER_OF_A_DEATH = ["Traceback (most recent call last):",
                   "RuntimeError: [pair.cc:537] Read error: Connection reset by peer"]


def run(config, *ranks) -> RunResult:
    return RunResult(0, config, 1.0, list(ranks))


def test_a_rank_killed_by_a_signal_is_one_death_whatever_its_peer_did():
    result = run(STAGE3, RankExit(0, 1, "r0.log", PEER_OF_A_DEATH), RankExit(1, -6, "r1.log", GLOO_RACE_DEATH))
    assert result.outcome == "death"
    dead = result.ranks[1]
    assert (dead.signal_name, dead.fatal_message) == ("SIGABRT", "malloc(): unaligned tcache chunk detected")
    assert dead.crashed_thread.startswith("a thread without Python frames")
    assert dead.last_lines() == GLOO_RACE_DEATH[:2]  # the rank's own output, not faulthandler's dump
    explained = result.explain()
    assert "rank 1: killed by SIGABRT: malloc(): unaligned tcache chunk detected" in explained
    assert "rank 1's last output lines" in explained and "rank 0's last output lines" not in explained


def test_an_exception_or_a_hang_is_a_failure_and_a_clean_run_is_ok():
    raised = run(STAGE0, RankExit(0, 1, "r0.log", ["ValueError: boom"]), RankExit(1, 1, "r1.log", PEER_OF_A_DEATH))
    hung = run(STAGE0, RankExit(0, None, "r0.log", [], killed_because="hung"), RankExit(1, 0, "r1.log", []))
    clean = run(STAGE0, RankExit(0, 0, "r0.log", ["rank 0: done"]), RankExit(1, 0, "r1.log", ["rank 1: done"]))
    assert (raised.outcome, hung.outcome, clean.outcome) == ("failure", "failure", "ok")
    assert "killed by this command (hung)" in hung.explain()


def test_summary_has_a_row_per_configuration_run_and_the_total():
    death = run(STAGE3, RankExit(0, 1, "r0.log", PEER_OF_A_DEATH), RankExit(1, -11, "r1.log", ["Segmentation fault"]))
    ok = run(STAGE3, RankExit(0, 0, "r0.log", []), RankExit(1, 0, "r1.log", []))
    failed = run(STAGE0, RankExit(0, 1, "r0.log", []), RankExit(1, 0, "r1.log", []))
    unused = StressConfig("gpt", 1, 2, "eager")
    assert summary_rows([death, ok, failed], [STAGE3, unused, STAGE0]) == [
        ["gpt stage 3 prefetch 1 eager", 2, 1, 0],
        ["llama stage 0 prefetch 0 inductor", 1, 0, 1],
        ["total", 3, 1, 1],
    ]


def test_command_line():
    args = parse_args(["--runs", "4", "--stages", "3", "--prefetch", "1,2", "--models", "llama"])
    assert (args.runs, args.steps, args.stages, args.prefetch, args.models) == (4, 60, [3], [1, 2], ["llama"])
    assert args.compilers == ["eager", "inductor"]
    soak = parse_args(["--soak"])
    assert (soak.soak, soak.steps, soak.compilers) == (True, 2000, [fxshard.api.DEFAULT_COMPILER])


MIB = 2**20


def test_a_soak_passes_with_flat_memory_after_step_100_and_no_new_graph():
    warming_up = [300 * MIB + step * MIB for step in range(100)]  # growth before step 100 is not judged
    settled = [400 * MIB + (step % 7) * MIB for step in range(1900)]  # 1.5% of noise
    assert soak_failures(warming_up + settled, graphs_after_first_step=1, graphs_at_end=1) == []


def test_a_soak_fails_on_memory_that_grows_3_percent_or_on_a_recompilation():
    growing = [400 * MIB] * 100 + [400 * MIB + step * 12 * MIB // 1900 for step in range(1900)]  # +3%
    assert soak_failures(growing, 1, 1) == ["RSS varied by 3.00% (max/min - 1) from step 100 on, more than 2%"]
    flat = [400 * MIB] * 2000
    assert soak_failures(flat, 1, 2) == ["1 graph(s) compiled after the first step (a recompilation)"]
    assert len(soak_failures(growing, 1, 3)) == 2


def test_one_real_stress_run_ends_ok(tmp_path, monkeypatch):
    for variable in ("LIBC_FATAL_STDERR_", "OMP_NUM_THREADS"):  # main sets them for the ranks it starts
        monkeypatch.setenv(variable, "1")
    argv = ["--runs", "1", "--steps", "3", "--stages", "3", "--prefetch", "1", "--models", "llama",
            "--compilers", "eager", "--log-dir", str(tmp_path)]
    assert stress.main(argv) == 0
    (result,) = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert result["outcome"] == "ok" and [r["exitcode"] for r in result["ranks"]] == [0, 0], result
    assert result["config"] == {"model": "llama", "stage": 3, "prefetch": 1, "compiler": "eager"}
    assert "rank 1: step 2 loss" in (tmp_path / "run0000-llama-s3-p1-eager-rank1.log").read_text()


def test_the_soak_reports_steps_done_elapsed_and_remaining_from_rank_0s_output():
    assert soak_progress("rank 0: fxshard from ...\n", 2000, 5.0) is None  # compiling: no step printed yet
    output = "rank 0: step 0 loss 4.8 rss 410.0 MiB 5.0 s\nrank 0: step 100 loss 3.1 rss 411.0 MiB 9.0 s\n"
    assert soak_progress(output, 2000, 101.0) == "soak: step 101/2000  elapsed 0:01:41  remaining ~0:31:39"
