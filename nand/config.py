"""Every ``NAND_*`` environment variable, in one place, and the agent's settings.

Each constant below is the *name* of a variable; its docstring says what it
does and its default. Read them with :func:`get_str`, :func:`get_int`,
:func:`get_float` and :func:`get_bool`, which raise :class:`~nand.errors.ConfigError`
naming the variable when a value does not parse. Arguments passed in code
(``nand.watch(..., server=...)``) win over the environment.

The agent reads them once, into an :class:`AgentConfig` built by
``nand.watch``; the server reads its own once, into ``nand.server.settings.Settings``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

# The readers live apart (how to read a variable); re-exported: config.get_float(...).
from nand.envvars import get_bool as get_bool
from nand.envvars import get_float as get_float
from nand.envvars import get_int as get_int
from nand.envvars import get_str as get_str
from nand.errors import ConfigError
from nand.policy import OnNonfinite
from nand.runids import run_problem

# --- agent ------------------------------------------------------------------

NAND_SERVER = "NAND_SERVER"
"""ZeroMQ endpoint of the nand server, e.g. ``tcp://head-node:5557``, or a list of them
(ranks spread, fail over: ``nand.endpoints``). Unset: the agent works alone (log, JSONL)."""

NAND_RUN = "NAND_RUN"
"""Run id shared by all ranks of a job. Default: ``TORCHELASTIC_RUN_ID``, then
``SLURM_JOB_ID``, then an id agreed through the process group's store. One
without ``/``, not ``.`` or ``..``, at most 256 characters (:mod:`nand.runids`)."""

NAND_LAUNCH = "NAND_LAUNCH"
"""Launch identity: the same for every rank of one launch, new each time the job
is launched again under the same run id (a re-applied Kubernetes Job: its
``controller-uid`` label). Sent in ``hello``; the server starts a new attempt of
the run for a new launch at once. Unset: the server starts one when a rank comes
back after every rank of the live attempt has ended or gone silent."""

NAND_ON_NONFINITE = "NAND_ON_NONFINITE"
"""What to do when a rank goes non-finite: ``warn`` (default), ``raise``,
``skip`` or ``stop``."""

NAND_ON_WARNING = "NAND_ON_WARNING"
"""What to do with an early warning (a loss spike, a growing gradient norm, an
activation near its dtype's limit; see ``nand.agent.step.blowup``): ``log``
(default), ``raise`` (``nand.EarlyWarning`` out of ``optimizer.step()``) or
``skip`` (drop that update, as Lightning's ``SpikeDetection`` can)."""

NAND_READ = "NAND_READ"
"""How the step's results reach the host: ``sync`` (read at the step boundary,
before the update: a host-device sync on CUDA), ``deferred`` (copied without
blocking at the boundary, read at the next one: no sync, events reported one
step later with their true step) or ``auto`` (default): ``deferred`` on CUDA
for ``warn``, and for ``skip`` with an optimizer that can skip on the device
(``fused=True`` Adam/AdamW, fused SGD without momentum; in the light mode
``warn`` too, see ``step.deferred.read_mode``); ``sync`` otherwise.
``raise`` and ``stop`` always read in sync (the decision precedes the update)."""

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

NAND_MODE = "NAND_MODE"
"""``light`` (default): only the step's own figures, and a probed replay on a hit;
``full``: a probe on every module on every step (``nand.agent.detect.tiers``; the
docs' "Light and full modes")."""

NAND_REPLAYS = "NAND_REPLAYS"
"""Replays per run and rank: a new incident's step is run again in process to
name the aten op and the source line that made the value, and whether it
happens again (``nand.agent.rerun``; docs/concepts/replay.md). Each micro-step
then holds references to its inputs and its outputs' gradients until the next
step. ``0`` turns replay off (nothing held). Default 3."""

NAND_READ_PARAMS_EVERY_STEP = "NAND_READ_PARAMS_EVERY_STEP"
"""``1`` (or ``read_params_every_step=True``) reads the parameters and optimizer
state after every update, also where finite gradients imply them finite
(``SGD``/``Adam``/``AdamW``; see ``nand.agent.detect.update_rules``): rules out
that reasoning. Default off."""

NAND_DDP_LOCAL_CHECK = "NAND_DDP_LOCAL_CHECK"
"""``0`` turns off the check of each rank's own gradients before DDP's all-reduce
(a communication hook; see ``nand.agent.detect.ddp``). Default on."""

NAND_HEARTBEAT_S = "NAND_HEARTBEAT_S"
"""Seconds between heartbeats sent to the server. Default 5, in a job of up to 10,000
ranks; a bigger job's ranks beat every world size / 2,000 s (10 s at 20,000 ranks, 50 s
at 100,000: the job sends at most 2,000 heartbeats a second), and the server stretches
``NAND_LOST_AFTER_S`` and ``NAND_STALLED_AFTER_S`` by the same factor
(``nand.cadence``): set it alike on agents and servers."""

NAND_FINGERPRINT_STEPS = "NAND_FINGERPRINT_STEPS"
"""Every this many optimizer steps, and once more at a clean close, each DDP
rank sends an exact fingerprint of its parameters, which the server compares
across replicas (``0``: never; see ``nand.agent.step.fingerprint``). Default 100."""

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

NAND_SILENCE_WARN_S = "NAND_SILENCE_WARN_S"
"""Seconds with messages waiting and nothing acknowledged before the agent says
that nothing reaches the server, with its spool's path and the replay command
(once; again at exit). Default 10."""

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

NAND_AGENT_LEASE_S = "NAND_AGENT_LEASE_S"
"""With several servers on one database: how long a server's hold on an agent
id lasts after it last heard the agent (``nand.server.agents.leases``). Another
server refuses the id meanwhile and takes it over after: an agent whose
server died is accepted elsewhere within this long. Default 15."""

NAND_GRAD_OUTLIER_FACTOR = "NAND_GRAD_OUTLIER_FACTOR"
"""A DDP rank whose own gradient norm (before the all-reduce) is over this
many times the median of the ranks' at the same step, or under its inverse,
gets a ``grad_outlier`` warning (three ranks or more; see
``nand.server.analysis.outliers``). Default 10."""

NAND_NOTIFY_URL = "NAND_NOTIFY_URL"
"""One or more URLs (separated by spaces or commas) the server POSTs a JSON
notification to when a run's attempt diverges, has a replica mismatch, loses,
crashes or stalls a rank, gets its first warning of a kind, or is stopped
(``nand.server.notify.notifier``): once per attempt and state, retried until delivered,
kept in the database meanwhile. A Slack incoming webhook shows its ``text``.
Default: none (no notifications)."""

NAND_NOTIFY_SECRET = "NAND_NOTIFY_SECRET"
"""Key of the ``X-Nand-Signature-256: sha256=<hex>`` header, the HMAC-SHA256 of
each notification's body, for the receiver to check. Default: none (unsigned)."""

NAND_NOTIFY_TIMEOUT_S = "NAND_NOTIFY_TIMEOUT_S"
"""Seconds a notification POST may take before it counts as failed and is
retried later. Default 5."""

NAND_URL = "NAND_URL"
"""Base URL of the REST API for the CLI (``nand runs``...), or a list (``nand.endpoints``:
every command goes on at the next when one is down).
Default ``http://127.0.0.1:8080``. Set for a training job, rank 0's start line
links the run's dashboard page there; set for the server, notifications link
there (default: the address it serves on)."""


# --- the agent's settings, resolved once ------------------------------------

#: The largest frame an agent sends (``nand.wire`` refuses larger ones too).
DEFAULT_MAX_FRAME_BYTES = 4 * 1024 * 1024


def default_spool_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "nand" / "spool"


@dataclass(frozen=True)
class TransportConfig:
    #: Messages held in memory (hand-off queue, and again queue + in flight).
    queue_max: int = 10_000
    spool_dir: Path = dataclasses.field(default_factory=default_spool_dir)
    spool_max_bytes: int = 256 * 1024 * 1024
    ack_timeout_s: float = 5.0
    close_timeout_s: float = 2.0
    curve_server_key: str | None = None
    #: Frames sent and not yet acknowledged, at most.
    window: int = 256
    #: How long messages wait in memory for a first connection before spooling.
    connect_grace_s: float = 1.0
    #: The sender wakes at least this often (events and close wake it at once).
    poll_interval_s: float = 0.1
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    #: With no heartbeat from the training thread for this long, the sender
    #: thread repeats the last one (``keepalive: true``): a rank blocked in a
    #: collective then reads as *stalled* (alive, no progress), not *lost*.
    keepalive_s: float = 10.0
    #: With messages waiting and nothing acknowledged for this long, say so once.
    silence_warn_s: float = 10.0
    #: Sent in ``hello``; the server requires it when it has one (``NAND_TOKEN``).
    token: str | None = None

    @classmethod
    def resolve(cls, **overrides: Any) -> TransportConfig:
        """Settings from the environment; keyword arguments win.

        >>> TransportConfig.resolve(queue_max=10).queue_max
        10
        """
        spool_dir = get_str(NAND_SPOOL_DIR)
        values: dict[str, Any] = {
            "queue_max": get_int(NAND_QUEUE_MAX, cls.queue_max),
            "spool_dir": Path(spool_dir) if spool_dir else default_spool_dir(),
            "spool_max_bytes": get_int(NAND_SPOOL_MAX_BYTES, cls.spool_max_bytes),
            "ack_timeout_s": get_float(NAND_ACK_TIMEOUT_S, cls.ack_timeout_s),
            "close_timeout_s": get_float(NAND_CLOSE_TIMEOUT_S, cls.close_timeout_s),
            "curve_server_key": get_str(NAND_CURVE_SERVER_KEY),
            "token": get_str(NAND_TOKEN),
            "keepalive_s": 2 * get_float(NAND_HEARTBEAT_S, cls.keepalive_s / 2),
            "silence_warn_s": get_float(NAND_SILENCE_WARN_S, cls.silence_warn_s),
        }
        return cls(**values).but(**overrides)

    def but(self, **overrides: Any) -> TransportConfig:
        """These settings with ``overrides`` (those not None), checked."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = set(overrides) - known
        if unknown:
            raise ConfigError(
                f"unknown transport setting(s) {sorted(unknown)}; known: {sorted(known)}"
            )
        given = {k: v for k, v in overrides.items() if v is not None}
        if "spool_dir" in given:
            given["spool_dir"] = Path(given["spool_dir"])
        return dataclasses.replace(self, **given)

    def __post_init__(self) -> None:
        if self.queue_max < 1 or self.window < 1 or self.ack_timeout_s <= 0:
            raise ConfigError("queue_max and window must be >= 1 and ack_timeout_s > 0")


WarningPolicy = Literal["log", "raise", "skip"]
WARNING_POLICIES: tuple[WarningPolicy, ...] = get_args(WarningPolicy)
Read = Literal["auto", "sync", "deferred"]
Mode = Literal["full", "light"]
MODES: tuple[Mode, ...] = get_args(Mode)
READS: tuple[Read, ...] = get_args(Read)


@dataclass(frozen=True)
class AgentConfig:
    """What one ``nand.watch`` runs with: its arguments, else ``NAND_*``, else
    the defaults written here (and nowhere else)."""

    #: Given as a string (``"warn"``…); held as the enum (``nand/policy.py``).
    on_nonfinite: OnNonfinite = OnNonfinite.WARN
    on_warning: WarningPolicy = "log"
    read: Read = "auto"
    mode: Mode = "light"
    disabled: bool = False
    server: str | None = None
    run: str | None = None
    launch: str | None = None
    events_file: str | None = None
    log_events: bool = True
    flight_steps: int = 64
    max_events: int = 1000
    replays: int = 3
    ddp_local_check: bool = True
    read_params_every_step: bool = False
    heartbeat_s: float = 5.0
    fingerprint_steps: int = 100
    close_timeout_s: float = 2.0
    transport: TransportConfig = dataclasses.field(default_factory=TransportConfig)
    #: The server's web address (``NAND_URL``, as the CLI uses it), for the
    #: dashboard link in the start line; the agent itself only talks ZeroMQ.
    url: str | None = None

    @classmethod
    def resolve(cls, **arguments: Any) -> AgentConfig:
        """Arguments that are not None win over the environment.

        >>> AgentConfig.resolve(on_nonfinite="raise", flight_steps=8).flight_steps
        8
        """
        from_env: dict[str, Any] = {
            "on_nonfinite": get_str(NAND_ON_NONFINITE, cls.on_nonfinite),
            "on_warning": get_str(NAND_ON_WARNING, cls.on_warning),
            "read": get_str(NAND_READ, cls.read),
            "mode": get_str(NAND_MODE, cls.mode),
            "disabled": get_bool(NAND_DISABLE, cls.disabled),
            "server": get_str(NAND_SERVER),
            "run": get_str(NAND_RUN),
            "launch": get_str(NAND_LAUNCH),
            "events_file": get_str(NAND_EVENTS_FILE),
            "flight_steps": get_int(NAND_FLIGHT_STEPS, cls.flight_steps),
            "max_events": get_int(NAND_MAX_EVENTS, cls.max_events),
            "replays": get_int(NAND_REPLAYS, cls.replays),
            "ddp_local_check": get_bool(NAND_DDP_LOCAL_CHECK, cls.ddp_local_check),
            "read_params_every_step": get_bool(
                NAND_READ_PARAMS_EVERY_STEP, cls.read_params_every_step
            ),
            "heartbeat_s": get_float(NAND_HEARTBEAT_S, cls.heartbeat_s),
            "close_timeout_s": get_float(NAND_CLOSE_TIMEOUT_S, cls.close_timeout_s),
            "fingerprint_steps": get_int(NAND_FINGERPRINT_STEPS, cls.fingerprint_steps),
            "url": get_str(NAND_URL),
            "transport": TransportConfig.resolve(),
        }
        unknown = set(arguments) - set(from_env) - {"log_events"}
        if unknown:
            raise ConfigError(f"unknown agent setting(s): {', '.join(sorted(unknown))}")
        given = {name: value for name, value in arguments.items() if value is not None}
        resolved = cls(**{**from_env, **given})
        if resolved.disabled:  # nothing leaves the process
            return dataclasses.replace(resolved, server=None, events_file=None, log_events=False)
        return resolved

    def __post_init__(self) -> None:
        """Raise :class:`ConfigError` naming the first value that makes no sense
        (here, so that no AgentConfig, however made, holds one)."""
        object.__setattr__(self, "on_nonfinite", OnNonfinite.parse(self.on_nonfinite))  # (frozen)
        choices = {"on_warning": WARNING_POLICIES, "read": READS, "mode": MODES}
        for name, allowed in choices.items():
            if (value := getattr(self, name)) not in allowed:
                raise ConfigError(f"{name}={value!r}: use one of {', '.join(allowed)}")
        if self.read == "deferred" and self.on_nonfinite.reads_in_sync:
            raise ConfigError(
                f"read='deferred' with on_nonfinite='{self.on_nonfinite}': the decision to "
                "raise is taken before the update, so it reads in sync; use 'auto' or 'sync'"
            )
        if self.flight_steps < 1 or self.max_events < 1:
            raise ConfigError("flight_steps and max_events must be at least 1")
        if min(self.heartbeat_s, self.close_timeout_s, self.fingerprint_steps, self.replays) < 0:
            raise ConfigError(
                "heartbeat_s, close_timeout_s, fingerprint_steps and replays must not be negative"
            )
        problem = run_problem(self.run) if self.run else None  # ("": not given)
        if problem is not None:  # the server would refuse every message of the run
            raise ConfigError(f"run={self.run!r} (or NAND_RUN): {problem}")
