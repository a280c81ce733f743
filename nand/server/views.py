"""Turn stored rows into the REST bodies of ``schemas.py``, with correlation.

Rank and run states depend on the clock (``lost``, ``stalled``), so they are
computed at read time from the rank rows and ``now``; nothing here writes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from sqlalchemy.orm import Session

from nand.events import Event, RankState, Relation, cause_of, phase_of, value_kinds
from nand.server import alerts, correlate, losses, replicas, store, summary
from nand.server.evidence import FlightEvidence, heartbeat_evidence
from nand.server.models import EventRow, Rank, Run
from nand.server.schemas import (
    AttemptInfo,
    EventOut,
    ModuleInfo,
    Origin,
    RankGap,
    RankStatus,
    RunDetail,
    RunSummary,
    StopInfo,
    Verdict,
)
from nand.server.settings import Settings
from nand.wire import json_safe

RankRows = Sequence[tuple[Rank, EventRow | None]]


def to_event(row: EventRow, run: str = "") -> Event:
    event = _event_fields(row, run)
    if "NaN" in row.kinds and event.nan is None:
        # SQLite stored the NaN min/max as NULL; the kinds kept at ingest say it was NaN.
        event.min = event.min if event.min is not None else math.nan
        event.max = event.max if event.max is not None else math.nan
    return event


def _event_fields(row: EventRow, run: str) -> Event:
    return Event(
        run=run,
        rank=row.rank,
        world_size=row.world_size,
        host=row.host,
        pid=row.pid,
        step=row.step,
        micro_step=row.micro_step,
        phase=phase_of(row.phase),
        module=row.module,
        module_type=row.module_type,
        order=row.ord,
        cause=cause_of(row.cause),
        call=row.call,
        nan=row.nan,
        posinf=row.posinf,
        neginf=row.neginf,
        min=row.min,
        max=row.max,
        max_abs=row.max_abs,
        shape=list(row.shape or []),
        dtype=row.dtype,
        time=row.time,
        seq=row.seq,
        message=row.message,
        op=row.op,
        source=row.source,
        reproduced=row.reproduced,
        replay=row.replay,
    )


def event_out(row: EventRow, run: str) -> EventOut:
    event = to_event(row, run)
    # JSON has no NaN/inf: ``values`` keeps in words what min/max said.
    return EventOut(id=row.id, values=value_kinds(event), **json_safe(event.to_dict()))


def _origin_row(ranks: RankRows) -> EventRow | None:
    firsts = [e for _, e in ranks if e is not None]
    head = correlate.origin([to_event(e) for e in firsts])
    return next((e for e in firsts if head is not None and e.rank == head.rank), None)


def origin_out(row: EventRow, ranks: RankRows, together: list[int] | None = None) -> Origin:
    """The origin; with several ranks at the same point, ``rank`` is null (none was first).
    ``together``: those ranks, when known (else found among ``ranks``)."""
    event = to_event(row)
    fields = json_safe(event.to_dict())
    shared = {name: fields[name] for name in Origin.model_fields if name in fields}
    if together is None:
        together = correlate.first_ranks([to_event(e) for _, e in ranks if e is not None])
    shared["rank"] = event.rank if len(together) <= 1 else None
    return Origin(event_id=row.id, values=value_kinds(event), ranks=together, **shared)


def rank_states(ranks: RankRows, settings: Settings, now: float) -> dict[int, RankState]:
    return {
        rank.rank: correlate.rank_state(
            diverged=event is not None,
            finished=rank.finished_at is not None,
            crashed=correlate.crashed_bye(rank.bye_reason or ""),
            last_seen=rank.last_seen,
            step_changed_at=rank.step_changed_at,
            now=now,
            lost_after_s=settings.lost_after_s,
            stalled_after_s=settings.stalled_after_s,
        )
        for rank, event in ranks
    }


def run_summary(run: Run, ranks: RankRows, settings: Settings, now: float) -> RunSummary:
    states = rank_states(ranks, settings, now)
    head = _origin_row(ranks)
    return RunSummary(
        run=run.name,
        **_attempt_fields(run),
        state=replicas.run_state(correlate.run_state(list(states.values())), run),
        world_size=max(run.world_size, len(ranks)),
        ranks_seen=len(ranks),
        latest_step=run.latest_step,
        started_at=run.started_at,
        last_seen=run.last_seen,
        event_count=run.event_count,
        warnings=run.warning_count,
        origin=origin_out(head, ranks) if head is not None else None,
        **_losses(ranks),
    )


def _losses(ranks: RankRows) -> dict[str, Any]:
    """A run's ``messages_dropped`` and ``dropped`` over its ranks."""
    dropped = losses.summed(losses.of_rank(rank) for rank, _ in ranks)
    return {"messages_dropped": losses.total(dropped), "dropped": dropped}


