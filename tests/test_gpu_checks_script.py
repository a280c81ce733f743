"""``scripts/gpu-checks`` on a machine without CUDA (CI's): it says so and exits
2 before running anything, so a GPU session's first command cannot fail on a
typo that CI would have caught."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: it would run the checks")
def test_gpu_checks_says_there_is_no_cuda_and_exits_2(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # this python3
    done = subprocess.run(
        [str(ROOT / "scripts" / "gpu-checks"), str(logs)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PATH": path},
    )
    assert done.returncode == 2, done.stderr
    assert "sees no CUDA device" in done.stderr
    assert logs.is_dir() and not any(logs.iterdir())  # nothing ran
