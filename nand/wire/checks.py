"""The checks :func:`nand.wire.decode` runs on a message, one per kind (the
table of kinds, :mod:`nand.wire.kinds`, names each kind's), and the limits they
hold a message to. Each raises :class:`~nand.errors.WireError` with a stable
``reason`` (:data:`nand.wire.kinds.REASONS`) and says where: ``hello.pid``,
``body.flight.steps``...

>>> hello({"agent": "a", "seq": 1, "run": "r", "rank": 0, "time": 0.0, "body": {}})
Traceback (most recent call last):
nand.errors.WireError: missing_field: hello.world_size
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from nand.errors import WireError
from nand.events import CAUSES, PHASES, WARNING_KINDS
from nand.runids import MAX_RUN_CHARS

#: What a server's ``command`` may ask of an agent.
COMMANDS = frozenset({"stop", "send_flight"})
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

_INT = (int,)
_NUM = (int, float)
_STR = (str,)
_OPTIONAL_EVENT_FIELDS = {
    "nan": _INT,
    "posinf": _INT,
    "neginf": _INT,
    "min": _NUM,
    "max": _NUM,
    "max_abs": _NUM,
    "reproduced": (bool,),
    "op": _STR,
    "source": _STR,
    "replay": _STR,
    "via": _STR,
}


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


def hello(message: Mapping[str, Any]) -> None:
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


def event(message: Mapping[str, Any]) -> None:
    body = _agent_envelope(message)
    validate_event_dict(_require(body, "event", (dict,), "body"))
    _validate_flight(body.get("flight"), "body.flight")


def heartbeat(message: Mapping[str, Any]) -> None:
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


def fingerprint(message: Mapping[str, Any]) -> None:
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


def warning(message: Mapping[str, Any]) -> None:
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


def flight(message: Mapping[str, Any]) -> None:
    body = _agent_envelope(message)
    _validate_flight(_require(body, "flight", (dict,), "body"), "body.flight")


def bye(message: Mapping[str, Any]) -> None:
    body = _agent_envelope(message)
    _require(body, "step", _INT, "bye")


def ack(message: Mapping[str, Any]) -> None:
    _require(message, "agent", _STR, "ack", optional=True)
    seqs = _require(message, "seqs", (list,), "ack")
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in seqs):
        raise WireError("bad_field", "ack.seqs must be a list of ints")


def command(message: Mapping[str, Any]) -> None:
    command = _require(message, "command", _STR, "command")
    if command not in COMMANDS:
        raise WireError("bad_field", f"command {command!r} not in {sorted(COMMANDS)}")
    if command == "stop":
        _non_negative(_require(message, "step", _INT, "command"), "command.step")


def reject(message: Mapping[str, Any]) -> None:
    _require(message, "agent", _STR, "reject", optional=True)
    _require(message, "reason", _STR, "reject")