def _gaps(ranks: RankRows) -> dict[str, Any]:
    """A verdict's loss fields: the run's totals, which ranks have gaps, in words."""
    by_rank = losses.per_rank(rank for rank, _ in ranks)
    return {
        **_losses(ranks),
        "ranks_with_gaps": sorted(by_rank),
        "gaps_summary": losses.sentence(by_rank),
    }


def verdict(session: Session, run: Run, ranks: RankRows, settings: Settings, now: float) -> Verdict:
    states = rank_states(ranks, settings, now)
    state = replicas.run_state(correlate.run_state(list(states.values())), run)
    stop = _stop(run, ranks)
    # An earlier attempt's ranks are gone or belong to history: never stop them.
    stoppable = run.superseded_at is None and bool(live_ranks(ranks, settings, now))
    firsts = [to_event(e) for _, e in ranks if e is not None]
    head_row = _origin_row(ranks)
    if head_row is None:
        steps = [(r.rank, states[r.rank], r.step) for r, _ in ranks]
        text = replicas.sentence(run) or summary.calm_summary(
            state, steps, settings.lost_after_s, settings.stalled_after_s
        )
        return Verdict(
            replica=replicas.check(run),
            warnings=alerts.summary(session, run),
            run=run.name,
            **_attempt_fields(run),
            state=state,
            summary=text,
            stop=stop,
            stoppable=stoppable,
            **_gaps(ranks),
        )
    head = to_event(head_row)
    evidence = _evidence(session, run.id, head)
    hint = correlate.hint(head, evidence)
    relations = correlate.relations(firsts)
    world = max(run.world_size, len(ranks))
    return Verdict(
        run=run.name,
        **_attempt_fields(run),
        state=state,
        origin=origin_out(head_row, ranks),
        ranks_affected=sorted(relations),
        ranks_received=sorted(r for r, k in relations.items() if k == "received"),
        simultaneous=any(k == "simultaneous" for k in relations.values()),
        hint=hint,
        summary=summary.diverged_summary(
            firsts, world, hint, evidence, devices={r.rank: r.device for r, _ in ranks}
        ),
        since=head.time,
        replica=replicas.check(run),
        warnings=alerts.summary(session, run),
        stop=stop,
        stoppable=stoppable,
        **_gaps(ranks),
    )


def _evidence(session: Session, run_id: int, head: Event) -> FlightEvidence | None:
    """The origin rank's latest flight window, else its heartbeats' gradient norms
    (not looked up when the phase alone decides the hint)."""
    if correlate.hint(head) in ("input_data", "loss", "optimizer_update"):
        return None
    found = store.flight_evidence_row(session, run_id, head.rank)
    evidence = FlightEvidence(*found) if found else None
    if evidence is None or not (evidence.overflow or evidence.grad_rising):
        beats = heartbeat_evidence(store.recent_grad_norms(session, run_id, head.rank, head.step))
        if beats.grad_rising:
            return beats
    return evidence


#: Rank states in which a rank may still act on a stop command. A diverged rank
#: may still be training (on_nonfinite="warn"), unless it said bye.
LIVE_STATES = ("running", "stalled", "diverged")


