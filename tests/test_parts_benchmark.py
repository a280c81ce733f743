"""benchmarks/parts.py patches nand's internals by name: it must still find
them, and leaving each part out must leave training running."""

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
