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
- a **hint** from the evidence (:func:`hint`), and a **summary** sentence;
- rank and run **states** from heartbeats (:func:`rank_state`, :func:`run_state`).

>>> a = Event(rank=3, step=7, phase="forward", module="fc2", module_type="Linear", posinf=1)
>>> b = Event(rank=0, step=7, phase="grad", module="fc2.weight", nan=4)
>>> origin([a, b]).rank, relation(b, a)
(3, 'received')
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nand.events import PHASE_RANK, Event

#: Overflow: the window's largest finite max|x| reached this share of the dtype's limit.
OVERFLOW_SHARE = 0.1
#: Gradient explosion: the grad norm grew at least this much over the window...
EXPLOSION_FACTOR = 10.0
#: ...rising on at least this share of consecutive steps.
EXPLOSION_RISING_SHARE = 2 / 3


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


@dataclass(frozen=True)
class FlightEvidence:
    overflow: bool = False
    grad_rising: bool = False
    #: One phrase for the summary, e.g. "max |x| rose from 3 to 6.1e+04 (float16 limit 65504)".
    text: str = ""


def flight_evidence(flight: dict[str, Any]) -> FlightEvidence:
    """What a flight-recorder window says about overflow and gradient growth."""
    steps = [s for s in flight.get("steps") or [] if isinstance(s, int)]
    overflow_text = _overflow(flight, steps)
    rising_text = _grad_rising(flight.get("grad_norm") or [], steps)
    return FlightEvidence(
        overflow=bool(overflow_text),
        grad_rising=bool(rising_text),
        text=overflow_text or rising_text,
    )


def _finite(values: Any) -> list[float]:
    if not isinstance(values, list | tuple):
        return []
    return [
        float(v)
        for v in values
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    ]


def _span(steps: list[int]) -> str:
    return f" over steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else ""


def _overflow(flight: dict[str, Any], steps: list[int]) -> str:
    """Peak finite max|x| per step (activations and gradients) near the dtype's limit."""
    limit = flight.get("dtype_max")
    if not isinstance(limit, int | float) or not math.isfinite(limit) or limit <= 0:
        return ""
    act = _rows(flight.get("act_max_abs"))
    grad = _rows(flight.get("grad_max_abs"))
    n = max(len(act), len(grad))
    act, grad = act + [[]] * (n - len(act)), grad + [[]] * (n - len(grad))
    peaks = [max(_finite(a) + _finite(g), default=0.0) for a, g in zip(act, grad, strict=True)]
    peaks = [p for p in peaks if p > 0]
    if not peaks or max(peaks) < OVERFLOW_SHARE * limit or max(peaks) <= peaks[0]:
        return ""
    dtype = flight.get("dtype") or "dtype"
    return (
        f"max |x| rose from {peaks[0]:.3g} to {max(peaks):.3g} "
        f"({dtype} limit {limit:.6g}){_span(steps)}"
    )


def _rows(rows: Any) -> list[list[Any]]:
    return [r if isinstance(r, list) else [] for r in rows] if isinstance(rows, list) else []


def _grad_rising(grad_norm: Sequence[Any], steps: list[int]) -> str:
    values = _finite(grad_norm)
    if len(values) < 3 or values[0] <= 0 or values[-1] < EXPLOSION_FACTOR * values[0]:
        return ""
    ups = sum(b > a for a, b in itertools.pairwise(values))
    if ups < EXPLOSION_RISING_SHARE * (len(values) - 1):
        return ""
    return f"gradient norm rose from {values[0]:.3g} to {values[-1]:.3g}{_span(steps)}"


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


def value_kinds(event: Event) -> str:
    parts = []
    for count, name in ((event.nan, "NaN"), (event.posinf, "+inf"), (event.neginf, "-inf")):
        if count:
            parts.append(name)
    return " and ".join(parts) if parts else "a non-finite value"


def _ranks(ranks: Sequence[int]) -> str:
    ordered = sorted(ranks)
    return f"rank {ordered[0]}" if len(ordered) == 1 else "ranks " + ", ".join(map(str, ordered))


def _where(event: Event) -> str:
    name = event.module or "<root>"
    where = f"{name} ({event.module_type})" if event.module_type else name
    step = f"step {event.step}" + (f" (micro-step {event.micro_step})" if event.micro_step else "")
    return {
        "input": f"in its input data at {step}",
        "loss": f"in the loss gradient at {step}",
        "forward": f"in {where} during forward at {step}",
        "backward": f"in {where} during backward at {step}",
        "grad": f"in the gradient of {where} at {step}",
        "param": f"in parameter {where} after the optimizer step at {step}",
        "optimizer_state": f"in optimizer state {where} at {step}",
    }.get(event.phase, f"in {where} during {event.phase} at {step}")


