"""Correlation on constructed event streams: each case of the issue, pure functions."""

from __future__ import annotations

from nand.events import VIA_FSDP_ALL_GATHER, VIA_TP_ALL_REDUCE, Event, FlightWindow
from nand.server.analysis import correlate, summary
from nand.server.analysis.evidence import FlightEvidence, flight_evidence


def ev(rank: int, step: int, phase: str, module: str = "", **kw: object) -> Event:
    return Event(run="r", rank=rank, step=step, phase=phase, module=module, **kw)  # type: ignore[arg-type]


def test_single_origin_in_forward_others_received_through_grad_all_reduce() -> None:
    firsts = [
        ev(3, 4711, "forward", "enc.layers.5.mlp.fc2", module_type="Linear", posinf=2, host="gpu7")
    ]
    firsts += [
        ev(r, 4711, "grad", "enc.layers.5.mlp.fc2.weight", nan=9) for r in (0, 1, 2, 4, 5, 6, 7)
    ]
    assert correlate.origin(firsts).rank == 3  # type: ignore[union-attr]
    rel = correlate.relations(firsts)
    assert rel[3] == "origin"
    assert {rel[r] for r in (0, 1, 2, 4, 5, 6, 7)} == {"received"}
    hint = correlate.hint(correlate.origin(firsts))
    text = summary.diverged_summary(firsts, 8, hint, devices={3: "cuda:3"})
    assert text.startswith(
        "rank 3 produced +inf x2 in enc.layers.5.mlp.fc2 (Linear) during forward at step 4711; "
        "the other 7 ranks received it through the gradient all-reduce."
    )
    assert "Only rank 3 (host gpu7) produced it: suspect its batch or its GPU." in text
    assert "the layer made +inf x2 from finite inputs" in text
    assert hint == "produced_in_layer"


def test_a_cpu_run_is_never_told_to_suspect_its_gpu() -> None:
    firsts = [ev(1, 9, "forward", "fc2", module_type="Linear", nan=1, host="box")]
    firsts += [ev(0, 9, "grad", "fc2.weight", nan=4)]
    text = summary.diverged_summary(firsts, 2, "produced_in_layer", devices={1: "cpu"})
    assert "Only rank 1 (host box) produced it: suspect its batch." in text
    assert "GPU" not in text


def test_a_tensor_parallel_lone_producer_is_not_told_to_suspect_its_batch() -> None:
    # Its tensor-parallel peers ran the same batch through their own shards.
    firsts = [ev(1, 9, "forward", "mlp.fc1", module_type="Linear", posinf=3, host="gpu1")]
    firsts += [
        ev(
            0,
            9,
            "forward",
            "mlp.fc2",
            module_type="Linear",
            posinf=3,
            cause="received",
            via=VIA_TP_ALL_REDUCE,
        )
    ]
    text = summary.diverged_summary(firsts, 2, "produced_in_layer", devices={1: "cuda:1"})
    assert "rank 0 received it through the tensor-parallel all-reduce" in text
    assert (
        "Only rank 1 (host gpu1) produced it from the batch its tensor-parallel peers ran too: "
        "suspect its shard of the weights or its GPU."
    ) in text
    assert "suspect its batch" not in text


def test_a_backward_bug_points_at_the_backward_and_the_incoming_gradient() -> None:
    firsts = [ev(1, 9, "backward", "act", module_type="BadGrad", nan=1, host="gpu1")]
    firsts += [ev(0, 9, "grad", "fc.weight", nan=4)]
    hint = correlate.hint(correlate.origin(firsts))
    text = summary.diverged_summary(firsts, 2, hint, devices={1: "cuda:1"})
    assert "Only rank 1 (host gpu1) produced it." in text and "GPU" not in text
    assert "from a finite incoming gradient (the gradient arriving at its output)" in text
    assert "made NaN" in text


def test_all_ranks_same_step_and_layer_is_simultaneous_not_one_gpu() -> None:
    firsts = [ev(r, 12, "forward", "attn.softmax", module_type="Softmax", nan=1) for r in range(8)]
    rel = correlate.relations(firsts)
    assert set(rel.values()) == {"simultaneous"}  # none was first, rank 0 included
    assert correlate.first_ranks(firsts) == list(range(8))
    text = summary.diverged_summary(firsts, 8, "produced_in_layer")
    assert text.startswith("all 8 ranks went non-finite at the same point")
    assert "not one faulty GPU" in text
    assert "suspect its data" not in text


def test_same_step_but_other_layer_is_not_simultaneous() -> None:
    firsts = [ev(0, 12, "forward", "fc1", order=1), ev(1, 12, "forward", "fc2", order=2)]
    assert correlate.relations(firsts)[1] == "produced"


