"""The one table of message kinds: what each is, and what every part that
handles it needs to know, so a new kind is one row here and its handlers.

Read from it, not from lists of their own:

- the agent's spool (:mod:`nand.agent.transport.spool`): each kind's code on
  disk (:attr:`Kind.code`) and, when the spool is full, which records go first
  (:data:`SPOOL_DROP_ORDER`);
- the server's ingest: which kinds are written before what is queued with
  them, because they decide a verdict (:data:`VERDICT_FIRST`,
  :mod:`nand.server.agents.backlog`);
- the server's writer (:mod:`nand.server.agents.writer`): a handler for each
  agent kind, storing it in :attr:`Kind.stored_in`;
- :func:`nand.wire.decode`: each kind's check (:attr:`Kind.check`).

``tests/test_wire_kinds.py`` holds each of them to this table.

>>> [k.name for k in KINDS if k.sender == "agent"] == list(AGENT_KINDS)
True
>>> SPOOL_DROP_ORDER
('heartbeat', 'fingerprint', 'flight', 'warning', 'event')
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from nand.wire import checks


@dataclass(frozen=True)
class Kind:
    """One kind of message, and what each part that handles it does with it."""

    name: str
    #: Who sends it: an agent (to the server) or the server (to an agent).
    sender: Literal["agent", "server"]
    #: Raises ``WireError`` on a message of this kind that does not parse.
    check: Callable[[Mapping[str, Any]], None]
    #: One line: what it carries (the docs' reference of message kinds).
    about: str
    #: An agent kind's code in the spool file (the tag's low 4 bits, 1..15):
    #: on disk, so never renumbered nor reused; 0 for a server kind.
    code: int = 0
    #: When the spool is full, unmarked records go in this order, lowest
    #: first; None: kept until every kind with a number has gone.
    spool_drop: int | None = None
    #: The server writes it before the messages queued with it: it decides a
    #: verdict (the origin, a rank's exit), so it does not wait behind reports.
    decides_verdict: bool = False
    #: The tables the server stores it in (``nand.server.storage.models``).
    stored_in: tuple[str, ...] = ()


KINDS: tuple[Kind, ...] = (
    Kind(
        "hello",
        "agent",
        checks.hello,
        "A rank joins: identity, versions, device, modules, optimizer, token, launch.",
        code=1,
        stored_in=("agents", "runs", "ranks"),
    ),
    Kind(
        "event",
        "agent",
        checks.event,
        "A non-finite value (nand.Event), with the flight-recorder window.",
        code=2,
        spool_drop=4,
        decides_verdict=True,
        stored_in=("events", "ranks", "flights"),
    ),
    Kind(
        "heartbeat",
        "agent",
        checks.heartbeat,
        "A step's summary: progress, loss, norms, the agent's losses by reason.",
        code=3,
        spool_drop=0,
        stored_in=("heartbeats", "ranks", "drops", "local_grad_norms", "warnings"),
    ),
    Kind(
        "flight",
        "agent",
        checks.flight,
        "A flight-recorder window sent on request (send_flight) or at an incident.",
        code=4,
        spool_drop=2,
        decides_verdict=True,
        stored_in=("flights",),
    ),
    Kind(
        "bye",
        "agent",
        checks.bye,
        "A rank leaves: its last step and why (closed, exit, an exception).",
        code=5,
        decides_verdict=True,
        stored_in=("ranks",),
    ),
    Kind(
        "fingerprint",
        "agent",
        checks.fingerprint,
        "One int64 per parameter at a step: the DDP replicas compared.",
        code=6,
        spool_drop=1,
        stored_in=("fingerprints", "runs"),
    ),
    Kind(
        "warning",
        "agent",
        checks.warning,
        "An early warning (nand.events.Alert): still finite, but heading there.",
        code=7,
        spool_drop=3,
        decides_verdict=True,
        stored_in=("warnings",),
    ),
    Kind("ack", "server", checks.ack, "Sequence numbers committed: the agent may forget them."),
    Kind("command", "server", checks.command, "stop at a step, or send_flight."),
    Kind("reject", "server", checks.reject, "Messages refused (a bad token): stop sending."),
)

BY_NAME = {kind.name: kind for kind in KINDS}
#: What an agent sends, in code order.
AGENT_KINDS = tuple(k.name for k in sorted(KINDS, key=lambda k: k.code) if k.sender == "agent")
SERVER_KINDS = frozenset(k.name for k in KINDS if k.sender == "server")
#: The spool's order of drops when it is full; kinds not named go last.
SPOOL_DROP_ORDER = tuple(
    k.name for k in sorted(KINDS, key=lambda k: k.spool_drop or 0) if k.spool_drop is not None
)
#: Kinds the server writes before the others queued with them.
VERDICT_FIRST = frozenset(k.name for k in KINDS if k.decides_verdict)

#: Stable rejection reasons, counted by the server.
REASONS = (
    "too_large",
    "not_msgpack",
    "not_a_map",
    "bad_version",
    "unknown_kind",
    "missing_field",
    "bad_field",
    "unauthenticated",
)
#: Why a server refuses an agent's identity (a ``reject``'s reason besides
#: ``unauthenticated``): another process holds its agent id or rank, or its run
#: id cannot be one (``nand.runids``).
IDENTITY_REASONS = ("identity_mismatch", "agent_in_use", "bad_run")
