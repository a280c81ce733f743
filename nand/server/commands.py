"""``nand server | runs | verdict | stop | wait | prune``.

Nothing heavy is imported at module import (no FastAPI, no SQLAlchemy): the
command functions import what they need. The client commands talk to the
REST API at ``--url`` (default ``NAND_URL``, ``http://127.0.0.1:8080``) with
the standard library only.

``nand wait RUN --until diverged|finished|any`` exit codes (for job scripts):

====  =================================================================
0     the run reached what was asked (``--until any``: it finished)
2     usage error, or the server could not be reached for ``--retry-for`` s
3     the run diverged (while waiting for ``finished`` or ``any``)
4     a rank was lost (no message for NAND_LOST_AFTER_S)
5     a rank stalled (no step progress for NAND_STALLED_AFTER_S)
6     the run finished without diverging (while waiting for ``diverged``)
124   ``--timeout`` passed first (an unknown run is waited for, too)
====  =================================================================

A Slurm job script that stops the job as soon as it goes non-finite::

    export NAND_SERVER=tcp://head-node:5557 NAND_RUN=$SLURM_JOB_ID
    srun python train.py &
    nand wait "$SLURM_JOB_ID" --until diverged --url http://head-node:8080
    case $? in
      0) nand verdict "$SLURM_JOB_ID"; scancel "$SLURM_JOB_ID" ;;  # diverged: stop paying
      6) wait ;;                                                   # finished cleanly
    esac

On Kubernetes the same ``nand wait`` runs as a sidecar container of the
trainer's pod (or a Job watching it); exit 0 with ``--until diverged`` means
"delete the training Job", e.g. ``nand wait "$RUN" --until diverged && kubectl
delete job "$JOB"``. For a graceful stop at one step on every rank instead of
a kill, use ``nand stop RUN`` (needs ``NAND_TOKEN``).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from nand import config
from nand.client import ApiError, request_json, run_url

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_DIVERGED = 3
EXIT_LOST = 4
EXIT_STALLED = 5
EXIT_FINISHED = 6
EXIT_TIMEOUT = 124

#: Exit code of ``nand wait`` for a state that is not the one waited for.
STATE_EXIT = {"diverged": EXIT_DIVERGED, "lost": EXIT_LOST, "stalled": EXIT_STALLED}


_WAIT_HELP = (__doc__ or "").split("(for job scripts):", 1)[-1].split("A Slurm", 1)[0]


def register(subparsers: Any) -> None:
    _server_parser(subparsers)
    url_help = "REST API base URL (default: NAND_URL or http://127.0.0.1:8080)"

    runs = subparsers.add_parser("runs", help="list runs and their state")
    runs.add_argument("--url", help=url_help)
    runs.add_argument("--json", action="store_true", help="print the JSON list")
    runs.add_argument("--limit", type=int, default=50)
    runs.set_defaults(func=cmd_runs)

    verdict = subparsers.add_parser("verdict", help="where a run first went non-finite")
    verdict.add_argument("run")
    verdict.add_argument("--url", help=url_help)
    verdict.add_argument("--json", action="store_true", help="print the Verdict JSON")
    verdict.set_defaults(func=cmd_verdict)

    stop = subparsers.add_parser("stop", help="stop every rank of a run at one step boundary")
    stop.add_argument("run")
    stop.add_argument("--url", help=url_help)
    stop.add_argument("--token", help="the server's token (default: NAND_TOKEN)")
    stop.add_argument("--step", type=int, help="stop at this step (default: chosen by the server)")
    stop.add_argument("--reason", default="", help="shown to the ranks and in the verdict")
    stop.set_defaults(func=cmd_stop)

    wait = subparsers.add_parser(
        "wait",
        help="block until a run diverges / finishes; distinct exit codes for job scripts",
        description=_WAIT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    wait.add_argument("run")
    wait.add_argument("--until", choices=("diverged", "finished", "any"), default="any")
    wait.add_argument("--timeout", type=_duration, default=None, help="e.g. 600, 30m, 12h")
    wait.add_argument("--interval", type=float, default=2.0, help="seconds between polls")
    wait.add_argument(
        "--retry-for", type=float, default=60.0, help="seconds to ride out an unreachable server"
    )
    wait.add_argument("--url", help=url_help)
    wait.set_defaults(func=cmd_wait)

    prune = subparsers.add_parser("prune", help="delete runs last seen before a given age")
    prune.add_argument("--older-than", type=_duration, required=True, help="e.g. 30d, 12h")
    prune.add_argument("--db", help="database URL (default: NAND_DB or sqlite:///nand.db)")
    prune.set_defaults(func=cmd_prune)


def _server_parser(subparsers: Any) -> None:
    server = subparsers.add_parser("server", help="run the nand server (REST + ingest)")
    server.add_argument("--db", help="SQLAlchemy URL (default: NAND_DB or sqlite:///nand.db)")
    server.add_argument("--http", help="HOST:PORT for REST and dashboard (default 127.0.0.1:8080)")
    server.add_argument("--zmq", help="ZeroMQ endpoint for agents (default tcp://127.0.0.1:5557)")
    server.set_defaults(func=cmd_server)


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def _duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``30m``, ``12h``, ``30d`` or ``2w``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration such as 90, 30m, 12h, 30d")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


def _split_http(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise SystemExit(f"nand server: --http {text!r} must be HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


# --- server -----------------------------------------------------------------


def cmd_server(args: argparse.Namespace) -> int:
    from nand.server import embedded
    from nand.server.settings import Settings

    settings = Settings.from_env(db_url=args.db)
    host, port = _split_http(args.http) if args.http else (settings.http_host, settings.http_port)
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    server = embedded.start(
        settings.db_url,
        http_host=host,
        http_port=port,
        zmq_endpoint=args.zmq or settings.zmq_bind,
        settings=settings,
        log_level="info",
    )
    print(f"nand server: http={server.http_url} zmq={server.zmq_endpoint}", flush=True)
    stopping.wait()
    server.stop()
    return EXIT_OK


def cmd_prune(args: argparse.Namespace) -> int:
    from sqlalchemy.orm import Session

    from nand.server import store
    from nand.server.db import make_engine
    from nand.server.migrate import upgrade

    url = args.db or config.get_str(config.NAND_DB, "sqlite:///nand.db") or ""
    engine = make_engine(url)
    upgrade(engine)
    with Session(engine) as session:
        names = store.prune(session, time.time() - args.older_than)
        session.commit()
    engine.dispose()
    print(f"pruned {len(names)} run(s)" + (": " + ", ".join(names) if names else ""))
    return EXIT_OK


# --- REST clients -----------------------------------------------------------


def _base(args: argparse.Namespace) -> str:
    url = args.url or config.get_str(config.NAND_URL, "http://127.0.0.1:8080") or ""
    return url.rstrip("/")


def _run_url(args: argparse.Namespace, suffix: str = "") -> str:
    return run_url(_base(args), args.run, suffix)


def _fail(message: str, code: int) -> int:
    print(f"nand: {message}", file=sys.stderr)
    return code


def _reports_api_errors(
    command: Callable[[argparse.Namespace], int],
) -> Callable[[argparse.Namespace], int]:
    """An API error exits 1 with the server's reason; an unreachable server exits 2."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except ApiError as exc:
            return _fail(str(exc), EXIT_ERROR)
        except BrokenPipeError:
            raise  # our stdout closed (`| head`), not the server
        except OSError as exc:
            return _fail(f"cannot reach {_base(args)}: {exc}", EXIT_USAGE)

    return run


