"""The demo itself: server up, job launched, progress and verdict printed.

Everything shown comes from the public REST API of the embedded server, the
way a person or a scheduler would see it; nothing is read behind its back.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from nand.client import ApiError, request_json, run_url

POLL_S = 0.5


class Terminal:
    """Prints with colour and an in-place progress line when stdout is a terminal."""

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty()
        self._last_progress = ""

    def style(self, text: str, code: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.tty else text

    def line(self, text: str = "") -> None:
        if self.tty:
            sys.stdout.write("\r\033[K")
        print(text, flush=True)

    def progress(self, text: str) -> None:
        """One line rewritten in place on a terminal; a new line only on change otherwise."""
        if text == self._last_progress:
            return
        self._last_progress = text
        if self.tty:
            sys.stdout.write("\r\033[K" + text)
            sys.stdout.flush()
        else:
            print(text, flush=True)


def run_demo(args: argparse.Namespace) -> int:
    try:
        import torch  # noqa: F401

        from nand.server import embedded
    except ImportError as exc:
        print(
            "nand demo needs the agent and server extras: "
            f"pip install 'nand-torch[agent,server]' ({exc})"
        )
        return 2
    # The demo's output is its own story; the server's log would interleave.
    logging.getLogger("nand.server").setLevel(logging.WARNING)
    term = Terminal()
    workdir = Path(tempfile.mkdtemp(prefix="nand-demo-"))
    token = secrets.token_hex(8)
    os.environ["NAND_TOKEN"] = token  # the embedded server reads its settings from here
    server = embedded.start(f"sqlite:///{workdir / 'nand.db'}", http_port=args.port)
    try:
        return _demo_with_server(args, term, server, workdir, token)
    except KeyboardInterrupt:
        term.line("")
        return 130
    finally:
        server.stop()


def _demo_with_server(
    args: argparse.Namespace, term: Terminal, server: Any, workdir: Path, token: str
) -> int:
    run = time.strftime("demo-%H%M%S")
    dashboard = f"{server.http_url}/#/runs/{run}"
    _print_intro(args, term, server, dashboard, workdir, token)
    log_path = workdir / "torchrun.log"
    job = _launch_job(args, server.zmq_endpoint, run, token, log_path)
    verdict = _follow(args, term, server.http_url, run, job)
    _print_outcome(term, verdict, job.returncode, log_path)
    term.line(f"  dashboard  {term.style(dashboard, '1;4')}")
    if args.no_wait:
        return 0
    term.line("  (Ctrl-C to stop the server and quit)")
    while True:
        time.sleep(3600)


def _print_intro(
    args: argparse.Namespace, term: Terminal, server: Any, dashboard: str, workdir: Path, token: str
) -> None:
    term.line(term.style("nand demo", "1") + " — a real training job goes NaN; nand says where.")
    term.line("")
    term.line(
        f"  job        {args.ranks} ranks · DDP over gloo on CPU · TinyGPT · {args.steps} steps"
    )
    term.line(f"  planted    {args.fault}  (nand is not told)")
    term.line(f"  server     {server.http_url}  (SQLite in {workdir})")
    term.line(f"  agents     {server.zmq_endpoint}")
    term.line(f"  dashboard  {dashboard}")
    term.line(f"  token      {token}  (for the dashboard's Stop button)")
    term.line("")


def _launch_job(
    args: argparse.Namespace, endpoint: str, run: str, token: str, log_path: Path
) -> subprocess.Popen[bytes]:
    env = dict(os.environ, NAND_SERVER=endpoint, NAND_RUN=run, NAND_TOKEN=token)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("NAND_HEARTBEAT_S", "0.5")  # a short job: progress twice a second
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(args.ranks),
        "-m",
        "nand.demo.trainer",
        "--steps",
        str(args.steps),
        "--step-time",
        str(args.step_time),
        "--fault",
        args.fault,
        "--policy",
        "raise",
    ]
    with open(log_path, "wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def _follow(
    args: argparse.Namespace, term: Terminal, base: str, run: str, job: subprocess.Popen[bytes]
) -> dict[str, Any] | None:
    """Show progress until the job ends; print the verdict once it diverged and
    every rank has stopped: the rank that made the value may report after a
    rank that received it (its replay runs first), and the first verdict
    would blame the receiver."""
    verdict: dict[str, Any] | None = None
    announced = False
    while True:
        finished = job.poll() is not None
        try:
            ranks = request_json(run_url(base, run, "/ranks"))["items"]
            verdict = request_json(run_url(base, run, "/verdict"))
        except (ApiError, OSError):
            ranks = []  # the run has not said hello yet
        settled = finished or (ranks and all(r["state"] != "running" for r in ranks))
        if verdict and verdict["state"] == "diverged" and settled and not announced:
            announced = True
            _print_verdict(term, verdict)
        elif ranks and not announced:
            term.progress(_progress_text(ranks, args.steps))
        if finished:
            return verdict
        time.sleep(POLL_S)


def _progress_text(ranks: list[dict[str, Any]], total_steps: int) -> str:
    step = min(rank["step"] for rank in ranks)
    losses = [rank["loss"] for rank in ranks if rank.get("loss") is not None]
    loss = f" · loss {sum(losses) / len(losses):.3f}" if losses else ""
    return f"  training   step {step}/{total_steps} on {len(ranks)} ranks{loss}"


def _print_verdict(term: Terminal, verdict: dict[str, Any]) -> None:
    origin = verdict.get("origin") or {}
    term.line(term.style(f"  ✗ diverged at step {origin.get('step', '?')}", "1;31"))
    term.line("")
    # (a path stays whole: not broken at its hyphens, nor when longer than a line)
    summary = verdict["summary"]
    for line in textwrap.wrap(summary, width=88, break_on_hyphens=False, break_long_words=False):
        term.line(f"    {line}")
    term.line("")


def _print_outcome(
    term: Terminal, verdict: dict[str, Any] | None, returncode: int | None, log_path: Path
) -> None:
    if verdict is None or verdict["state"] != "diverged":
        term.line(term.style("  the job ended without a non-finite value", "1;33"))
        term.line(f"  torchrun exit code {returncode}; its log: {log_path}")
        return
    term.line(
        '  every rank stopped before the NaN reached the weights (on_nonfinite="raise"); '
        f"torchrun log: {log_path}"
    )
