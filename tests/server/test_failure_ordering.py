"""A run's failures in order (``analysis.failures``): pure functions on rank facts.

The expected orders follow from the rules the module states (the first failure
in time is the origin; within one heartbeat the likelier cause comes first; a
stalled rank failed when its next step was due), worked out by hand here.
"""

from __future__ import annotations

from nand.server.analysis.failures import (
    Failure,
    NonFinite,
    RankFacts,
    ordered,
    rank_state,
    run_state,
)


def lost(rank: int, at: float, step: int = 5) -> RankFacts:
    return RankFacts(rank=rank, step=step, last_seen=at, step_changed_at=at - 50)


def crashed(rank: int, at: float, step: int = 5, exception: str = "RuntimeError") -> RankFacts:
    return RankFacts(
        rank=rank,
        step=step,
        last_seen=at,
        step_changed_at=at - 50,
        finished_at=at,
        bye_reason=f"exception: {exception}",
    )


def order(facts: list[RankFacts], states: dict[int, str], nonfinite=None, tolerance=1.0):
    return [(f.state, f.ranks) for f in ordered(facts, states, nonfinite, tolerance)]  # type: ignore[arg-type]


def test_a_crash_long_before_a_silence_is_the_origin_and_the_silence_its_consequence() -> None:
    facts = [crashed(0, at=100.0), lost(1, at=105.0)]
    assert order(facts, {0: "crashed", 1: "lost"}) == [("crashed", (0,)), ("lost", (1,))]


def test_within_a_heartbeat_the_silent_rank_comes_before_the_one_that_raised() -> None:
    # Tolerance 1 s: a silence 1 s after the crash (the limit included) is "at once".
    for late in (0.5, 1.0):
        facts = [crashed(0, at=100.0), lost(1, at=100.0 + late)]
        assert order(facts, {0: "crashed", 1: "lost"}) == [("lost", (1,)), ("crashed", (0,))]
    facts = [crashed(0, at=100.0), lost(1, at=101.01)]
    assert order(facts, {0: "crashed", 1: "lost"}) == [("crashed", (0,)), ("lost", (1,))]


def test_the_origin_is_the_likeliest_cause_in_the_window_not_the_earliest_of_it() -> None:
    # Stalled at 100, crashed at 100.3, lost at 100.6: all within 1 s of the first;
    # lost ranks above crashed above stalled, so lost is the origin, then the
    # rest by the time each state first failed.
    facts = [
        RankFacts(rank=2, step=7, last_seen=200.0, step_changed_at=99.5, steps_per_s=2.0),
        crashed(0, at=100.3),
        lost(1, at=100.6),
    ]
    states = {0: "crashed", 1: "lost", 2: "stalled"}
    assert order(facts, states) == [("lost", (1,)), ("stalled", (2,)), ("crashed", (0,))]


def test_a_non_finite_value_in_the_window_wins_over_a_silent_rank() -> None:
    facts = [lost(1, at=100.0, step=6)]
    nonfinite = NonFinite(ranks=(3,), at=100.8, step=5)
    assert ordered(facts, {1: "lost", 3: "diverged"}, nonfinite, 1.0) == [  # type: ignore[arg-type]
        Failure("diverged", (3,), 100.8, 5),
        Failure("lost", (1,), 100.0, 6),
    ]
    late = NonFinite(ranks=(3,), at=101.5, step=5)
    assert order(facts, {1: "lost", 3: "diverged"}, late) == [("lost", (1,)), ("diverged", (3,))]


def test_ranks_failing_the_same_way_are_one_failure_at_the_earliest_time_and_step() -> None:
    facts = [
        crashed(4, at=103.0, step=9, exception="RuntimeError"),
        crashed(2, at=102.0, step=8, exception="DistBackendError"),
        crashed(3, at=104.0, step=7, exception="RuntimeError"),
        lost(1, at=100.0, step=8),
    ]
    states = {1: "lost", 2: "crashed", 3: "crashed", 4: "crashed"}
    first, then = ordered(facts, states, None, tolerance=1.0)  # type: ignore[arg-type]
    assert first == Failure("lost", (1,), 100.0, 8)
    # The exceptions each named once, in time order; the earliest step of any.
    assert then == Failure("crashed", (2, 3, 4), 102.0, 7, "DistBackendError, RuntimeError")