@_reports_api_errors
def cmd_runs(args: argparse.Namespace) -> int:
    runs = request_json(f"{_base(args)}/api/runs?limit={max(1, min(args.limit, 1000))}")
    if args.json:
        print(json.dumps(runs, indent=2))
        return EXIT_OK
    print(f"{'RUN':<36} {'STATE':<9} {'RANKS':>5} {'STEP':>8} {'EVENTS':>7}  ORIGIN")
    for run in runs:
        origin = run.get("origin")
        where = (
            f"rank {origin['rank']} {origin['phase']} {origin['module'] or '<root>'} "
            f"step {origin['step']}"
            if origin
            else ""
        )
        print(
            f"{run['run']:<36} {run['state']:<9} {run['ranks_seen']:>5} "
            f"{run['latest_step']:>8} {run['event_count']:>7}  {where}"
        )
    return EXIT_OK


@_reports_api_errors
def cmd_verdict(args: argparse.Namespace) -> int:
    verdict = request_json(_run_url(args, "/verdict"))
    if args.json:
        print(json.dumps(verdict, indent=2))
    else:
        print(f"{verdict['run']}: {verdict['state']}")
        print(verdict["summary"])
    return EXIT_OK


@_reports_api_errors
def cmd_stop(args: argparse.Namespace) -> int:
    token = args.token or config.get_str(config.NAND_TOKEN)
    body: dict[str, Any] = {"reason": args.reason}
    if args.step is not None:
        body["step"] = args.step
    answer = request_json(_run_url(args, "/stop"), method="POST", body=body, token=token)
    ranks = ", ".join(map(str, answer["ranks"])) or "none running"
    print(f"{answer['run']}: every rank stops at step {answer['step']} (ranks {ranks})")
    return EXIT_OK


def wait_exit_code(until: str, state: str) -> int | None:
    """The exit code once ``state`` is seen while waiting for ``until``; None: keep waiting."""
    if state == until or (until == "any" and state == "finished"):
        return EXIT_OK
    if state in STATE_EXIT:
        return STATE_EXIT[state]
    if state == "finished":
        return EXIT_FINISHED
    return None


def cmd_wait(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.timeout if args.timeout is not None else None
    unreachable_since: float | None = None
    while True:
        try:
            state = request_json(_run_url(args, "/verdict"))["state"]
            unreachable_since = None
        except ApiError as exc:
            if exc.status != 404:
                return _fail(str(exc), EXIT_USAGE)
            state = None  # the run has not reported yet
        except OSError as exc:
            unreachable_since = unreachable_since or time.monotonic()
            if time.monotonic() - unreachable_since > args.retry_for:
                return _fail(f"cannot reach {_base(args)}: {exc}", EXIT_USAGE)
            state = None
        code = wait_exit_code(args.until, state) if state else None
        if code is not None:
            print(f"{args.run}: {state}", flush=True)
            return code
        if deadline is not None and time.monotonic() >= deadline:
            return _fail(f"timed out waiting for {args.run} ({args.until})", EXIT_TIMEOUT)
        pause = args.interval
        if deadline is not None:
            pause = max(0.0, min(pause, deadline - time.monotonic()))
        time.sleep(pause)
