"""Every ``NAND_*`` environment variable, in one place.

Each constant below is the *name* of a variable; its docstring says what it
does and its default. Read them with :func:`get_str`, :func:`get_int`,
:func:`get_float` and :func:`get_bool`, which raise :class:`~nand.errors.ConfigError`
naming the variable when a value does not parse. Arguments passed in code
(``nand.watch(..., server=...)``) win over the environment.
"""

from __future__ import annotations

import os

from nand.errors import ConfigError

# --- agent ------------------------------------------------------------------

NAND_SERVER = "NAND_SERVER"
"""ZeroMQ endpoint of the nand server, e.g. ``tcp://head-node:5557``. Unset: the
agent works alone (log + optional JSONL file)."""

NAND_RUN = "NAND_RUN"
"""Run id shared by all ranks of a job. Default: ``TORCHELASTIC_RUN_ID``, then
``SLURM_JOB_ID``, then an id agreed through the process group's store."""

NAND_ON_NONFINITE = "NAND_ON_NONFINITE"
"""What to do when a rank goes non-finite: ``warn`` (default), ``raise``,
``skip`` or ``stop``."""

NAND_DISABLE = "NAND_DISABLE"
"""``1`` turns ``nand.watch`` into a no-op (nothing hooked), for A/B runs."""

NAND_EVENTS_FILE = "NAND_EVENTS_FILE"
"""Path of a JSONL file to append events to; ``{rank}`` is replaced by the rank.
Default: none."""

NAND_FLIGHT_STEPS = "NAND_FLIGHT_STEPS"
"""Steps of per-layer telemetry kept in the flight recorder. Default 64."""

NAND_MAX_EVENTS = "NAND_MAX_EVENTS"
"""Events kept in memory per rank (``watch.events``); the first is always kept.
Default 1000."""

NAND_DDP_LOCAL_CHECK = "NAND_DDP_LOCAL_CHECK"
"""``0`` turns off the check of each rank's own gradients before DDP's all-reduce
(a communication hook; see ``nand.agent.detect.ddp``). Default on."""

NAND_HEARTBEAT_S = "NAND_HEARTBEAT_S"
"""Seconds between heartbeats sent to the server. Default 5."""

NAND_QUEUE_MAX = "NAND_QUEUE_MAX"
"""Messages held in memory by the sender before spooling to disk. Default 10000."""

NAND_SPOOL_DIR = "NAND_SPOOL_DIR"
"""Directory for messages the server has not acknowledged yet. Default:
``$XDG_CACHE_HOME/nand/spool`` (``~/.cache/nand/spool``)."""

NAND_SPOOL_MAX_BYTES = "NAND_SPOOL_MAX_BYTES"
"""Disk budget of one agent's spool, in bytes. Default 268435456 (256 MiB)."""

NAND_ACK_TIMEOUT_S = "NAND_ACK_TIMEOUT_S"
"""Seconds before an unacknowledged message is resent (then with backoff). Default 5."""

NAND_CLOSE_TIMEOUT_S = "NAND_CLOSE_TIMEOUT_S"
"""Seconds ``watch.close()`` and exit may spend flushing to the server. Default 2."""

NAND_TOKEN = "NAND_TOKEN"
"""Shared secret: agents send it in ``hello``; the server requires it from agents
when set, and always for REST calls that change something (stop)."""

NAND_CURVE_SERVER_KEY = "NAND_CURVE_SERVER_KEY"
"""Agent side: the server's Z85 CURVE public key; set it to encrypt the wire."""

NAND_CURVE_SECRET_KEY = "NAND_CURVE_SECRET_KEY"
"""Server side: the server's Z85 CURVE secret key; set it to require encryption."""

# --- server -----------------------------------------------------------------

NAND_DB = "NAND_DB"
"""SQLAlchemy URL of the store. Default ``sqlite:///nand.db``; PostgreSQL:
``postgresql+psycopg://user:pass@host/db``."""

NAND_HTTP_HOST = "NAND_HTTP_HOST"
"""Address the REST API and dashboard bind to. Default ``127.0.0.1``."""

NAND_ALLOWED_HOSTS = "NAND_ALLOWED_HOSTS"
"""Comma-separated host names the REST API answers to besides IP addresses,
``localhost`` and the name it binds to (the ``Host`` header check against DNS
rebinding), e.g. ``nand.example.org,head-node``; ``*`` answers any. Default:
none; a server bound to all interfaces also answers to this machine's name."""

NAND_HTTP_PORT = "NAND_HTTP_PORT"
"""Port of the REST API and dashboard. Default 8080."""

NAND_ZMQ_BIND = "NAND_ZMQ_BIND"
"""ZeroMQ endpoint the server binds for agents. Default ``tcp://127.0.0.1:5557``."""

NAND_LOST_AFTER_S = "NAND_LOST_AFTER_S"
"""A rank with no message for this many seconds is ``lost``. Default 60."""

NAND_STALLED_AFTER_S = "NAND_STALLED_AFTER_S"
"""A rank that sends heartbeats but no step progress for this long is ``stalled``.
Default 300."""

NAND_URL = "NAND_URL"
"""Base URL of the REST API for the CLI (``nand runs``, ``nand verdict``...).
Default ``http://127.0.0.1:8080``."""


def get_str(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return default if value is None or value == "" else value


def get_int(name: str, default: int) -> int:
    value = get_str(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None


def get_float(name: str, default: float) -> float:
    value = get_str(name)
    if value is None:
        return default
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a number") from None


def get_bool(name: str, default: bool = False) -> bool:
    value = get_str(name)
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={value!r} is not a boolean (use 1/0, true/false)")
