"""The server's log of who came and went: an operator reads what happened from it.

One INFO line per agent that says hello (run, rank, host, pid) and per rank
that says bye; one WARNING per agent refused for its token (not one per
message: a refused agent resends).

>>> import logging
>>> hello = {"kind": "hello", "agent": "0123456789ab", "run": "r1", "rank": 1,
...          "body": {"world_size": 2, "host": "node-7", "pid": 42}}
>>> agent_line(hello)
'run r1: rank 1 of 2 joined from node-7 (pid 42, agent 01234567)'
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger("nand.server")


def agent_line(message: dict[str, Any]) -> str:
    body = message.get("body") or {}
    return (
        f"run {message['run']}: rank {message['rank']} of {body.get('world_size', '?')} joined "
        f"from {body.get('host') or '?'} (pid {body.get('pid', '?')}, "
        f"agent {str(message['agent'])[:8]})"
    )


def bye_line(message: dict[str, Any]) -> str:
    body = message.get("body") or {}
    reason = body.get("reason") or "no reason"
    step = body.get("step")
    return f"run {message['run']}: rank {message['rank']} left at step {step} ({reason})"


#: The kinds :func:`stored` logs.
ANNOUNCED = ("hello", "bye")


def stored(messages: Iterable[dict[str, Any]]) -> None:
    """Log the hellos and byes of a committed batch."""
    for message in messages:
        if message["kind"] == "hello":
            log.info("%s", agent_line(message))
        elif message["kind"] == "bye":
            log.info("%s", bye_line(message))


class Refusals:
    """Says once per agent that it was refused (agents resend; the log must not flood)."""

    def __init__(self, limit: int = 10_000) -> None:
        self._said: set[str] = set()
        self._limit = limit

    def refused(self, message: dict[str, Any], reason: str) -> None:
        agent = str(message.get("agent"))
        if agent in self._said or len(self._said) >= self._limit:
            return
        self._said.add(agent)
        log.warning(
            "refused agent %s (run %s, rank %s): %s",
            agent[:8],
            message.get("run"),
            message.get("rank"),
            reason,
        )
