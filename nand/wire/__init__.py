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
      fingerprint body = {"step", "names", "values", "group"?}: see checks.fingerprint
      warning    body = {"kind": WARNING_KINDS, "step", "module"?, "value"?, "reference"?,
                         "message"?}  an early warning (nand.events.Alert): still finite
      bye        body = {"step": int, "reason": str}

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

Each kind's properties (its spool code, what the spool drops first, what
decides a verdict first, where the server stores it) are one table,
:data:`nand.wire.kinds.KINDS`; each kind's check is in :mod:`nand.wire.checks`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping
from typing import Any

import msgpack

from nand.config import DEFAULT_MAX_FRAME_BYTES
from nand.errors import WireError
from nand.wire.checks import (
    COMMANDS,
    DROP_REASON_PATTERN,
    MAX_DROP_COUNT,
    MAX_DROP_REASONS,
    MAX_FINGERPRINT_PARAMS,
    MAX_LOCAL_NORMS,
    MAX_MESH_DIMS,
    MAX_NAME_CHARS,
    validate_dropped,
    validate_event_dict,
)
from nand.wire.kinds import (
    AGENT_KINDS,
    BY_NAME,
    IDENTITY_REASONS,
    KINDS,
    REASONS,
    SERVER_KINDS,
    Kind,
)

__all__ = [
    "AGENT_KINDS",
    "COMMANDS",
    "DEFAULT_MAX_BYTES",
    "DROP_REASON_PATTERN",
    "IDENTITY_REASONS",
    "KINDS",
    "MAX_DROP_COUNT",
    "MAX_DROP_REASONS",
    "MAX_FINGERPRINT_PARAMS",
    "MAX_LOCAL_NORMS",
    "MAX_MESH_DIMS",
    "MAX_NAME_CHARS",
    "PROTOCOL_VERSION",
    "REASONS",
    "SERVER_KINDS",
    "Kind",
    "agent_message",
    "decode",
    "encode",
    "json_safe",
    "validate_dropped",
    "validate_event_dict",
]

PROTOCOL_VERSION = 1

#: Frames above this size are rejected unread (a flight window of 1,000 layers
#: by 64 steps is about 1.2 MB).
DEFAULT_MAX_BYTES = DEFAULT_MAX_FRAME_BYTES


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
    known = BY_NAME.get(kind) if isinstance(kind, str) else None
    if known is None:
        raise WireError("unknown_kind", f"kind {kind!r}")
    known.check(message)
    return message


def json_safe(value: Any) -> Any:
    """Replace NaN/inf floats (not valid JSON) with None, recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value
