"""A run's failures in the order they happened: the first is the origin.

A rank can fail four ways: its values went non-finite (``diverged``), it went
silent without a bye (``lost``: killed with SIGKILL, its host gone), it left
with an exception (``crashed``), or it kept reporting without step progress
(``stalled``). One failure usually causes the others: a rank killed in the
middle of an all-reduce makes its peers raise (gloo) or wait (NCCL). The
verdict names the first one in time and the others as its consequences, so
a person is sent to the rank that was killed, not to the one that noticed.

When each happened, on the server's clock where it has one:

- ``lost``: when the server last heard from the rank (``last_seen``; its
  sender thread repeats heartbeats while training is quiet, so silence means
  the process is gone);
- ``crashed``: when its bye arrived (``finished_at``);
- ``stalled``: when its next step was due and did not come: the last step
  change plus one step at the rate it was training (``steps_per_s``);
- ``diverged``: the time the origin's agent stamped on its first non-finite
  event, no later than the server last heard from that rank (clocks drift).

These times are only as sharp as the heartbeats that carry them, so
failures less than ``tolerance`` (the agents' heartbeat period) after the
first count as simultaneous, and among those the likelier cause comes first
(:data:`PRECEDENCE`): a non-finite value (concrete evidence), then a silent
rank (a crash or a stall cannot silence another rank's sender thread, while
a vanished rank makes its peers raise or wait), then an exception, then a
stall.

>>> facts = [RankFacts(rank=0, step=5, last_seen=110.0, step_changed_at=100.0,
...                     finished_at=110.0, bye_reason="exception: RuntimeError"),
...          RankFacts(rank=1, step=5, last_seen=104.0, step_changed_at=100.0)]
>>> states = {0: "crashed", 1: "lost"}
>>> [(f.state, f.ranks) for f in ordered(facts, states, None, tolerance=1.0)]
[('lost', (1,)), ('crashed', (0,))]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from nand.events import RankState, RunState
from nand.server.analysis import correlate
from nand.server.schemas.verdict import FailureState

#: Among failures close in time, the likelier cause first (see the module doc).
PRECEDENCE: tuple[FailureState, ...] = ("diverged", "lost", "crashed", "stalled")


@dataclass(frozen=True)
class RankFacts:
    """What a rank's state and its failure time are decided from (a rank row's
    columns, read whole or by a light query for a big run)."""

    rank: int
    step: int
    last_seen: float
    step_changed_at: float
    diverged: bool = False
    finished_at: float | None = None
    bye_reason: str = ""
    steps_per_s: float | None = None
    dropped: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Failure:
    """One failure: ``ranks`` failed that way together, the first of them at ``at``."""

    state: FailureState
    ranks: tuple[int, ...]
    at: float
    step: int
    #: ``crashed``: the exception's type as the agent named it in its bye.
    detail: str = ""


@dataclass(frozen=True)
class NonFinite:
    """The run's non-finite origin: the rank(s) where it started, when and at which step."""

    ranks: tuple[int, ...]
    at: float
    step: int


def rank_state(
    facts: RankFacts, lost_after_s: float, stalled_after_s: float, now: float
) -> RankState:
    return correlate.rank_state(
        diverged=facts.diverged,
        finished=facts.finished_at is not None,
        crashed=correlate.crashed_bye(facts.bye_reason),
        last_seen=facts.last_seen,
        step_changed_at=facts.step_changed_at,
        now=now,
        lost_after_s=lost_after_s,
        stalled_after_s=stalled_after_s,
    )


def ordered(
    facts: Sequence[RankFacts],
    states: Mapping[int, RankState],
    nonfinite: NonFinite | None,
    tolerance: float,
) -> list[Failure]:
    """Every failure of the run, the origin first, then its consequences in time order."""
    found = [f for f in (_of_rank(r, states[r.rank]) for r in facts) if f is not None]
    if nonfinite is not None:
        found.append(Failure("diverged", nonfinite.ranks, nonfinite.at, nonfinite.step))
    if not found:
        return []
    found.sort(key=lambda f: (f.at, PRECEDENCE.index(f.state), f.ranks))
    window = [f for f in found if f.at <= found[0].at + tolerance]
    cause = min(window, key=lambda f: PRECEDENCE.index(f.state)).state
    origin = [f for f in window if f.state == cause]
    rest = [f for f in found if f not in origin]
    return [_merged(origin), *_grouped(rest)]


def _of_rank(facts: RankFacts, state: RankState) -> Failure | None:
    """A rank's own failure (a diverged rank's is the run's non-finite origin, or
    its relation to it: not a failure of its own here)."""
    if state == "lost":
        return Failure("lost", (facts.rank,), facts.last_seen, facts.step)
    if state == "crashed":
        exception = facts.bye_reason.removeprefix("exception:").strip()
        left = facts.finished_at or facts.last_seen
        return Failure("crashed", (facts.rank,), left, facts.step, exception)
    if state == "stalled":
        due = 1.0 / facts.steps_per_s if facts.steps_per_s and facts.steps_per_s > 0 else 0.0
        return Failure("stalled", (facts.rank,), facts.step_changed_at + due, facts.step)
    return None


def _merged(failures: Sequence[Failure]) -> Failure:
    """Failures of one state as one: every rank, the earliest time and step, the
    exception types named (each once)."""
    details = dict.fromkeys(f.detail for f in failures if f.detail)
    return Failure(
        failures[0].state,
        tuple(sorted(r for f in failures for r in f.ranks)),
        min(f.at for f in failures),
        min(f.step for f in failures),
        ", ".join(details),
    )


def _grouped(failures: Sequence[Failure]) -> list[Failure]:
    """The consequences, one per state, in order of each state's first failure."""
    by_state: dict[FailureState, list[Failure]] = {}
    for failure in failures:  # (already in time order)
        by_state.setdefault(failure.state, []).append(failure)
    return [_merged(group) for group in by_state.values()]


def run_state(failures: Sequence[Failure], states: Mapping[int, RankState]) -> RunState:
    """The origin's state; without a failure ``finished`` once every rank said bye,
    else ``healthy``."""
    if failures:
        return failures[0].state
    if states and all(s == "finished" for s in states.values()):
        return "finished"
    return "healthy"