def test_bad_data_on_one_rank_points_at_its_input() -> None:
    firsts = [ev(5, 90, "input", "", cause="data", nan=3)]
    firsts += [ev(r, 90, "grad", "fc1.weight", nan=1) for r in range(8) if r != 5]
    head = correlate.origin(firsts)
    assert head is not None and head.rank == 5
    assert correlate.hint(head) == "input_data"
    text = summary.diverged_summary(firsts, 8, "input_data")
    assert text.startswith("rank 5 got NaN x3 in its input data at step 90")
    assert "check the data pipeline" in text


def test_fsdp_bad_shard_arrives_in_next_step_forward_on_every_rank() -> None:
    shard = {"posinf": 1, "shape": [64, 32], "max_abs": 0.2, "dtype": "float32", "host": "n2"}
    firsts = [ev(2, 30, "param", "layers.1.weight", module_type="Linear", **shard)]
    received = {"cause": "received", "via": VIA_FSDP_ALL_GATHER}  # (what an FSDP agent says)
    firsts += [
        ev(r, 31, "forward", "layers.1", module_type="Linear", nan=4, **received) for r in (0, 1, 3)
    ]
    rel = correlate.relations(firsts)
    assert rel == {2: "origin", 0: "received", 1: "received", 3: "received"}
    hint = correlate.hint(correlate.origin(firsts))
    assert hint == "param_written"  # one element, the rest small: not the learning rate
    text = summary.diverged_summary(firsts, 4, hint, devices={2: "cpu"})
    assert "the other 3 ranks received it through FSDP's parameter all-gather" in text
    assert "learning rate" not in text and "GPU" not in text
    assert "Only rank 2 (host n2) produced it: suspect code that writes its weights." in text
    assert "no update made +inf there" in text


def test_a_received_forward_without_a_named_collective_names_none_it_cannot_know() -> None:
    # An older agent, or one that could not tell: the verdict must not invent
    # "FSDP's all-gather" (a tensor-parallel job has none).
    firsts = [ev(1, 30, "param", "fc1.weight", posinf=1)]
    firsts += [ev(0, 31, "forward", "fc2", nan=4)]
    text = summary.diverged_summary(firsts, 2, "")
    assert "rank 0 received it through a collective of the next step's forward" in text


def test_forward_in_the_same_step_on_another_rank_is_produced_there() -> None:
    firsts = [ev(0, 30, "forward", "fc1", order=0), ev(1, 30, "forward", "fc3", order=5)]
    assert correlate.relations(firsts)[1] == "produced"


def test_agent_cause_received_is_trusted() -> None:
    firsts = [ev(0, 5, "forward", "fc1"), ev(1, 6, "backward", "fc1", cause="received")]
    assert correlate.relations(firsts)[1] == "received"


def test_a_parameter_received_at_the_update_that_made_it_elsewhere_is_not_simultaneous() -> None:
    # ZeRO: rank 1's shard update made fc.weight inf; its broadcast landed it in
    # rank 0's copy at the same update (same step, phase and parameter).
    firsts = [ev(0, 2, "param", "fc.weight", cause="received"), ev(1, 2, "param", "fc.weight")]
    assert correlate.origin(firsts).rank == 1  # type: ignore[union-attr]
    assert correlate.relations(firsts) == {0: "received", 1: "origin"}
    assert correlate.first_ranks(firsts) == [1]
    text = summary.diverged_summary(firsts, 2, "optimizer_update")
    assert text.startswith("rank 1 produced") and "rank 0 received it" in text


def test_every_zero_rank_making_its_own_shard_non_finite_at_one_update_is_simultaneous() -> None:
    firsts = [ev(0, 2, "param", "fc2.weight", order=2), ev(1, 2, "param", "fc1.weight")]
    assert correlate.relations(firsts) == {0: "simultaneous", 1: "simultaneous"}
    assert correlate.first_ranks(firsts) == [0, 1]


def test_loss_went_non_finite() -> None:
    firsts = [ev(0, 7, "loss", "", nan=1), ev(1, 7, "grad", "fc.weight", nan=1)]
    assert correlate.hint(correlate.origin(firsts)) == "loss"
    text = summary.diverged_summary(firsts, 2, "loss")
    assert "in the loss gradient at step 7" in text
    assert "the loss made NaN while the model's outputs were finite" in text


def test_learning_rate_explosion_shows_in_param_phase_as_optimizer_update() -> None:
    firsts = [ev(r, 100, "param", "fc.weight", posinf=5) for r in range(4)]
    assert correlate.hint(correlate.origin(firsts)) == "optimizer_update"
    assert set(correlate.relations(firsts).values()) == {"simultaneous"}


