"""Every torch nand claims: the oldest it declares and the newest release, as installed.

Each torch lives in its own environment from the public index (the CUDA build,
running on CPU), built once by ``scripts/torch-env`` and cached outside the
checkout (scripts/test starts the downloads in the background at its start,
so they overlap the suite). In each, a pytest run of the checkout's tests:

- ``tests/agent/test_detection.py``: every fault kind planted at a known
  module, step and phase gives exactly that first event (the accuracy tests
  with a ground truth: the plant is the truth);
- ``tests/integrations/test_truth.py``: the hooks-only ground truth itself;
- ``tests/agent/test_rerun.py``: the replay of the bad step (the op, the line);
- ``tests/agent/test_ddp.py``: 2-rank DDP over gloo end to end (produced vs
  received through the gradient all-reduce).

Below torch 2.6 the replay tests on real models and FSDP2 are left out
(``NEEDS_2_6``): what is left still names every planted fault and replays it.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from nand.torch_support import TORCH_MIN, torches_tested

ROOT = Path(__file__).resolve().parent.parent
SUBSET = [
    "tests/agent/test_detection.py",
    "tests/integrations/test_truth.py",
    "tests/agent/test_rerun.py",
    "tests/agent/test_ddp.py",
]

#: Left out below torch 2.6: the real models (the zoo is written for
#: transformers 5, which needs torch >= 2.6) and FSDP2 on CPU (torch 2.4's
#: fully_shard fails in its own lazy init over gloo).
NEEDS_2_6 = [
    "tests/agent/test_rerun.py::test_gpt2_with_dropout_trains_on_after_a_replay_bit_identically",
    "tests/agent/test_rerun.py::test_resnet_batchnorm_buffers_after_a_replay_are_those_of_skip",
    "tests/agent/test_rerun.py::test_under_gradient_checkpointing_the_backward_fault_is_named",
    "tests/agent/test_rerun.py::test_every_real_model_names_the_planted_write_and_reproduces_it",
    "tests/agent/test_rerun.py::test_fsdp_is_not_replayed_and_says_why_instead_of_waiting_for",
]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]  # (a download may be in progress)


def torch_env(version: str) -> Path:
    """The environment's python; builds it (or waits for the build under way)."""
    done = subprocess.run(
        [str(ROOT / "scripts" / "torch-env"), version],
        capture_output=True,
        text=True,
        timeout=3500,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return Path(done.stdout.strip().splitlines()[-1])


def test_the_torches_tested_are_the_declared_minimum_and_one_newer_than_the_dev_pin():
    oldest, newest = torches_tested()
    assert oldest == "{}.{}.0".format(*TORCH_MIN)
    pin = re.search(r"NAND_TORCH_PIN:-torch==([\d.]+)", (ROOT / "scripts" / "setup").read_text())
    assert pin is not None
    assert release(newest) > release(pin[1])


def release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


@pytest.mark.parametrize("version", torches_tested())
def test_the_agent_finds_planted_faults_replays_and_runs_ddp_on_torch(version, tmp_path):
    python = torch_env(version)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NAND_")}
    env |= {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    said = subprocess.run(
        [str(python), "-c", "import torch, nand; print(torch.__version__, nand.__file__)"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert said.returncode == 0 and said.stderr == "", said.stderr
    found, where = said.stdout.split()
    assert found.split("+")[0] == version
    assert Path(where).is_relative_to(ROOT)  # (the checkout's nand, that torch)
    command = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *SUBSET]
    if release(version) < (2, 6, 0):
        command += [f"--deselect={test}" for test in NEEDS_2_6]
    done = subprocess.run(
        [*command, f"--junitxml={tmp_path / 'junit.xml'}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3000,
    )
    assert done.returncode == 0, f"torch {version}:\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}"
    assert " passed" in done.stdout and " skipped" not in done.stdout, done.stdout[-2000:]
