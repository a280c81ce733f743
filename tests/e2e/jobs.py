"""Real training jobs for the end-to-end tests: torchrun (gloo, CPU) or plain
processes running ``nand.demo.trainer``, reporting to a real nand server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nand.client import ApiError, request_json, run_url

TRAINER = ["-m", "nand.demo.trainer"]


def torchrun(nproc: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
    ]


def agent_env(endpoint: str, run: str, token: str, **extra: str) -> dict[str, str]:
    """What a job needs to report to the server: the same variables a user sets."""
    env = dict(os.environ, NAND_SERVER=endpoint, NAND_RUN=run, NAND_TOKEN=token)
    env["OMP_NUM_THREADS"] = "1"
    env["NAND_HEARTBEAT_S"] = "0.5"  # fast heartbeats: the tests watch progress
    env.update(extra)
    return env


@dataclass
class Job:
    procs: list[subprocess.Popen[bytes]]
    log: Path
    started: float = field(default_factory=time.monotonic)

    def wait(self, timeout: float = 180.0) -> list[int]:
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(max(1.0, timeout - (time.monotonic() - self.started))))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(
                    f"the job ran past {timeout} s; log:\n{self.output()}"
                ) from None
        return codes

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]


def launch(
    command: list[str], env: dict[str, str], log: Path, copies: int = 1, per_copy_env=None
) -> Job:
    """Start ``copies`` processes of ``command`` in their own process groups."""
    procs = []
    with open(log, "ab") as sink:
        for i in range(copies):
            copy_env = dict(env, **(per_copy_env(i) if per_copy_env else {}))
            procs.append(
                subprocess.Popen(
                    command,
                    env=copy_env,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    return Job(procs, log)


def api(base: str, run: str, suffix: str = "") -> Any:
    return request_json(run_url(base, run, suffix))


def wait_for(predicate: Callable[[], Any], timeout: float = 60.0, what: str = "a condition") -> Any:
    """Poll ``predicate`` until it returns something truthy; tolerate a 404 meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except ApiError as exc:
            if exc.status != 404:
                raise
            value = None
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def settled_verdict(base: str, run: str, ranks: int, timeout: float = 30.0) -> dict[str, Any]:
    """The verdict once every rank has said its last word (bye) or been lost."""

    last_seen: list[Any] = []  # (the ranks' states when it gives up: what was missing)

    def done() -> dict[str, Any] | None:
        statuses = api(base, run, "/ranks")["items"]
        last_seen[:] = [(s["rank"], s["state"]) for s in statuses]
        if len(statuses) == ranks and all(s["state"] != "running" for s in statuses):
            return api(base, run, "/verdict")
        return None

    try:
        return wait_for(done, timeout, f"every rank of {run} to finish")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; ranks (rank, state) last seen: {last_seen}") from None
