"""Real ``nand server`` processes for crash and multi-server tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any


class ServerProcess:
    """``python -m nand.server server`` (or ``-m nand``) on ``db_url``, ``http_url`` once up."""

    def __init__(self, db_url: str, zmq_port: int, module: str = "nand.server", **env: str) -> None:
        self.module = module
        self.db_url = db_url
        self.zmq_endpoint = f"tcp://127.0.0.1:{zmq_port}"
        self.env = {**os.environ, **env}
        self.proc: subprocess.Popen[str] | None = None
        self.http_url = ""
        self.stderr: Any = None
        self._kept = False

    def start(self, timeout: float = 30.0, stderr: Any = None) -> ServerProcess:
        """Start it; ``stderr`` defaults to a temporary file whose end a failed start shows."""
        self._kept = stderr is None  # (open while the server runs: stop() closes it)
        self.stderr = stderr if stderr is not None else tempfile.TemporaryFile("w+")  # noqa: SIM115
        command = [
            sys.executable,
            "-m",
            self.module,
            "server",
            "--db",
            self.db_url,
            "--http",
            "127.0.0.1:0",
            "--zmq",
            self.zmq_endpoint,
        ]
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=self.env
        )
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            match = re.search(r"http=(\S+) zmq=(\S+)", line)
            if match:
                self.http_url = match.group(1)
                return self
            if not line and self.proc.poll() is not None:
                break
        raise RuntimeError(f"server did not start (exit {self.proc.poll()}): {self._said()}")

    def _said(self) -> str:
        """The end of what the server wrote on stderr, when it went to our file."""
        if not hasattr(self.stderr, "seek"):
            return "(its stderr was not kept)"
        self.stderr.seek(0)
        return self.stderr.read()[-2_000:].strip() or "(nothing on stderr)"

    def cpu_seconds(self) -> float:
        """User + system CPU time of the server process so far (Linux /proc)."""
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._kept:
            self.stderr.close()
