"""``nand server | runs | verdict | stop | wait | prune``: the argument parsers.

Nothing heavy is imported at module import (no FastAPI, no SQLAlchemy): the
command functions import what they need. The client commands
(:mod:`nand.cli.rest_client`, :mod:`nand.cli.wait`) talk to the REST
API at ``--url`` (default ``NAND_URL``, ``http://127.0.0.1:8080``) with the
standard library only. Exit codes: :mod:`nand.exitcodes`.

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
import errno
import logging
import re
import signal
import threading
import time
from typing import Any

from nand import exitcodes

log = logging.getLogger("nand.server")

#: What ``nand wait --help`` shows under its options, as plain text.
WAIT_EPILOG = """exit codes (for job scripts):
  0    the run reached what was asked (--until any: it finished)
  3    the run diverged (while waiting for finished or any)
  4    a rank was lost (no message for NAND_LOST_AFTER_S)
  5    a rank stalled (no step progress for NAND_STALLED_AFTER_S)
  6    the run finished without diverging (while waiting for diverged)
  7    a rank crashed (exited with an exception)
  15   a rank's parameters differ from the other DDP replicas' (replica_mismatch)
  8    the server could not be reached for --retry-for seconds
  2    bad arguments or --url;  124  --timeout passed first

A run that has not reported yet is waited for (said once on stderr). A run id
used again is a new attempt: the live (latest) attempt's state counts.
"""

URL_HELP = (
    "the server's base URL, e.g. http://head-node:8080 (default: NAND_URL or "
    "http://127.0.0.1:8080); several servers on one database, comma-separated: every "
    "command goes on at the next when one is down"
)
RUN_HELP = "the run id (NAND_RUN, TORCHELASTIC_RUN_ID or SLURM_JOB_ID of the job)"


def register(subparsers: Any) -> None:
    from nand.cli import rest_client

    _server_parser(subparsers)

    runs = subparsers.add_parser("runs", help="list runs and their state")
    runs.add_argument("--url", help=URL_HELP)
    runs.add_argument("--json", action="store_true", help="print the JSON list")
    runs.add_argument("--limit", type=int, default=50, help="most runs listed, newest first (50)")
    runs.set_defaults(func=rest_client.cmd_runs)

    hosts = subparsers.add_parser(
        "hosts", help="hosts by incidents, replica mismatches and crashes across runs"
    )
    hosts.add_argument("--url", help=URL_HELP)
    hosts.add_argument("--json", action="store_true", help="print the JSON page")
    hosts.add_argument("--limit", type=int, default=20, help="most hosts listed, worst first (20)")
    hosts.set_defaults(func=rest_client.cmd_hosts)

    verdict = subparsers.add_parser("verdict", help="where a run first went non-finite")
    verdict.add_argument("run", help=RUN_HELP)
    verdict.add_argument("--url", help=URL_HELP)
    verdict.add_argument("--json", action="store_true", help="print the Verdict JSON")
    verdict.set_defaults(func=rest_client.cmd_verdict)

    stop = subparsers.add_parser("stop", help="stop every rank of a run at one step boundary")
    stop.add_argument("run", help=RUN_HELP)
    stop.add_argument("--url", help=URL_HELP)
    stop.add_argument("--token", help="the server's token (default: NAND_TOKEN)")
    stop.add_argument("--step", type=int, help="stop at this step (default: chosen by the server)")
    stop.add_argument("--reason", default="", help="shown to the ranks and in the verdict")
    stop.set_defaults(func=rest_client.cmd_stop)

    _wait_parser(subparsers)

    prune = subparsers.add_parser("prune", help="delete runs last seen before a given age")
    prune.add_argument("--older-than", type=_duration, required=True, help="e.g. 30d, 12h")
    prune.add_argument("--db", help="database URL (default: NAND_DB or sqlite:///nand.db)")
    prune.set_defaults(func=cmd_prune)


def _wait_parser(subparsers: Any) -> None:
    from nand.cli.wait import cmd_wait

    wait = subparsers.add_parser(
        "wait",
        help="block until a run diverges / finishes; distinct exit codes for job scripts",
        description="Follow the server's event stream until the run reaches a state.",
        epilog=WAIT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    wait.add_argument("run", help=RUN_HELP)
    wait.add_argument(
        "--until",
        choices=("diverged", "mismatch", "warning", "finished", "any"),
        default="any",
        help="the state to wait for (mismatch: replica_mismatch; warning: the first early "
        "warning of a blow-up); any: diverged, replica_mismatch, finished, lost, stalled "
        "or crashed (any)",
    )
    wait.add_argument(
        "--timeout", type=_duration, default=None, help="give up after, e.g. 600, 30m, 12h (never)"
    )
    wait.add_argument(
        "--retry-for",
        type=_duration,
        default=None,
        help="give up after the server was unreachable this long (default: retry until --timeout)",
    )
    wait.add_argument(
        "--interval",
        type=float,
        default=1.0,
        help="seconds before the first reconnect to a lost server, doubling up to 30 (1)",
    )
    wait.add_argument(
        "--launch",
        default=None,
        help="count only the attempt of this launch identity (the job's NAND_LAUNCH): a run "
        "id used again, e.g. by a re-applied Job, starts a new attempt; an earlier launch's "
        "state does not count (default: the live attempt, whichever launch)",
    )
    wait.add_argument("--url", help=URL_HELP)
    wait.set_defaults(func=cmd_wait)


def _server_parser(subparsers: Any) -> None:
    server = subparsers.add_parser("server", help="run the nand server (REST + ingest)")
    server.add_argument(
        "--db",
        help="sqlite:///PATH or postgresql+psycopg://USER:PASSWORD@HOST/DB "
        "(default: NAND_DB or sqlite:///nand.db)",
    )
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


# --- server -----------------------------------------------------------------


def cmd_server(args: argparse.Namespace) -> int:
    import zmq

    from nand.server import collector, embedded, preflight
    from nand.server.agents import descriptors
    from nand.server.settings import Settings

    descriptors.raise_descriptor_limit()

    settings = Settings.from_env(db_url=args.db)
    host, port = (
        preflight.parse_http(args.http) if args.http else (settings.http_host, settings.http_port)
    )
    zmq_endpoint = args.zmq or settings.zmq_bind
    preflight.check_zmq_endpoint(zmq_endpoint)
    preflight.open_database(settings.db_url).dispose()  # schema upgraded; errors said here
    preflight.probe_zmq_bind(zmq_endpoint)
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        server = embedded.start(
            settings.db_url,
            http_host=host,
            http_port=port,
            zmq_endpoint=zmq_endpoint,
            settings=settings,
            log_level="warning",
        )
    except OSError as exc:  # the HTTP socket: bound before uvicorn starts
        raise preflight.bind_failed(
            "HTTP", "--http", f"{host}:{port}", exc.errno, exc.strerror or str(exc)
        ) from exc
    except zmq.ZMQError as exc:
        if exc.errno != errno.EADDRINUSE:  # (not the address: a bad CURVE key, say)
            raise
        # The agents' port, taken since the probe above (two servers started at once).
        raise preflight.bind_failed(
            "ZeroMQ", "--zmq", zmq_endpoint, exc.errno, exc.strerror
        ) from exc
    collector.spare_long_lived()  # (after start-up: what exists now lives as long as the server)
    print(f"nand server: http={server.http_url} zmq={server.zmq_endpoint}", flush=True)
    _warn_if_open(host, zmq_endpoint, settings.token)
    stopping.wait()
    server.stop()
    return exitcodes.OK


def _warn_if_open(http_host: str, zmq_endpoint: str, token: str | None) -> None:
    """Bound beyond this machine without a token: anyone who reaches it can write runs."""
    from nand.server.preflight import is_loopback, zmq_host

    if token:
        return
    exposed = [h for h in (http_host, zmq_host(zmq_endpoint)) if not is_loopback(h)]
    if exposed:
        log.warning(
            "listening on %s without NAND_TOKEN: anyone who can reach it can send runs; "
            "set NAND_TOKEN (agents and `nand stop` then need it)",
            " and ".join(sorted(set(exposed))),
        )


def cmd_prune(args: argparse.Namespace) -> int:
    from sqlalchemy.orm import Session

    from nand.server.preflight import open_database
    from nand.server.settings import Settings
    from nand.server.storage import store

    engine = open_database(Settings.from_env(db_url=args.db).db_url)
    with Session(engine) as session:
        names = store.prune(session, time.time() - args.older_than)
        session.commit()
    engine.dispose()
    print(f"pruned {len(names)} run(s)" + (": " + ", ".join(names) if names else ""))
    return exitcodes.OK
