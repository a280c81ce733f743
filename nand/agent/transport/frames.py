"""What the sender moves: a frame (one encoded message and its delivery state)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from nand.agent.transport import spool as spool_mod
from nand.agent.transport.mailbox import Outgoing
from nand.wire import PROTOCOL_VERSION


@dataclass(kw_only=True)
class Frame:
    agent: str
    seq: int
    kind: str
    keep: bool
    data: bytes
    from_spool: bool = False
    deadline: float = 0.0  # of its ack; set when it is sent
    start: int = 0  # a frame read from the spool: the offset of its record

    @property
    def sent(self) -> bool:
        """Put on the socket at least once: the server may have it."""
        return self.deadline > 0.0


@dataclass(kw_only=True)
class Envelope:
    """What the sender needs to wrap bodies into wire messages."""

    agent: str
    run: str
    rank: int


def outgoing_message(envelope: Envelope, out: Outgoing) -> dict[str, Any]:
    """``out`` as the wire message :func:`nand.wire.agent_message` builds (the
    same keys in the same order, so the same bytes: a test holds them equal),
    made in one step: no message built and then copied twice for each frame."""
    return {
        "v": PROTOCOL_VERSION,
        "kind": out.kind,
        "agent": envelope.agent,
        "seq": out.seq,
        "run": envelope.run,
        "rank": envelope.rank,
        "time": out.time,
        "body": out.build_body(),
    }


def spooled_frame(payload: bytes, tag: int, start: int = 0) -> Frame:
    """A frame read back from the spool (its record at offset ``start``); its
    (agent, seq) come from the bytes."""
    try:
        message = msgpack.unpackb(payload, raw=False)
        agent, seq = str(message["agent"]), int(message["seq"])
    except Exception:
        agent, seq = "?", -1  # sent anyway: the server counts what it rejects
    kind = spool_mod.KIND_NAMES.get(tag & 0x0F, "event")
    keep = bool(tag & spool_mod.KEEP)
    return Frame(
        agent=agent, seq=seq, kind=kind, keep=keep, data=payload, from_spool=True, start=start
    )
