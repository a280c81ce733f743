"""``scripts/setup`` installs the CPU build of torch from PyTorch's CPU index, and
an index it cannot reach costs a 5-second probe, not minutes: the real script in a
real bash, with a fake venv whose ``pip`` records what it was asked to install."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def fake_venv(tmp_path: Path) -> Path:
    """A venv without torch: ``python`` is the real one except that torch does not import."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    (bin_dir / "python").write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1" = "-c" ] && [[ "$2" == *"import torch"* ]]; then exit 1; fi\n'
        f'exec "{sys.executable}" "$@"\n'
    )
    (bin_dir / "pip").write_text(f'#!/usr/bin/env bash\necho "$@" >> "{tmp_path / "pip.log"}"\n')
    for name in ("python", "pip"):
        (bin_dir / name).chmod(0o755)
    return tmp_path / "venv"


def run_setup(tmp_path: Path, index: str) -> tuple[subprocess.CompletedProcess[str], float, str]:
    venv = fake_venv(tmp_path)
    env = {**os.environ, "NAND_VENV": str(venv), "NAND_TORCH_INDEX": index}
    env["NAND_SETUP_ONLY"] = "torch"
    started = time.monotonic()
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    log = tmp_path / "pip.log"
    return done, time.monotonic() - started, log.read_text() if log.exists() else ""


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_reachable_cpu_index_is_used_for_the_pinned_torch(tmp_path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    index = f"http://127.0.0.1:{server.server_port}/whl/cpu"
    try:
        done, _, pip = run_setup(tmp_path, index)
    finally:
        server.shutdown()
    assert done.returncode == 0, done.stderr
    assert pip.split() == ["install", "--progress-bar", "on", "torch==2.13.0", "--index-url", index]
    assert f"setup: installing torch==2.13.0, CPU build, from {index}" in done.stdout


def test_an_unreachable_index_falls_back_to_the_default_one_at_once(tmp_path) -> None:
    index = f"http://127.0.0.1:{closed_port()}/whl/cpu"
    done, seconds, pip = run_setup(tmp_path, index)
    assert done.returncode == 0, done.stderr
    assert pip.split() == ["install", "--progress-bar", "on", "torch==2.13.0"]
    assert "cannot be reached; installing torch==2.13.0 from the default index" in done.stdout
    assert seconds < 30


@pytest.mark.slow
def test_an_index_that_never_answers_costs_the_probe_timeout_only(tmp_path) -> None:
    with socket.socket() as silent:  # accepts connections (backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        done, seconds, pip = run_setup(tmp_path, f"http://127.0.0.1:{silent.getsockname()[1]}")
    assert done.returncode == 0, done.stderr
    assert "--index-url" not in pip and "torch==2.13.0" in pip
    assert 4 < seconds < 30, seconds
