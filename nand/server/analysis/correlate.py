"""Correlation across ranks: pure functions over events and rank facts.

Given each rank's logically first event (``nand.events.Event``, ordered by
``(step, micro_step, phase, order)``), decide:

- the **origin**: the least first event over all ranks (ties: lowest rank);
- each rank's **relation** to it: ``origin``; ``simultaneous`` (several ranks
  at the same step, micro-step, phase and module: a numerical problem of the
  model, not one GPU; then *every* rank there is ``simultaneous`` and none is
  the origin, since none was first); ``received`` (its first event came through a
  collective after the origin: ``grad`` of the origin's step, the DDP
  all-reduce; ``forward`` of a later step, an FSDP all-gathered shard; or the
  agent said ``cause="received"``); else ``produced``;
- a **hint** from the evidence (:func:`hint`; the flight-window evidence is
  :mod:`nand.server.analysis.evidence`, the sentences :mod:`nand.server.analysis.summary`);
- a rank's **state** from its heartbeats and bye (:func:`rank_state`; the run's
  state is its first failure in time, :mod:`nand.server.analysis.failures`).

>>> a = Event(rank=3, step=7, phase="forward", module="fc2", module_type="Linear", posinf=1)
>>> b = Event(rank=0, step=7, phase="grad", module="fc2.weight", nan=4)
>>> origin([a, b]).rank, relation(b, a)
(3, 'received')
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from nand.events import Event, RankState, Relation
from nand.server.analysis.evidence import OVERFLOW_SHARE, FlightEvidence, dtype_limit


def origin(firsts: Sequence[Event]) -> Event | None:
    """The logically first of the ranks' first events (ties: one not received,
    then the lowest rank)."""
    return min(firsts, key=lambda e: (e.sort_key(), e.cause == "received", e.rank), default=None)


def same_point(a: Event, b: Event) -> bool:
    """Same step, micro-step, phase and module: neither came first.

    One optimizer update is one point, whichever parameter each rank names: a
    sharded optimizer (ZeRO) updates a different shard on every rank. A rank
    that says it received its value there (ZeRO's parameter broadcast lands it
    in the same parameter, at the same update, as on the rank that made it) was
    not there on its own.
    """
    if a.sort_key()[:3] != b.sort_key()[:3]:
        return False
    if a.rank != b.rank and "received" in (a.cause, b.cause):
        return False
    return a.module == b.module or a.phase == "param"


def relation(first: Event, origin_event: Event) -> Relation:
    """How one rank's first event relates to the run's origin (see the module doc);
    the origin's own rank is ``origin`` here, :func:`relations` says ``simultaneous``
    for it when another rank went non-finite at the same point."""
    if first.rank == origin_event.rank:
        return "origin"
    if same_point(first, origin_event):
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


def relations(firsts: Sequence[Event]) -> dict[int, Relation]:
    """Relation of every rank that has a first event."""
    head = origin(firsts)
    if head is None:
        return {}
    together = any(e.rank != head.rank and same_point(e, head) for e in firsts)
    return relations_to(firsts, head, together)


def relations_to(firsts: Sequence[Event], head: Event, together: bool) -> dict[int, Relation]:
    """Relation of each of ``firsts`` (some of a run's ranks) to the run's origin
    ``head``; ``together``: another rank went non-finite at the origin's point."""
    found = {e.rank: relation(e, head) for e in firsts}
    if together and head.rank in found:
        found[head.rank] = "simultaneous"  # the lowest rank was not first, only first listed
    return found


def first_ranks(firsts: Sequence[Event]) -> list[int]:
    """The ranks where it started: the origin's, or every rank at the same point."""
    head = origin(firsts)
    if head is None:
        return []
    return sorted(e.rank for e in firsts if same_point(e, head))


HINTS = (
    "input_data",
    "loss",
    "optimizer_update",
    "param_written",
    "overflow",
    "gradient_explosion",
    "produced_in_layer",
)


def hint(origin_event: Event | None, evidence: FlightEvidence | None = None) -> str:
    """The most specific cause the evidence supports, from :data:`HINTS`, or ``""``.

    Phase first (it is certain), then the origin rank's flight window:
    ``input_data`` (phase ``input`` or cause ``data``), ``loss``,
    ``param_written`` or ``optimizer_update`` (``param``/``optimizer_state``:
    the gradients were finite, else a ``grad`` event would come first; see
    :func:`written_not_updated`), ``overflow``, ``gradient_explosion``, else
    ``produced_in_layer``.
    """
    if origin_event is None:
        return ""
    if origin_event.phase == "input" or origin_event.cause == "data":
        return "input_data"
    if origin_event.phase == "loss":
        return "loss"
    if origin_event.phase == "param" and written_not_updated(origin_event):
        return "param_written"
    if origin_event.phase in ("param", "optimizer_state"):
        return "optimizer_update"
    if evidence is not None and evidence.overflow:
        return "overflow"
    if evidence is not None and evidence.grad_rising:
        return "gradient_explosion"
    return "produced_in_layer"


def written_not_updated(event: Event) -> bool:
    """A parameter that went non-finite in a few elements while the rest of it
    stayed far from the dtype's limit, from finite gradients: an update cannot
    do that (the learning rate and the optimizer state scale every element
    alike, and a finite update of small values stays finite), so something else
    wrote those elements (code that edits the weights, a checkpoint, memory).

    >>> written_not_updated(Event(phase="param", posinf=1, shape=[64, 64], max_abs=0.3,
    ...                           dtype="float32"))
    True
    >>> written_not_updated(Event(phase="param", posinf=4096, shape=[64, 64], dtype="float32"))
    False
    """
    counts = [c for c in (event.nan, event.posinf, event.neginf) if c is not None]
    if not counts or not event.shape or event.max_abs is None:
        return False  # not counted: no evidence either way
    elements = math.prod(event.shape)
    limit = dtype_limit(event.dtype)
    small = limit is not None and event.max_abs < OVERFLOW_SHARE * limit
    return sum(counts) < elements and small


def rank_state(
    *,
    diverged: bool,
    finished: bool,
    crashed: bool = False,
    last_seen: float,
    step_changed_at: float,
    now: float,
    lost_after_s: float,
    stalled_after_s: float,
) -> RankState:
    """diverged > crashed (left with an exception) > finished (said bye) > lost (silent)
    > stalled (no step progress) > running."""
    if diverged:
        return "diverged"
    if crashed:
        return "crashed"
    if finished:
        return "finished"
    if now - last_seen > lost_after_s:
        return "lost"
    if now - step_changed_at > stalled_after_s:
        return "stalled"
    return "running"


def crashed_bye(reason: str) -> bool:
    """A bye the agent sent while an exception left the watch (``exception: Type``),
    e.g. gloo's ``Connection reset by peer`` after a peer was killed. A requested
    stop (``StopRequested``) is a clean end, not a crash.

    >>> crashed_bye("exception: RuntimeError"), crashed_bye("exception: StopRequested")
    (True, False)
    """
    return reason.startswith("exception:") and not stopped_bye(reason)


def stopped_bye(reason: str) -> bool:
    return reason.startswith("exception:") and "StopRequested" in reason
