"""Benchmarks that reach into nand: parts.py patches its internals by name (it
must still find them, and leaving each part out must leave training running);
replay_cost.py times its replay (it must still replay the step it plants);
overhead.py runs each detector the README's commands name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_every_part_is_left_out_and_timed() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "parts.py"), "mlp", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    rows = [line[2:26].strip() for line in done.stdout.splitlines() if line.startswith("  ")]
    timed = {name for name in rows if name}  # (not the columns' header)
    parts = ["early warnings", "analysis", "update plan", "bias-gradient probes", "input probe"]
    parts += ["forward probes", "inline checks", "gradient norms", "held for replay"]
    expected = {"none", "nand", "hooks only", *(f"- {part}" for part in parts)}
    assert timed == expected, done.stdout
    # A part whose patch broke nand would switch it off, which nand logs.
    assert "switched itself off" not in done.stderr, done.stderr


def test_the_replay_cost_benchmark_replays_the_planted_step_and_reports_its_figures() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "replay_cost.py"), "--only", "custom-mlp"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "one replay: " in done.stdout and "peak RSS: bare " in done.stdout, done.stdout
    # The NaN it plants is the one the replay names, in the middle Linear.
    assert "NaN in forward of fc2 (Linear)" in done.stdout, done.stdout
    assert "made by aten::index_fill" in done.stdout, done.stdout


def test_the_overhead_benchmark_times_each_mode_of_nand_against_the_bare_step() -> None:
    detectors = ["none", "floor", "nand", "nand-full", "nand-light", "nand-sync", "nand-no-loss"]
    quick = ["--quick", "--only", "mlp", "--detectors", *detectors]
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "overhead.py"), *quick],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ")}
    assert set(detectors) <= rows, done.stdout
    assert "the loss checks: nand / nand-no-loss" in done.stdout, done.stdout  # (issue 42)
    assert "switched itself off" not in done.stderr, done.stderr
