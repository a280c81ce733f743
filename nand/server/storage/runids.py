"""Which ``runs`` row (attempt) each message of a batch goes to: decided once
per batch by :func:`nand.server.agents.attempts.resolve`, read by every part
that stores a message (the writer's handlers, the analyses that keep rows)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunIds:
    """Which ``runs`` row (attempt) each message of a batch goes to."""

    live: dict[str, int] = field(default_factory=dict)  # run name -> live attempt's id
    by_agent: dict[str, int] = field(default_factory=dict)  # agent -> its attempt's id

    def of(self, message: dict[str, Any]) -> int:
        # Called several times a message: the live attempt is looked up only for
        # an agent without one (its hello is not stored), not for every message.
        run_id = self.by_agent.get(message["agent"])
        return self.live[message["run"]] if run_id is None else run_id

    def rank_keys(self, messages: Iterable[dict[str, Any]]) -> set[tuple[int, int]]:
        """The ``(run id, rank)`` of every rank ``messages`` came from."""
        senders = {(m["agent"], m["run"], m["rank"]) for m in messages}  # (one per agent)
        return {(self._id(agent, run), rank) for agent, run, rank in senders}

    def _id(self, agent: str, run: str) -> int:
        run_id = self.by_agent.get(agent)
        return self.live[run] if run_id is None else run_id