_HINT_TEXT = {
    "input_data": "the input batch already held it: check the data pipeline of that rank",
    "loss": "the loss went non-finite while the model's outputs were finite",
    "optimizer_update": (
        "the optimizer step turned finite gradients into non-finite parameters: "
        "check the learning rate and the optimizer state"
    ),
    "produced_in_layer": "the layer made it from finite inputs",
}


def _hint_sentence(hint_name: str, evidence: FlightEvidence | None) -> str:
    if hint_name in ("overflow", "gradient_explosion"):
        label = "overflow" if hint_name == "overflow" else "gradient explosion"
        detail = evidence.text if evidence is not None else ""
        return f"Hint: {label}" + (f": {detail}." if detail else ".")
    text = _HINT_TEXT.get(hint_name)
    return f"Hint: {text}." if text else ""


def _channel(event: Event) -> str:
    if event.phase == "grad":
        return "the gradient all-reduce"
    if event.phase == "forward":
        return "the parameter all-gather of the next step"
    return "a collective"


def diverged_summary(
    firsts: Sequence[Event],
    world_size: int,
    hint_name: str,
    evidence: FlightEvidence | None = None,
) -> str:
    """The sentence for a run that went non-finite."""
    head = origin(firsts)
    if head is None:
        return ""
    rel = {e.rank: relation(e, head) for e in firsts}
    together = [r for r, k in rel.items() if k in ("origin", "simultaneous")]
    world = max(world_size, len(rel))
    parts = [_opening(head, together, world)]
    parts.extend(_followers(firsts, rel, head, world, len(together)))
    sentence = "; ".join(parts) + "."
    if len(together) == 1 and world > 1 and head.phase != "loss":
        sentence += f" Only rank {head.rank} produced it: suspect its data or its GPU."
    extra = _hint_sentence(hint_name, evidence)
    return f"{sentence} {extra}" if extra else sentence


def _opening(head: Event, together: list[int], world: int) -> str:
    what = f"{value_kinds(head)} {_where(head)}"
    if len(together) > 1:
        who = f"all {world} ranks" if len(together) >= world else _ranks(together)
        return (
            f"{who} went non-finite at the same point, {what}: a numerical problem of the "
            "model or its hyper-parameters, not one faulty GPU"
        )
    verb = "got" if head.phase == "input" or head.cause == "data" else "produced"
    return f"rank {head.rank} {verb} {what}"


def _followers(
    firsts: Sequence[Event], rel: dict[int, str], head: Event, world: int, n_together: int
) -> list[str]:
    by_channel: dict[str, list[int]] = {}
    for event in firsts:
        if rel[event.rank] == "received":
            by_channel.setdefault(_channel(event), []).append(event.rank)
    parts = []
    for channel, ranks in by_channel.items():
        others = world - n_together
        who = f"the other {others} ranks" if len(ranks) == others and others > 1 else _ranks(ranks)
        parts.append(f"{who} received it through {channel}")
    later = [e.rank for e in firsts if rel[e.rank] == "produced"]
    if later:
        parts.append(f"{_ranks(later)} went non-finite later on their own")
    return parts


def calm_summary(
    state: str, ranks: Sequence[tuple[int, str, int]], lost_s: float, stall_s: float
) -> str:
    """The sentence for a run with no non-finite value; ``ranks`` = (rank, state, step)."""
    latest = max((step for _, _, step in ranks), default=0)
    n = len(ranks)
    if state == "lost":
        lost = [r for r, s, _ in ranks if s == "lost"]
        return f"{_ranks(lost)} lost: no message for more than {lost_s:g} s (latest step {latest})."
    if state == "stalled":
        stalled = [r for r, s, _ in ranks if s == "stalled"]
        return (
            f"{_ranks(stalled)} stalled: heartbeats but no step progress for more than "
            f"{stall_s:g} s (latest step {latest})."
        )
    if state == "finished":
        plural = "s" if n != 1 else ""
        return f"Finished at step {latest} on {n} rank{plural}; no non-finite value seen."
    return (
        f"{n} rank{'s' if n != 1 else ''} running, latest step {latest}; no non-finite value seen."
    )


def phase_rank(phase: str) -> int:
    return PHASE_RANK.get(phase, len(PHASE_RANK))