def test_overflow_from_a_flight_window_growing_towards_the_dtype_limit() -> None:
    window = FlightWindow(
        steps=[1, 2, 3, 4],
        modules=["fc1", "fc2"],
        act_max_abs=[[1.0, 2.0], [50.0, 80.0], [900.0, 3000.0], [8000.0, None]],
        grad_max_abs=[],
        dtype="float16",
        dtype_max=65504.0,
    ).to_dict()
    evidence = flight_evidence(window)
    assert evidence.overflow and not evidence.grad_rising
    assert "float16 limit 65504" in evidence.text
    assert correlate.hint(ev(0, 4, "forward", "fc2"), evidence) == "overflow"


def test_no_overflow_far_below_the_limit_or_when_not_growing() -> None:
    calm = FlightWindow(steps=[1, 2], modules=["a"], act_max_abs=[[1.0], [1.5]], dtype_max=65504.0)
    assert not flight_evidence(calm.to_dict()).overflow
    flat = FlightWindow(steps=[1, 2], modules=["a"], act_max_abs=[[9e3], [8e3]], dtype_max=65504.0)
    assert not flight_evidence(flat.to_dict()).overflow


def test_overflow_from_a_runaway_growth_far_below_a_float32_limit() -> None:
    runaway = FlightWindow(
        steps=[1, 2, 3], modules=["fc2"], act_max_abs=[[2.0], [3e8], [1.9e17]], dtype_max=3.4e38
    )
    assert flight_evidence(runaway.to_dict()).overflow
    growing = FlightWindow(
        steps=[1, 2], modules=["a"], act_max_abs=[[2.0], [2e3]], dtype_max=3.4e38
    )
    assert not flight_evidence(
        growing.to_dict()
    ).overflow  # a thousandfold is training, not runaway


def test_a_sampled_window_is_judged_layer_by_layer_not_row_by_row() -> None:
    """The light mode's rows are a rotating sample: a layer whose values are
    large all along, first sampled after a row of small ones, is no runaway;
    a layer whose own samples climb a millionfold is."""
    steady = FlightWindow(
        steps=[1, 2, 3, 4],
        modules=["", "embed", "fc2"],
        act_max_abs=[[1.0, None, None], [1.2, 3e6, None], [1.1, None, 0.5], [1.3, 3.1e6, None]],
        dtype="float32",
        dtype_max=3.4e38,
    )
    assert not flight_evidence(steady.to_dict()).overflow
    running = FlightWindow(
        steps=[1, 2, 3, 4],
        modules=["", "embed", "fc2"],
        act_max_abs=[[1.0, None, 0.5], [1.2, 3.0, None], [1.1, None, 5e4], [1.3, 3.1, 2e12]],
        dtype="float32",
        dtype_max=3.4e38,
    )
    evidence = flight_evidence(running.to_dict())
    assert evidence.overflow
    assert "rose from 0.5 to 2e+12 (float32 limit 3.4e+38) over steps 1-4" in evidence.text


def test_gradient_explosion_from_a_rising_grad_norm() -> None:
    window = FlightWindow(steps=[1, 2, 3, 4, 5], grad_norm=[1.0, 3.0, 20.0, 150.0, None])
    evidence = flight_evidence(window.to_dict())
    assert evidence.grad_rising
    assert correlate.hint(ev(0, 5, "backward", "fc"), evidence) == "gradient_explosion"
    noisy = FlightWindow(steps=[1, 2, 3, 4], grad_norm=[1.0, 0.5, 1.2, 0.8])
    assert not flight_evidence(noisy.to_dict()).grad_rising


def test_phase_evidence_wins_over_the_flight_window() -> None:
    evidence = FlightEvidence(overflow=True, grad_rising=True, text="x")
    assert correlate.hint(ev(0, 1, "input", cause="data"), evidence) == "input_data"


def test_malformed_flight_windows_give_no_evidence_and_no_error() -> None:
    for window in (
        {},
        {"steps": "x", "act_max_abs": [1, "a"], "dtype_max": "big"},
        {"grad_norm": [None, None], "act_max_abs": [[None]], "dtype_max": -1},
    ):
        assert flight_evidence(window) == FlightEvidence()


