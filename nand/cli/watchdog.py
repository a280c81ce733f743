"""``nand watchdog -- COMMAND...``: run a training command, end it when its run diverges.

The one line a job script needs (``examples/slurm/train.sbatch``)::

    nand watchdog -- srun --kill-on-bad-exit=1 torchrun ... train.py

It starts COMMAND and follows the run on the server (the stream of
:mod:`nand.cli.wait`). When the run's attempt reaches a state of ``--on``
(``diverged`` by default) it prints the verdict on stderr and ends the job:

- under Slurm (``SLURM_JOB_ID`` set), with ``scancel`` of the job, so Slurm
  records it ``CANCELLED`` and kills every step's processes on every node;
- elsewhere, with SIGTERM to COMMAND's process group, SIGKILL ``--grace``
  seconds later; the watchdog then exits with the state's ``nand wait`` code
  (3 for ``diverged``), so a Kubernetes pod fails.

When COMMAND ends first, the watchdog ends with its exit code at once, whatever
the server says. A server it cannot reach, or one that answers with an error,
never stops the training: the watchdog says so and lets COMMAND run.

The run id and the launch identity are the agents' (:mod:`nand.server.agents.attempts`):
``--run``, else ``NAND_RUN``, else ``SLURM_JOB_ID``; ``--launch``, else
``NAND_LAUNCH``, else under Slurm ``JOBID.RESTART_COUNT`` (a requeued job is a
new attempt of the same run, and its watchdog does not act on the last
attempt's state). Both are exported to COMMAND, so every rank agrees with the
watchdog without being told.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from nand import config, exitcodes
from nand.cli.wait import STATE_EXIT, UNTIL_STATE, Waiter
from nand.client import ApiError, request_json, run_url
from nand.errors import CommandError
from nand.runids import run_id_from, run_problem

#: Seconds a diverged run's verdict may take to name the rank that made the value.
SETTLE_S = 10.0
#: The states ``--on`` takes (``mismatch``: ``replica_mismatch``).
ON_STATES = ("diverged", "mismatch", "lost", "stalled", "crashed")
EPILOG = """exit code: COMMAND's (128 + N when a signal N ended it); when the watchdog
ended it outside Slurm, the state's `nand wait` code (3 diverged, 4 lost,
5 stalled, 7 crashed, 15 mismatch); 2 bad arguments; 9 COMMAND not found.

