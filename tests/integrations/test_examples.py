"""The framework examples run as a user runs them, and say what the README says.

Each example plants +inf in ``FAULT_LAYER`` at a step and trains through its
framework with nand attached: a real process, the README's command line.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("lightning")
pytest.importorskip("accelerate")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "frameworks"
FAULT_LAYER = "transformer.h.1.mlp.c_fc"


def run_example(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(EXAMPLES / name), "--steps", "6", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name", ["lightning_train.py", "hf_trainer.py", "accelerate_train.py"])
def test_an_example_names_the_planted_layer_and_step(name, tmp_path):
    done = run_example(name, "--fault-step", "3", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    # Lightning's module holds the model as an attribute: its names carry a prefix.
    said = re.search(rf"\+inf in forward of (\w+\.)?{re.escape(FAULT_LAYER)} ", done.stdout)
    assert said is not None, done.stdout[-2000:]
    assert "at step 3" in done.stdout, done.stdout[-2000:]


@pytest.mark.parametrize("name", ["lightning_train.py", "hf_trainer.py"])
def test_an_example_with_raise_stops_with_nonfinite_error(name, tmp_path):
    done = run_example(name, "--fault-step", "3", "--policy", "raise", cwd=tmp_path)
    assert done.returncode != 0
    assert "NonFiniteError" in done.stderr and FAULT_LAYER in done.stderr
