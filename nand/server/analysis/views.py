"""Turn stored rows into the REST bodies of ``nand.server.schemas``, with correlation.

Rank and run states depend on the clock (``lost``, ``stalled``), so they are
computed at read time from the rank rows and ``now``; nothing here writes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import Session

from nand.events import Event, RankState, Relation
from nand.server.analysis import alerts, correlate, losses, replicas, runsummary, summary
from nand.server.analysis.evidence import FlightEvidence, heartbeat_evidence
from nand.server.analysis.failures import Failure
from nand.server.analysis.origins import RankRows, event_out, origin_out, to_event
from nand.server.schemas.ranks import RankStatus
from nand.server.schemas.runs import AttemptInfo, ModuleInfo, RankGap, RunDetail, RunSummary
from nand.server.schemas.verdict import FailureOut, StopInfo, Verdict
from nand.server.settings import Settings
from nand.server.storage import store
from nand.server.storage.models import Rank, Run


def rank_states(ranks: RankRows, settings: Settings, now: float) -> dict[int, RankState]:
    facts = runsummary.RunFacts([runsummary.rank_facts(r, e is not None) for r, e in ranks])
    return runsummary.rank_states(facts, settings, now)


def run_summary(run: Run, ranks: RankRows, settings: Settings, now: float) -> RunSummary:
    """The run's summary (``runsummary.build``) from its rank rows."""
    return runsummary.build(run, runsummary.of_rows(ranks), settings, now)


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
    settings = settings.for_world(run.world_size)
    facts = runsummary.of_rows(ranks)
    states = runsummary.rank_states(facts, settings, now)
    found = runsummary.failures_of(facts, states, settings)
    state = runsummary.run_state(run, found, states)
    # An earlier attempt's ranks are gone or belong to history: never stop them.
    stoppable = run.superseded_at is None and bool(_live(ranks, states))
    common: dict[str, Any] = {
        "run": run.name,
        **attempt_fields(run),
        "state": state,
        "failures": [failure_out(f) for f in found],
        "stop": _stop(run, ranks),
        "stoppable": stoppable,
        "replica": replicas.check(run),
        "warnings": alerts.summary(session, run),
        **_gaps(ranks),
    }
    head_row = facts.head
    if head_row is None:
        text = joined(replica_text(run, state), failures_text(found, settings, ""))
        calm = summary.calm_summary(state, [r.step for r, _ in ranks])
        return Verdict(**common, summary=text or calm)
    head = to_event(head_row)
    found_evidence = origin_evidence(session, run.id, head)
    hint = correlate.hint(head, found_evidence)
    firsts = [to_event(e) for _, e in ranks if e is not None]
    relations = correlate.relations(firsts)
    world = max(run.world_size, len(ranks))
    devices = {r.rank: r.device for r, _ in ranks}
    nonfinite = summary.diverged_summary(firsts, world, hint, found_evidence, devices=devices)
    return Verdict(
        **common,
        origin=origin_out(head_row, ranks),
        ranks_affected=sorted(relations),
        ranks_received=sorted(r for r, k in relations.items() if k == "received"),
        simultaneous=any(k == "simultaneous" for k in relations.values()),
        hint=hint,
        summary=joined(replica_text(run, state), failures_text(found, settings, nonfinite)),
        since=head.time,
    )


def failures_text(found: list[Failure], settings: Settings, nonfinite: str) -> str:
    return summary.failures_summary(
        found, nonfinite, settings.lost_after_s, settings.stalled_after_s
    )


def replica_text(run: Run, state: str) -> str:
    """The replica mismatch in words, when it is what the run's state says."""
    return replicas.sentence(run) if state == "replica_mismatch" else ""


def joined(*sentences: str) -> str:
    return " ".join(s for s in sentences if s)


def failure_out(failure: Failure) -> FailureOut:
    return FailureOut(
        state=failure.state,
        ranks=list(failure.ranks),
        at=failure.at,
        step=failure.step,
        exception=failure.detail,
    )


def origin_evidence(session: Session, run_id: int, head: Event) -> FlightEvidence | None:
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
    return _live(ranks, rank_states(ranks, settings, now))


def _live(ranks: RankRows, states: dict[int, RankState]) -> list[int]:
    return sorted(
        rank.rank
        for rank, _ in ranks
        if rank.finished_at is None and states[rank.rank] in LIVE_STATES
    )


def _stop(run: Run, ranks: RankRows) -> StopInfo | None:
    return stop_info(run, [r.step for r, _ in ranks if correlate.stopped_bye(r.bye_reason or "")])


def stop_info(run: Run, stopped: list[int]) -> StopInfo | None:
    """The run's stop; ``stopped``: the steps of the ranks that left by it."""
    if run.stop_step is None:
        return None
    # The agents do not report the step a stop took effect; their byes do: a rank
    # that stopped leaves with StopRequested at the step it reached.
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
    relations_of: Callable[[list[Event]], dict[int, Relation]] = correlate.relations,
) -> list[RankStatus]:
    """``ranks`` may be a page of the run's ranks: then pass ``relations_of``, their
    relations (:mod:`nand.server.analysis.rankpage`), which depend on every rank."""
    states = rank_states(ranks, settings, now)
    # (each first event made once: the relations and the body both need it)
    firsts = {rank.rank: to_event(e, run.name) for rank, e in ranks if e is not None}
    relations = relations_of(list(firsts.values()))
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
            first_event=event_out(event, run.name, firsts[rank.rank]) if event else None,
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
    found = verdict(session, run, ranks, settings, now)
    return detail_of(session, run, summary, found, losses.per_rank(r for r, _ in ranks))


def detail_of(
    session: Session,
    run: Run,
    summary: RunSummary,
    found: Verdict,
    gaps: dict[int, dict[str, int]],
) -> RunDetail:
    """The run's detail from its summary, verdict and losses by rank."""
    return RunDetail(
        **summary.model_dump(),
        verdict=found,
        attempts=[_attempt_info(a) for a in store.attempts_of(session, run.name)],
        modules=_modules(run.modules),
        optimizer=run.optimizer,
        versions={str(k): str(v) for k, v in (run.versions or {}).items()},
        gaps=[
            RankGap(rank=rank, messages_dropped=losses.total(dropped), dropped=dropped)
            for rank, dropped in gaps.items()
        ],
    )


def attempt_fields(run: Run) -> dict[str, Any]:
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