Slurm: nand watchdog -- srun --kill-on-bad-exit=1 torchrun ... train.py
Kubernetes (the container's command): nand watchdog -- torchrun ... train.py
"""


def register(subparsers: Any) -> None:
    from nand.cli.server_args import URL_HELP

    parser = subparsers.add_parser(
        "watchdog",
        help="run a training command; end the job when its run diverges (scancel under Slurm)",
        description=__doc__.splitlines()[0].split(": ", 1)[1],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--run", help="the run id (default: NAND_RUN, else SLURM_JOB_ID); given to COMMAND"
    )
    parser.add_argument(
        "--launch",
        help="this launch's identity (default: NAND_LAUNCH, else under Slurm "
        "JOBID.RESTART_COUNT); given to COMMAND as NAND_LAUNCH",
    )
    parser.add_argument(
        "--on",
        type=_states,
        default=("diverged",),
        help=f"the states that end the job, comma-separated: {', '.join(ON_STATES)} (diverged)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="outside Slurm: seconds from SIGTERM to SIGKILL of COMMAND's processes (10)",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=SETTLE_S,
        help="on diverged: seconds to wait, at most, for the rank that made the value to "
        "report it before the job is ended, while the verdict's origin is still a rank that "
        f"received it through a collective ({SETTLE_S:g})",
    )
    parser.add_argument("--url", help=URL_HELP)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the training command")
    parser.set_defaults(func=cmd_watchdog)


def _states(text: str) -> tuple[str, ...]:
    states = tuple(word.strip() for word in text.split(",") if word.strip())
    unknown = [state for state in states if state not in ON_STATES]
    if unknown or not states:
        raise argparse.ArgumentTypeError(
            f"{text!r}: name states among {', '.join(ON_STATES)}, comma-separated"
        )
    return tuple(UNTIL_STATE.get(state, state) for state in states)


def identity(args: argparse.Namespace, env: dict[str, str]) -> tuple[str, str | None]:
    """The run id and launch identity the watchdog follows, as the agents will have them.

    >>> identity(argparse.Namespace(run=None, launch=None), {"SLURM_JOB_ID": "17",
    ...          "SLURM_RESTART_COUNT": "2"})
    ('17', '17.2')
    >>> identity(argparse.Namespace(run="exp", launch=None), {"NAND_LAUNCH": "a"})
    ('exp', 'a')
    """
    job = env.get("SLURM_JOB_ID", "")
    run = args.run or env.get(config.NAND_RUN) or run_id_from(job)
    if not run:
        raise CommandError(
            "no run id: pass --run, set NAND_RUN, or run under Slurm (SLURM_JOB_ID)",
            exitcodes.USAGE,
        )
    problem = run_problem(run)
    if problem is not None:
        raise CommandError(f"{problem} (NAND_RUN)", exitcodes.USAGE)
    launch = args.launch or env.get(config.NAND_LAUNCH)
    if not launch and job:
        launch = f"{job}.{env.get('SLURM_RESTART_COUNT') or 0}"
    return run, launch or None


class Follower(Waiter):
    """``nand wait`` that acts only on the watchdog's states and never gives up."""

    def __init__(self, args: argparse.Namespace, on: tuple[str, ...]) -> None:
        super().__init__(args)
        self.on = on
        self.state: str | None = None
        self.reached = threading.Event()

    def exit_code(self, state: str) -> int | None:
        if state not in self.on:
            return None
        self.state = state
        return STATE_EXIT[state]

    def follow(self) -> None:
        try:
            self.run()
        except CommandError as exc:  # the server refused: say it, let the training run
            say(f"stopped following run {self.args.run!r}: {exc}; the job is not watched")
            return
        except Exception as exc:  # never the training's end: a watchdog bug is said, once
            say(f"stopped following run {self.args.run!r}: {type(exc).__name__}: {exc}")
            return
        say(f"run {self.args.run!r} {self.state}")
        self.reached.set()


def cmd_watchdog(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise CommandError(
            "no training command: nand watchdog -- srun torchrun ... train.py", exitcodes.USAGE
        )
    run, launch = identity(args, dict(os.environ))
    env = {**os.environ, config.NAND_RUN: run}
    if launch:
        env[config.NAND_LAUNCH] = launch
    wait_args = argparse.Namespace(
        run=run, launch=launch, url=args.url, until="diverged", timeout=None, retry_for=None
    )
    wait_args.interval = 1.0
    follower = Follower(wait_args, args.on)
    try:
        child = subprocess.Popen(command, env=env, start_new_session=True)
    except OSError as exc:
        raise CommandError(
            f"cannot run {command[0]!r}: {exc.strerror}", exitcodes.NOT_FOUND
        ) from None
    _forward_signals(child)
    threading.Thread(target=follower.follow, name="nand-watchdog", daemon=True).start()
    while not follower.reached.wait(0.2):
        if child.poll() is not None:
            return _exit_code(child.returncode)
    _print_verdict(follower.base, run, args.settle if follower.state == "diverged" else 0.0)
    return _end_job(child, follower, args.grace)


def _end_job(child: subprocess.Popen[bytes], follower: Follower, grace: float) -> int:
    """The run reached a state of ``--on``: the job ended."""
    run = follower.args.run
    job = os.environ.get("SLURM_JOB_ID")
    if job and _scancel(job, run):
        child.wait()  # (Slurm ends it, and this process with it, after KillWait at most)
        return _exit_code(child.returncode)
    say(f"run {run!r}: stopping the training (SIGTERM to its processes)")
    _signal_group(child, signal.SIGTERM)
    try:
        child.wait(grace)
    except subprocess.TimeoutExpired:
        say(f"the training outlived SIGTERM by {grace:g} s; SIGKILL")
        _signal_group(child, signal.SIGKILL)
        child.wait()
    return STATE_EXIT.get(follower.state or "diverged", exitcodes.DIVERGED)


def _scancel(job: str, run: str) -> bool:
    if shutil.which("scancel") is None:
        say("scancel is not on PATH; ending the training's processes instead")
        return False
    say(f"run {run!r}: cancelling Slurm job {job} (scancel)")
    done = subprocess.run(["scancel", job], capture_output=True, text=True)
    if done.returncode != 0:
        say(f"scancel {job} failed ({done.stderr.strip()}); ending the processes instead")
        return False
    say(f"Slurm job {job} cancelled")
    return True


def _print_verdict(base: str, run: str, settle: float) -> None:
    """The verdict on stderr, once it names where the value was made: a rank that
    got it through a collective reports first; the one that made it reports after
    its replay (the light mode), and a job cancelled before that loses the answer."""
    deadline = time.monotonic() + settle
    try:
        verdict = request_json(run_url(base, run, "/verdict"))
        if _received(verdict) and settle > 0:
            say(f"waiting up to {settle:g} s for the rank that made it to report")
        while _received(verdict) and time.monotonic() < deadline:
            time.sleep(0.1)
            verdict = request_json(run_url(base, run, "/verdict"))
    except (ApiError, OSError) as exc:
        say(f"no verdict for {run!r} from {base}: {exc}")
        return
    print(f"{verdict['run']}: {verdict['state']}", file=sys.stderr)
    print(verdict["summary"], file=sys.stderr, flush=True)


def _received(verdict: dict[str, Any]) -> bool:
    origin = verdict.get("origin") or {}
    return bool(origin.get("cause") == "received")


def _forward_signals(child: subprocess.Popen[bytes]) -> None:
    """SIGINT/SIGTERM/SIGHUP to the watchdog reach COMMAND's process group (its own session)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: _signal_group(child, signum))


def _signal_group(child: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signum)


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def say(message: str) -> None:
    """One line on stderr, timed to the millisecond: a job log's account of when it acted."""
    now = datetime.datetime.now().isoformat(sep=" ", timespec="milliseconds")
    print(f"nand watchdog: {now} {message}", file=sys.stderr, flush=True)