def live_ranks(ranks: RankRows, settings: Settings, now: float) -> list[int]:
    """Ranks a stop can still reach: not gone (bye, crash) and not lost."""
    states = rank_states(ranks, settings, now)
    return sorted(
        rank.rank
        for rank, _ in ranks
        if rank.finished_at is None and states[rank.rank] in LIVE_STATES
    )


def _stop(run: Run, ranks: RankRows) -> StopInfo | None:
    if run.stop_step is None:
        return None
    # The agents do not report the step a stop took effect; their byes do: a rank
    # that stopped leaves with StopRequested at the step it reached.
    stopped = [r.step for r, _ in ranks if correlate.stopped_bye(r.bye_reason or "")]
    return StopInfo(
        step=run.stop_step,
        requested_at=run.stop_requested_at or 0.0,
        reason=run.stop_reason,
        stopped_at=min(stopped) if stopped else None,
    )


def rank_statuses(
    run: Run,
    ranks: RankRows,
    settings: Settings,
    now: float,
    with_flight: set[int],
    relations: dict[int, Relation] | None = None,
) -> list[RankStatus]:
    """``ranks`` may be a page of the run's ranks: then pass their ``relations``
    (:mod:`nand.server.rankpage`), which depend on every rank."""
    states = rank_states(ranks, settings, now)
    if relations is None:
        relations = correlate.relations([to_event(e) for _, e in ranks if e is not None])
    return [
        RankStatus(
            rank=rank.rank,
            host=rank.host,
            pid=rank.pid,
            state=states[rank.rank],
            step=rank.step,
            last_seen=rank.last_seen,
            steps_per_s=rank.steps_per_s,
            loss=rank.loss,
            grad_norm=rank.grad_norm,
            max_activation=rank.max_activation,
            amp_skipped=rank.amp_skipped,
            first_event=event_out(event, run.name) if event is not None else None,
            relation=relations.get(rank.rank),
            has_flight=rank.rank in with_flight,
            device=rank.device or "",
            bye_reason=rank.bye_reason or "",
            **_rank_losses(rank),
        )
        for rank, event in ranks
    ]


def _rank_losses(rank: Rank) -> dict[str, Any]:
    dropped = losses.of_rank(rank)
    return {"messages_dropped": losses.total(dropped), "dropped": dropped}


def run_detail(
    session: Session, run: Run, ranks: RankRows, settings: Settings, now: float
) -> RunDetail:
    summary = run_summary(run, ranks, settings, now)
    return RunDetail(
        **summary.model_dump(),
        verdict=verdict(session, run, ranks, settings, now),
        attempts=[_attempt_info(a) for a in store.attempts_of(session, run.name)],
        modules=_modules(run.modules),
        optimizer=run.optimizer,
        versions={str(k): str(v) for k, v in (run.versions or {}).items()},
        gaps=[
            RankGap(rank=rank, messages_dropped=losses.total(dropped), dropped=dropped)
            for rank, dropped in losses.per_rank(r for r, _ in ranks).items()
        ],
    )


def _attempt_fields(run: Run) -> dict[str, Any]:
    """Which attempt a summary or verdict speaks for."""
    return {"attempt": run.attempt, "launch": run.launch, "live": run.superseded_at is None}


def _attempt_info(run: Run) -> AttemptInfo:
    return AttemptInfo(
        attempt=run.attempt,
        launch=run.launch,
        started_at=run.started_at,
        last_seen=run.last_seen,
        superseded_at=run.superseded_at,
    )


def _modules(raw: object) -> list[ModuleInfo]:
    modules = []
    for entry in raw if isinstance(raw, list) else []:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            continue
        params, order = entry.get("params"), entry.get("order")
        modules.append(
            ModuleInfo(
                name=entry["name"],
                type=str(entry.get("type") or ""),
                params=params if isinstance(params, int) and not isinstance(params, bool) else 0,
                order=order if isinstance(order, int) and not isinstance(order, bool) else None,
            )
        )
    return modules
