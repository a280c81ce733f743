"""The suite's own guard (``tests/conftest.py``, ``_nand_stayed_on``): a
healthy-run test fails when nand switched itself off during it.

An internal error in the agent is logged and nand turns itself off, the
training goes on (``nand/agent/safety.py``). A healthy run then still ends
with ``first is None``: without the guard these tests passed with nand off.
Here they run in a pytest of their own with the early-warning function made
to raise (``tests/planted_error.py``), and each must fail, saying why.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]

#: Healthy runs that assert nothing was found, and nothing of nand's log:
#: each passed with the early-warning function raising before the guard.
HEALTHY = [
    "tests/agent/test_deferred.py::"
    "test_finite_gradients_whose_float32_norm_overflows_are_no_false_alarm",
    "tests/agent/test_edge_cases.py::test_a_2_norm_overflow_of_finite_gradients_is_not_reported",
    "tests/agent/test_edge_cases.py::"
    "test_an_inline_minus_inf_attention_mask_passed_to_a_child_is_not_an_incident",
    "tests/agent/test_blowup.py::test_healthy_training_of_the_benchmark_models_never_warns"
    "[sequential_mlp]",
]


def outcomes(report: Path) -> dict[str, list[str]]:
    """Test name -> the messages of its failures and errors (none: passed)."""
    found: dict[str, list[str]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.attrib["name"]
        found.setdefault(name, [])
        for bad in (*case.iter("failure"), *case.iter("error")):
            found[name].append(bad.attrib.get("message", "") + (bad.text or ""))
    return found


@pytest.mark.slow
def test_a_healthy_run_fails_when_nand_switched_itself_off(tmp_path):
    report = tmp_path / "report.xml"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    done = subprocess.run(
        [*PYTEST, "-p", "tests.planted_error", f"--junitxml={report}", *HEALTHY],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    found = outcomes(report)
    assert len(found) == len(HEALTHY), found
    for name, messages in found.items():
        said = "\n".join(messages)
        assert "nand switched itself off: RuntimeError: planted" in said, (name, said)
        assert "internal error in step boundary" in said, (name, said)