def test_rank_states_in_priority_order() -> None:
    base = dict(
        last_seen=100.0, step_changed_at=100.0, now=101.0, lost_after_s=60, stalled_after_s=300
    )
    assert correlate.rank_state(diverged=True, finished=True, **base) == "diverged"  # type: ignore[arg-type]
    assert correlate.rank_state(diverged=False, finished=True, **base) == "finished"  # type: ignore[arg-type]
    assert correlate.rank_state(diverged=False, finished=False, **base) == "running"  # type: ignore[arg-type]
    assert (
        correlate.rank_state(**{**base, "now": 200.0}, diverged=False, finished=False) == "lost"  # type: ignore[arg-type]
    )
    stalled = {**base, "last_seen": 500.0, "now": 501.0}
    assert correlate.rank_state(**stalled, diverged=False, finished=False) == "stalled"  # type: ignore[arg-type]


def test_calm_summaries_say_finished_or_running() -> None:
    assert summary.calm_summary("finished", [9, 8]).startswith("Finished at step 9 on 2 ranks")
    assert summary.calm_summary("healthy", [3]).startswith("1 rank running, latest step 3")


def test_no_origin_gives_no_hint() -> None:
    assert correlate.hint(None) == ""


def test_bad_input_is_input_data_by_its_phase_or_by_the_agents_cause_alone() -> None:
    # An entry point's input (phase input, no cause given) and a forward the agent
    # traced to the data (cause data) are both the data's fault, not a layer's.
    assert correlate.hint(ev(0, 3, "input", "")) == "input_data"
    assert correlate.hint(ev(0, 3, "forward", "embed", cause="data")) == "input_data"
    assert correlate.hint(ev(0, 3, "forward", "embed")) == "produced_in_layer"


def test_an_optimizer_state_going_non_finite_is_the_optimizer_update() -> None:
    assert correlate.hint(ev(0, 3, "optimizer_state", "fc.weight", nan=2)) == "optimizer_update"


def test_a_rank_is_lost_or_stalled_only_after_more_than_the_limit() -> None:
    at_limit = dict(
        last_seen=100.0,
        step_changed_at=100.0,
        now=160.0,
        diverged=False,
        finished=False,
        lost_after_s=60.0,
        stalled_after_s=60.0,
    )
    assert correlate.rank_state(**at_limit) == "running"  # type: ignore[arg-type]
    assert correlate.rank_state(**{**at_limit, "now": 160.5}) == "lost"  # type: ignore[arg-type]
    progressing = {**at_limit, "last_seen": 160.0, "stalled_after_s": 60.0}
    assert correlate.rank_state(**progressing) == "running"  # type: ignore[arg-type]
    assert correlate.rank_state(**{**progressing, "now": 160.5, "last_seen": 160.5}) == "stalled"  # type: ignore[arg-type]


def test_only_the_origins_own_steps_gradient_came_through_its_all_reduce() -> None:
    origin_event = ev(0, 5, "forward", "fc2", order=3)
    # Same step, after it: the all-reduce of that step's gradients brought it.
    assert correlate.relation(ev(1, 5, "grad", "fc1.weight"), origin_event) == "received"
    # A later step's gradient: that rank made it (the origin's went out at step 5).
    assert correlate.relation(ev(1, 6, "grad", "fc1.weight"), origin_event) == "produced"
    # Neither before nor after the origin: the same point, another parameter.
    head = ev(0, 5, "grad", "fc1.weight")
    assert correlate.relation(ev(1, 5, "grad", "fc2.weight"), head) == "produced"


def test_a_later_backward_or_loss_on_another_rank_is_its_own() -> None:
    origin_event = ev(0, 5, "forward", "fc2")
    for phase in ("backward", "loss", "input", "param"):
        assert correlate.relation(ev(1, 7, phase, "fc1"), origin_event) == "produced", phase


def test_a_run_without_a_first_event_has_no_origin_relations_or_first_ranks() -> None:
    assert correlate.origin([]) is None
    assert correlate.relations([]) == {}
    assert correlate.first_ranks([]) == []


def test_a_parameter_is_said_written_only_when_few_elements_went_and_the_rest_stayed_small() -> (
    None
):
    fp16_limit = 65504.0
    few = dict(phase="param", posinf=1, shape=[64, 64], dtype="float16")
    assert correlate.written_not_updated(Event(**few, max_abs=0.3))  # type: ignore[arg-type]
    # The rest at a tenth of the limit (OVERFLOW_SHARE) or above: an update could overflow it.
    assert not correlate.written_not_updated(Event(**few, max_abs=0.1 * fp16_limit))  # type: ignore[arg-type]
    # Every element non-finite, small or not: nothing says it was written.
    every = dict(phase="param", posinf=4096, shape=[64, 64], max_abs=0.3, dtype="float16")
    assert not correlate.written_not_updated(Event(**every))  # type: ignore[arg-type]
    # A dtype with no known limit: no evidence either way.
    assert not correlate.written_not_updated(Event(**{**few, "dtype": "mystery"}, max_abs=0.3))  # type: ignore[arg-type]
