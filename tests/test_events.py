import math

import pytest

from nand.events import VIA_TP_ALL_REDUCE, Event, value_kinds


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"nan": 3, "posinf": 0, "neginf": 0}, "NaN x3"),
        ({"nan": 0, "posinf": 1, "neginf": 2}, "+inf and -inf x2"),
        ({"min": -1.0, "max": math.inf}, "+inf"),
        ({"min": -math.inf, "max": 2.0}, "-inf"),
        ({"min": math.nan, "max": math.nan}, "NaN"),
        ({}, "a non-finite value"),
    ],
)
def test_value_kinds_says_what_the_values_were_from_counts_or_from_min_and_max(fields, words):
    assert value_kinds(Event(**fields)) == words


def test_describe_names_rank_values_phase_module_step_and_cause():
    event = Event(
        rank=3, step=47, micro_step=1, phase="forward", module="fc2", module_type="Linear"
    )
    event.max, event.shape, event.dtype = math.inf, [16, 32], "float16"
    assert event.describe() == (
        "rank 3: +inf in forward of fc2 (Linear) at step 47.1 [16x32 float16]; "
        "it was produced here from finite inputs"
    )


def test_a_received_event_says_which_collective_brought_it_in_its_log_line():
    event = Event(rank=0, step=3, phase="forward", module="mlp.fc2", cause="received", nan=2)
    assert event.describe().endswith("it was received through a collective")  # (not known)
    event.via = VIA_TP_ALL_REDUCE
    assert event.describe().endswith(f"it was received through {VIA_TP_ALL_REDUCE}")


def test_first_is_logical_not_wall_clock():
    late_clock_early_step = Event(step=4, phase="backward", time=200.0)
    early_clock_late_step = Event(step=5, phase="input", time=100.0)
    same_step_earlier_phase = Event(step=4, phase="forward", order=9, time=300.0)
    events = [early_clock_late_step, late_clock_early_step, same_step_earlier_phase]
    assert min(events, key=Event.sort_key) is same_step_earlier_phase


def test_events_round_trip_through_a_dict_and_ignore_unknown_keys():
    event = Event(run="r", rank=1, phase="grad", module="fc.weight", nan=2, shape=[3, 4])
    data = event.to_dict() | {"from_a_newer_agent": True}
    assert Event.from_dict(data) == event
