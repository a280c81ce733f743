"""One run summary (``GET /api/runs``, the event streams, ``/healthz``), built by
one function, :func:`build`, from a run's :class:`RunFacts`.

The facts come two ways: from every rank row and its first event, loaded
whole (:func:`of_rows`: a small run, or the verdict's rows), or for a run of
thousands of ranks from indexed queries of its failing ranks and origin and
the run's tally (``rankpage.run_summary``, with :class:`Seen`). Either way the
fields, the rank states, the order of the failures (:mod:`nand.server.analysis.failures`)
and the run's state are decided here, once.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from nand.events import RankState, RunState
from nand.server.analysis import correlate, failures, losses, replicas
from nand.server.analysis.failures import Failure, NonFinite, RankFacts
from nand.server.analysis.origins import RankRows, origin_out, origin_row, to_event
from nand.server.schemas.runs import RunSummary
from nand.server.settings import Settings
from nand.server.storage.models import EventRow, Rank, Run


@dataclass(frozen=True)
class RunFacts:
    """Every rank's facts, and the non-finite origin's event with the ranks at its point."""

    ranks: Sequence[RankFacts]
    head: EventRow | None = None
    together: Sequence[int] = ()


@dataclass(frozen=True)
class Seen:
    """What a big run's summary takes from its tally instead of every rank's facts
    (``rankpage.run_summary``): how many ranks, which states occur, the losses summed."""

    ranks: int
    states: Collection[RankState]
    dropped: dict[str, int]


def rank_facts(rank: Rank, diverged: bool) -> RankFacts:
    return RankFacts(
        rank=rank.rank,
        step=rank.step,
        last_seen=rank.last_seen,
        step_changed_at=rank.step_changed_at,
        diverged=diverged,
        finished_at=rank.finished_at,
        bye_reason=rank.bye_reason or "",
        steps_per_s=rank.steps_per_s,
        dropped=losses.of_rank(rank),
    )


def of_rows(ranks: RankRows) -> RunFacts:
    head = origin_row(ranks)
    together = correlate.first_ranks([to_event(e) for _, e in ranks if e is not None])
    return RunFacts([rank_facts(rank, event is not None) for rank, event in ranks], head, together)


def rank_states(facts: RunFacts, settings: Settings, now: float) -> dict[int, RankState]:
    lost_s, stalled_s = settings.lost_after_s, settings.stalled_after_s
    return {r.rank: failures.rank_state(r, lost_s, stalled_s, now) for r in facts.ranks}


def failures_of(facts: RunFacts, states: dict[int, RankState], settings: Settings) -> list[Failure]:
    """The run's failures, the origin first (see :mod:`nand.server.analysis.failures`)."""
    return failures.ordered(facts.ranks, states, nonfinite(facts), settings.heartbeat_s)


def nonfinite(facts: RunFacts) -> NonFinite | None:
    """When and where the run went non-finite: the origin event's time, no later
    than the server last heard from its rank (an agent's clock may run ahead)."""
    head = facts.head
    if head is None:
        return None
    heard = next((r.last_seen for r in facts.ranks if r.rank == head.rank), head.time)
    return NonFinite(tuple(facts.together) or (head.rank,), min(head.time, heard), head.step)


def run_state(run: Run, found: Sequence[Failure], states: dict[int, RankState]) -> RunState:
    return replicas.run_state(failures.run_state(found, states), run)


def build(
    run: Run, facts: RunFacts, settings: Settings, now: float, seen: Seen | None = None
) -> RunSummary:
    """The run's summary: every field of :class:`RunSummary` is decided here.

    ``facts``: every rank's, or with ``seen`` only the failing ranks' and the origin's."""
    settings = settings.for_world(run.world_size)
    states = rank_states(facts, settings, now)
    if seen is None:
        dropped = losses.summed(r.dropped for r in facts.ranks)
        seen = Seen(len(facts.ranks), set(states.values()), dropped)
    head = facts.head
    # (run_state reads which states occur, not which rank is in which)
    occurring = dict(enumerate(seen.states))
    return RunSummary(
        run=run.name,
        attempt=run.attempt,
        launch=run.launch,
        live=run.superseded_at is None,
        state=run_state(run, failures_of(facts, states, settings), occurring),
        world_size=max(run.world_size, seen.ranks),
        ranks_seen=seen.ranks,
        latest_step=run.latest_step,
        started_at=run.started_at,
        last_seen=run.last_seen,
        event_count=run.event_count,
        warnings=run.warning_count,
        origin=origin_out(head, [], list(facts.together)) if head is not None else None,
        messages_dropped=losses.total(seen.dropped),
        dropped=seen.dropped,
    )