def test_several_origins_of_one_kind_at_once_are_merged_and_the_rest_follow_in_time() -> None:
    facts = [lost(5, at=100.2, step=4), lost(1, at=100.0, step=6), crashed(0, at=130.0)]
    states = {0: "crashed", 1: "lost", 5: "lost"}
    assert ordered(facts, states, None, tolerance=1.0) == [  # type: ignore[arg-type]
        Failure("lost", (1, 5), 100.0, 4),
        Failure("crashed", (0,), 130.0, 5, "RuntimeError"),
    ]


def test_a_stalled_rank_failed_when_its_next_step_was_due() -> None:
    # 4 steps a second: due 0.25 s after its last step change.
    stalled = RankFacts(rank=0, step=3, last_seen=500.0, step_changed_at=100.0, steps_per_s=4.0)
    [failure] = ordered([stalled], {0: "stalled"}, None, tolerance=1.0)
    assert failure == Failure("stalled", (0,), 100.25, 3)
    slow = RankFacts(rank=0, step=3, last_seen=500.0, step_changed_at=100.0, steps_per_s=0.5)
    assert ordered([slow], {0: "stalled"}, None, 1.0)[0].at == 102.0  # a step every 2 s
    for rate in (None, 0.0):  # no rate known: its last step change
        unknown = RankFacts(
            rank=0, step=3, last_seen=500.0, step_changed_at=100.0, steps_per_s=rate
        )
        assert ordered([unknown], {0: "stalled"}, None, 1.0)[0].at == 100.0


def test_a_crashed_rank_without_a_bye_time_failed_when_last_heard_from() -> None:
    facts = RankFacts(
        rank=0, step=3, last_seen=77.0, step_changed_at=70.0, bye_reason="exception:   ValueError"
    )
    assert ordered([facts], {0: "crashed"}, None, 1.0) == [
        Failure("crashed", (0,), 77.0, 3, "ValueError")
    ]


def test_running_finished_and_diverged_ranks_are_no_failure_of_their_own() -> None:
    facts = [lost(r, at=100.0) for r in range(3)]
    assert ordered(facts, {0: "running", 1: "finished", 2: "diverged"}, None, 1.0) == []  # type: ignore[arg-type]


def test_the_run_is_in_its_origins_state_finished_when_every_rank_said_bye() -> None:
    origin = Failure("lost", (1,), 100.0, 5)
    assert run_state([origin, Failure("crashed", (0,), 101.0, 5)], {}) == "lost"
    assert run_state([], {0: "finished", 1: "finished"}) == "finished"
    assert run_state([], {0: "finished", 1: "running"}) == "healthy"
    assert run_state([], {}) == "healthy"


def test_a_ranks_state_reads_its_bye_and_its_silence() -> None:
    now = 1000.0
    quiet = RankFacts(rank=0, step=1, last_seen=now - 10, step_changed_at=now - 10)
    assert rank_state(quiet, lost_after_s=60, stalled_after_s=60, now=now) == "running"
    assert rank_state(quiet, lost_after_s=5, stalled_after_s=60, now=now) == "lost"
    assert rank_state(quiet, lost_after_s=60, stalled_after_s=5, now=now) == "stalled"
    said_bye = RankFacts(
        rank=0, step=1, last_seen=now, step_changed_at=now, finished_at=now, bye_reason="done"
    )
    assert rank_state(said_bye, 60, 60, now) == "finished"
    raised = RankFacts(
        rank=0,
        step=1,
        last_seen=now,
        step_changed_at=now,
        finished_at=now,
        bye_reason="exception: RuntimeError",
    )
    assert rank_state(raised, 60, 60, now) == "crashed"
    stopped = RankFacts(
        rank=0,
        step=1,
        last_seen=now,
        step_changed_at=now,
        finished_at=now,
        bye_reason="exception: StopRequested",
    )
    assert rank_state(stopped, 60, 60, now) == "finished"
    bad = RankFacts(
        rank=0,
        step=1,
        last_seen=now,
        step_changed_at=now,
        diverged=True,
        finished_at=now,
        bye_reason="exception: RuntimeError",
    )
    assert rank_state(bad, 60, 60, now) == "diverged"
