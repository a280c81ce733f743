"""Correlation across ranks: pure functions over events and rank facts.

Given each rank's logically first event (``nand.events.Event``, ordered by
``(step, micro_step, phase, order)``), decide:

- the **origin**: the least first event over all ranks (ties: lowest rank);
- each rank's **relation** to it: ``origin``; ``simultaneous`` (same step,
  micro-step, phase and module as the origin: a numerical problem of the
  model, not one GPU); ``received`` (its first event came through a
  collective after the origin: ``grad`` of the origin's step, the DDP
  all-reduce; ``forward`` of a later step, an FSDP all-gathered shard; or the
  agent said ``cause="received"``); else ``produced``;
- a **hint** from the evidence (:func:`hint`; the flight-window evidence is
  :mod:`nand.server.evidence`, the sentences :mod:`nand.server.summary`);
- rank and run **states** from heartbeats (:func:`rank_state`, :func:`run_state`).

>>> a = Event(rank=3, step=7, phase="forward", module="fc2", module_type="Linear", posinf=1)
>>> b = Event(rank=0, step=7, phase="grad", module="fc2.weight", nan=4)
>>> origin([a, b]).rank, relation(b, a)
(3, 'received')
"""

from __future__ import annotations

from collections.abc import Sequence

from nand.events import PHASE_RANK, Event
from nand.server.evidence import FlightEvidence


def origin(firsts: Sequence[Event]) -> Event | None:
    """The logically first of the ranks' first events (ties: the lowest rank)."""
    return min(firsts, key=lambda e: (e.sort_key(), e.rank), default=None)


def relation(first: Event, origin_event: Event) -> str:
    """How one rank's first event relates to the run's origin (see the module doc)."""
    if first.rank == origin_event.rank:
        return "origin"
    same_point = first.sort_key()[:3] == origin_event.sort_key()[:3]
    if same_point and first.module == origin_event.module:
        return "simultaneous"
    if first.cause == "received" or _through_collective(first, origin_event):
        return "received"
    return "produced"


def _through_collective(first: Event, origin_event: Event) -> bool:
    after = first.sort_key() > origin_event.sort_key()
    if first.phase == "grad":
        return after and first.step == origin_event.step
    if first.phase == "forward":
        return first.step > origin_event.step
    return False


def relations(firsts: Sequence[Event]) -> dict[int, str]:
    """Relation of every rank that has a first event."""
    head = origin(firsts)
    if head is None:
        return {}
    return {e.rank: relation(e, head) for e in firsts}


HINTS = (
    "input_data",
    "loss",
    "optimizer_update",
    "overflow",
    "gradient_explosion",
    "produced_in_layer",
)


def hint(origin_event: Event | None, evidence: FlightEvidence | None = None) -> str:
    """The most specific cause the evidence supports, from :data:`HINTS`, or ``""``.

    Phase first (it is certain), then the origin rank's flight window:
    ``input_data`` (phase ``input`` or cause ``data``), ``loss``,
    ``optimizer_update`` (``param``/``optimizer_state``: the gradients were
    finite, else a ``grad`` event would come first), ``overflow``,
    ``gradient_explosion``, else ``produced_in_layer``.
    """
    if origin_event is None:
        return ""
    if origin_event.phase == "input" or origin_event.cause == "data":
        return "input_data"
    if origin_event.phase == "loss":
        return "loss"
    if origin_event.phase in ("param", "optimizer_state"):
        return "optimizer_update"
    if evidence is not None and evidence.overflow:
        return "overflow"
    if evidence is not None and evidence.grad_rising:
        return "gradient_explosion"
    return "produced_in_layer"


def rank_state(
    *,
    diverged: bool,
    finished: bool,
    last_seen: float,
    step_changed_at: float,
    now: float,
    lost_after_s: float,
    stalled_after_s: float,
) -> str:
    """diverged > finished (said bye) > lost (silent) > stalled (no step progress) > running."""
    if diverged:
        return "diverged"
    if finished:
        return "finished"
    if now - last_seen > lost_after_s:
        return "lost"
    if now - step_changed_at > stalled_after_s:
        return "stalled"
    return "running"


def run_state(rank_states: Sequence[str]) -> str:
    """diverged if any rank is; else lost, else stalled if any; finished if all; else healthy."""
    for state in ("diverged", "lost", "stalled"):
        if state in rank_states:
            return state
    if rank_states and all(s == "finished" for s in rank_states):
        return "finished"
    return "healthy"


def phase_rank(phase: str) -> int:
    return PHASE_RANK.get(phase, len(PHASE_RANK))
