"""Encoding and validation of the messages between agents and the server.

Every message is one msgpack map (one ZeroMQ frame)::

    message   = {"v": PROTOCOL_VERSION, "kind": kind, ...kind fields}

    agent → server (all carry "agent", "seq", "run", "rank", "time", "body"):
      hello      body = {identity..., "versions", "device", "modules", "optimizer", "token"?,
                         "launch"?}  launch: NAND_LAUNCH, tells a rerun under the same run apart
      event      body = {"event": Event.to_dict(), "flight": FlightWindow.to_dict() | None}
      heartbeat  body = StepSummary.to_dict() + {"dropped"?: {reason: n}}  the agent's
                 cumulative losses by reason (DROP_REASONS in nand.events; another short
                 identifier is accepted from a newer agent): at most MAX_DROP_REASONS
                 entries, counts 0 <= n <= 2**63 - 1; "local_grad_norms"?: [[step, norm],
                 ...] (DDP, at most MAX_LOCAL_NORMS, each norm finite and >= 0)
      flight     body = {"flight": FlightWindow.to_dict(), "reason": str}
      fingerprint body = {"step", "names", "values", "group"?}: see _validate_fingerprint
      bye        body = {"step": int, "reason": str}
      warning    body = Alert.to_dict(): an early warning, never an incident: "kind" (one
                 of WARNING_KINDS in nand.events), "step", "module"?, "value"?,
                 "reference"?, "message"?: see _validate_warning

    server → agent:
      ack        {"agent": str?, "seqs": [int, ...]}  committed; the agent may forget them.
                 "agent" names whose seqs these are; the server should always
                 send it, because an agent also replays frames that earlier
                 agents of its rank spooled (their own agent ids). Without it
                 the ack is for the agent that owns the connection.
      command    {"command": "stop", "step": int, "reason": str}
                 {"command": "send_flight"}
      reject     {"agent": str?, "reason": str}  e.g. a bad token. "agent" names whose
                 messages are refused: the agent stops sending when they are its
                 own (or none is named) and drops the spooled frames of an
                 earlier agent of its rank when they are that agent's.

``run`` is one path segment of the server's REST API (``/api/runs/{run}``):
:mod:`nand.runids` says which strings can be one (``run_problem``); the
server refuses the others (``bad_run``), which could be stored but never read back.

``agent`` is a random id per agent process; ``(agent, seq)`` identifies a
message for deduplication (delivery is at-least-once). ``seq`` starts at 1.

:func:`decode` validates the structure and the types of everything the server
relies on and raises :class:`~nand.errors.WireError` with a stable ``reason``
otherwise. Unknown extra keys are kept and ignored, so a newer agent can talk
to an older server within one protocol version.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgpack

from nand.config import DEFAULT_MAX_FRAME_BYTES
from nand.errors import WireError
from nand.events import CAUSES, PHASES, WARNING_KINDS
from nand.runids import MAX_RUN_CHARS

PROTOCOL_VERSION = 1

#: Frames above this size are rejected unread (a flight window of 1,000 layers
#: by 64 steps is about 1.2 MB).
DEFAULT_MAX_BYTES = DEFAULT_MAX_FRAME_BYTES

#: What an agent sends. Also the spool's kind codes (position + 1, on disk): append, never reorder.
AGENT_KINDS = ("hello", "event", "heartbeat", "flight", "bye", "fingerprint", "warning")
SERVER_KINDS = frozenset({"ack", "command", "reject"})
COMMANDS = frozenset({"stop", "send_flight"})

# Stable rejection reasons, counted by the server.
REASONS = (
    "too_large", "not_msgpack", "not_a_map", "bad_version", "unknown_kind", "missing_field",
    "bad_field", "unauthenticated",
)  # fmt: skip

#: A heartbeat's ``dropped`` map: at most this many reasons (the agent has 8),
#: each a short identifier, each count a non-negative 64-bit integer.
MAX_DROP_REASONS = 32
DROP_REASON_PATTERN = re.compile(r"[a-z][a-z0-9_]{0,39}")
MAX_DROP_COUNT = 2**63 - 1
#: A fingerprint names at most this many parameters, each name this long,
#: and its replica group at most MAX_MESH_DIMS mesh coordinates.
MAX_FINGERPRINT_PARAMS = 100_000
MAX_NAME_CHARS = 512
MAX_MESH_DIMS = 8
#: A heartbeat carries at most this many local gradient norms (recorder.LOCAL_NORMS_KEPT).
MAX_LOCAL_NORMS = 256


def encode(message: Mapping[str, Any]) -> bytes:
    """Pack one message, adding the protocol version (a dict that has it is packed as is)."""
    has_v = type(message) is dict and "v" in message
    payload = message if has_v else {**message, "v": message.get("v", PROTOCOL_VERSION)}
    packed: bytes = msgpack.packb(payload, use_bin_type=True, default=_plain)
    return packed


def _plain(value: Any) -> Any:
    """What msgpack cannot carry natively (sets, dataclasses, dtypes, paths)."""
    if isinstance(value, set | frozenset):
        return sorted(value, key=repr)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    # The agent must never fail on an odd value in a hello (a torch.dtype, a
    # Path): its text is what a person wants to see anyway.
    return str(value)


def agent_message(
    kind: str, *, agent: str, seq: int, run: str, rank: int, body: Mapping[str, Any]
) -> dict[str, Any]:
    """Build an agent → server message (not yet encoded)."""
    if kind not in AGENT_KINDS:
        raise ValueError(f"unknown agent message kind {kind!r}")
    return {
        "v": PROTOCOL_VERSION,
        "kind": kind,
        "agent": agent,
        "seq": seq,
        "run": run,
        "rank": rank,
        "time": time.time(),
        "body": dict(body),
    }


def decode(frame: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> dict[str, Any]:
    """Unpack and validate one frame; raise WireError with a reason if it is bad."""
    if len(frame) > max_bytes:
        raise WireError("too_large", f"{len(frame)} bytes > limit {max_bytes}")
    try:
        message = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise WireError("not_msgpack", f"{type(exc).__name__}: {exc}") from None
    if not isinstance(message, dict):
        raise WireError("not_a_map", f"top level is {type(message).__name__}")
    version = message.get("v")
    if version != PROTOCOL_VERSION:
        raise WireError("bad_version", f"protocol {version!r}, expected {PROTOCOL_VERSION}")
    kind = message.get("kind")
    validator = _VALIDATORS.get(kind) if isinstance(kind, str) else None
    if validator is None:
        raise WireError("unknown_kind", f"kind {kind!r}")
    validator(message)
    return message


# --- validation -------------------------------------------------------------

_INT = (int,)
_NUM = (int, float)
_STR = (str,)
_OPTIONAL_EVENT_FIELDS = {"nan": _INT, "posinf": _INT, "neginf": _INT, "min": _NUM, "max": _NUM,
    "max_abs": _NUM, "reproduced": (bool,), "op": _STR, "source": _STR, "replay": _STR,
    "via": _STR}  # fmt: skip


def _require(
    obj: Mapping[str, Any], key: str, types: tuple[type, ...], where: str, optional: bool = False
) -> Any:
    value = obj.get(key)
    if type(value) in types:  # the usual case first (msgpack makes no subclasses)
        return value
    if value is None:
        if optional:
            return None
        raise WireError("missing_field", f"{where}.{key}")
    # bool is an int subclass; a bool where a number is expected is a bug upstream.
    if isinstance(value, bool) and bool not in types:
        raise WireError("bad_field", f"{where}.{key} is a bool")
    if not isinstance(value, types):
        names = "/".join(t.__name__ for t in types)
        raise WireError("bad_field", f"{where}.{key} is {type(value).__name__}, expected {names}")
    return value


def _non_negative(value: int, where: str) -> None:
    if value < 0:
        raise WireError("bad_field", f"{where} is negative")


def _agent_envelope(message: Mapping[str, Any]) -> Mapping[str, Any]:
    agent = _require(message, "agent", _STR, "message")
    if not agent or len(agent) > 128:
        raise WireError("bad_field", "message.agent must be 1..128 characters")
    _non_negative(_require(message, "seq", _INT, "message"), "message.seq")
    run = _require(message, "run", _STR, "message")
    if not run or len(run) > MAX_RUN_CHARS:
        raise WireError("bad_field", f"message.run must be 1..{MAX_RUN_CHARS} characters")
    _non_negative(_require(message, "rank", _INT, "message"), "message.rank")
    _require(message, "time", _NUM, "message")
    body: Mapping[str, Any] = _require(message, "body", (dict,), "message")
    return body


def _validate_hello(message: Mapping[str, Any]) -> None:
    body = _agent_envelope(message)
    _non_negative(_require(body, "world_size", _INT, "hello"), "hello.world_size")
    _require(body, "host", _STR, "hello")
    _require(body, "pid", _INT, "hello")
    _require(body, "launch", _STR, "hello", optional=True)
    modules = _require(body, "modules", (list,), "hello", optional=True) or []
    for i, entry in enumerate(modules):
        if not isinstance(entry, dict):
            raise WireError("bad_field", f"hello.modules[{i}] is not a map")
        _require(entry, "name", _STR, f"hello.modules[{i}]")


def validate_event_dict(event: Mapping[str, Any], where: str = "event") -> None:
    """Check the fields of an Event mapping that the server relies on."""
    phase = _require(event, "phase", _STR, where)
    if phase not in PHASES:
        raise WireError("bad_field", f"{where}.phase {phase!r} not in {PHASES}")
    for key in ("step", "micro_step", "order"):
        _non_negative(_require(event, key, _INT, where), f"{where}.{key}")
    _require(event, "module", _STR, where)
    cause = _require(event, "cause", _STR, where)
    if cause not in CAUSES:
        raise WireError("bad_field", f"{where}.cause {cause!r} not in {CAUSES}")
    for key, types in _OPTIONAL_EVENT_FIELDS.items():  # (op... replay: nand.agent.rerun)
        _require(event, key, types, where, optional=True)
    shape = _require(event, "shape", (list,), where, optional=True) or []
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise WireError("bad_field", f"{where}.shape must be a list of ints")


def _validate_flight(flight: Any, where: str) -> None:
    if flight is None:
        return
    if not isinstance(flight, dict):
        raise WireError("bad_field", f"{where} is not a map")
    steps = _require(flight, "steps", (list,), where)
    modules = _require(flight, "modules", (list,), where)
    for key in ("act_max_abs", "grad_max_abs"):
        rows = _require(flight, key, (list,), where)
        if rows and len(rows) != len(steps):
            raise WireError(
                "bad_field", f"{where}.{key} has {len(rows)} rows for {len(steps)} steps"
            )
        for row in rows:
            if not isinstance(row, list) or len(row) != len(modules):
                raise WireError("bad_field", f"{where}.{key} rows must have one value per module")


def _validate_event(message: Mapping[str, Any]) -> None:
    body = _agent_envelope(message)
    validate_event_dict(_require(body, "event", (dict,), "body"))
    _validate_flight(body.get("flight"), "body.flight")


def _validate_heartbeat(message: Mapping[str, Any]) -> None:
    body = _agent_envelope(message)
    _non_negative(_require(body, "step", _INT, "heartbeat"), "heartbeat.step")
    for key in ("steps_per_s", "loss", "grad_norm", "max_activation", "amp_scale"):
        if type(body.get(key)) not in _NUM:  # (a number: fine; else _require says what)
            _require(body, key, _NUM, "heartbeat", optional=True)
    validate_dropped(_require(body, "dropped", (dict,), "heartbeat", optional=True))
    _validate_local_norms(_require(body, "local_grad_norms", (list,), "heartbeat", optional=True))


def _validate_local_norms(pairs: list[Any] | None) -> None:
    """``[[step, norm], ...]``: steps non-negative ints, norms finite and >= 0."""
    if pairs is None:
        return
    if len(pairs) > MAX_LOCAL_NORMS:
        raise WireError("bad_field", f"heartbeat.local_grad_norms: over {MAX_LOCAL_NORMS}")
    for pair in pairs:
        step, norm = pair if isinstance(pair, list | tuple) and len(pair) == 2 else (-1, 0)
        if not (type(step) is int and step >= 0 and type(norm) in (int, float)):
            raise WireError("bad_field", "heartbeat.local_grad_norms: [[step, norm], ...]")
        if not 0 <= norm < float("inf"):
            raise WireError("bad_field", "heartbeat.local_grad_norms: a norm is not finite")


def _validate_fingerprint(message: Mapping[str, Any]) -> None:
    """``{step, names, values, group?}``: one int64 per parameter (``agent.step.fingerprint``);
    ``group``: the replica group, a few mesh coordinates (absent or ``[]``: every rank)."""
    body = _agent_envelope(message)
    _non_negative(_require(body, "step", _INT, "fingerprint"), "fingerprint.step")
    names = _require(body, "names", (list,), "fingerprint")
    values = _require(body, "values", (list,), "fingerprint")
    if len(names) != len(values) or len(names) > MAX_FINGERPRINT_PARAMS:
        raise WireError("bad_field", f"fingerprint: {len(names)} names, {len(values)} values")
    if not all(isinstance(n, str) and len(n) <= MAX_NAME_CHARS for n in names):
        raise WireError("bad_field", "fingerprint.names must be strings")
    if not all(type(v) is int and -MAX_DROP_COUNT - 1 <= v <= MAX_DROP_COUNT for v in values):
        raise WireError("bad_field", "fingerprint.values must be 64-bit integers")
    group = _require(body, "group", (list,), "fingerprint", optional=True) or []
    if len(group) > MAX_MESH_DIMS or not all(type(c) is int and 0 <= c < 2**31 for c in group):
        raise WireError("bad_field", "fingerprint.group must be a few mesh coordinates")


def _validate_warning(message: Mapping[str, Any]) -> None:
    """An early warning (``nand.events.Alert``): a known kind, a step, figures, words."""
    body = _agent_envelope(message)
    kind = _require(body, "kind", _STR, "warning")
    if kind not in WARNING_KINDS:
        raise WireError("bad_field", f"warning.kind {kind!r} not in {WARNING_KINDS}")
    _non_negative(_require(body, "step", _INT, "warning"), "warning.step")
    module = _require(body, "module", _STR, "warning", optional=True) or ""
    text = _require(body, "message", _STR, "warning", optional=True) or ""
    if len(module) > MAX_NAME_CHARS or len(text) > 2000:
        raise WireError("bad_field", "warning.module or warning.message too long")
    for key in ("value", "reference"):
        _require(body, key, _NUM, "warning", optional=True)


def validate_dropped(dropped: Mapping[str, Any] | None, where: str = "heartbeat.dropped") -> None:
    """Check a heartbeat's cumulative loss counts ``{reason: n}`` (absent: none).

    >>> validate_dropped({"spool_full": 1000, "queue_full": 0})
    >>> validate_dropped({"spool_full": -1})
    Traceback (most recent call last):
    nand.errors.WireError: bad_field: heartbeat.dropped['spool_full'] is negative
    """
    if dropped is None:
        return
    if len(dropped) > MAX_DROP_REASONS:
        raise WireError("bad_field", f"{where} has {len(dropped)} reasons > {MAX_DROP_REASONS}")
    for reason, count in dropped.items():
        if not isinstance(reason, str) or not DROP_REASON_PATTERN.fullmatch(reason):
            shown = reason[:64] if isinstance(reason, str | bytes) else reason
            raise WireError("bad_field", f"{where} reason {shown!r} is not a short identifier")
        if isinstance(count, bool) or not isinstance(count, int):
            raise WireError("bad_field", f"{where}[{reason!r}] is {type(count).__name__}, not int")
        if count < 0:
            raise WireError("bad_field", f"{where}[{reason!r}] is negative")
        if count > MAX_DROP_COUNT:
            raise WireError("bad_field", f"{where}[{reason!r}] is beyond 2**63 - 1")


def _validate_flight_message(message: Mapping[str, Any]) -> None:
    body = _agent_envelope(message)
    _validate_flight(_require(body, "flight", (dict,), "body"), "body.flight")


def _validate_bye(message: Mapping[str, Any]) -> None:
    body = _agent_envelope(message)
    _require(body, "step", _INT, "bye")


def _validate_ack(message: Mapping[str, Any]) -> None:
    _require(message, "agent", _STR, "ack", optional=True)
    seqs = _require(message, "seqs", (list,), "ack")
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in seqs):
        raise WireError("bad_field", "ack.seqs must be a list of ints")


def _validate_command(message: Mapping[str, Any]) -> None:
    command = _require(message, "command", _STR, "command")
    if command not in COMMANDS:
        raise WireError("bad_field", f"command {command!r} not in {sorted(COMMANDS)}")
    if command == "stop":
        _non_negative(_require(message, "step", _INT, "command"), "command.step")


def _validate_reject(message: Mapping[str, Any]) -> None:
    _require(message, "agent", _STR, "reject", optional=True)
    _require(message, "reason", _STR, "reject")


_VALIDATORS: dict[str, Callable[[Mapping[str, Any]], None]] = {
    "hello": _validate_hello,
    "event": _validate_event,
    "heartbeat": _validate_heartbeat,
    "flight": _validate_flight_message,
    "fingerprint": _validate_fingerprint,
    "warning": _validate_warning,
    "bye": _validate_bye,
    "ack": _validate_ack,
    "command": _validate_command,
    "reject": _validate_reject,
}


def json_safe(value: Any) -> Any:
    """Replace NaN/inf floats (not valid JSON) with None, recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value
