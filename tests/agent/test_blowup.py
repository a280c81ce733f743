"""Early warnings of a blow-up (issue 18 item 3): the rules on their own, then
real training (torch's TransformerEncoder and GPT-2 from transformers) against
ground truth computed by the loop itself, and healthy runs of the benchmark
models that must not warn."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nand
from benchmarks import shapes
from nand.agent.step.analysis import StepRow
from nand.agent.step.blowup import QUIET_STEPS, WARMUP, BlowUpWatch
from tests.integrations.zoo import case


def row(step: int, loss: float | None) -> StepRow:
    return StepRow(step=step, values=[], sites=[], norm_sites=[], loss=loss)


def feed(watch: BlowUpWatch, losses: list[float], norms: list[float] | None = None) -> list:
    found = []
    for step, loss in enumerate(losses):
        norm = norms[step] if norms else None
        found += watch.look(row(step, loss), 0, norm, clean=True)
    return found


def test_a_loss_three_times_its_recent_mean_is_a_spike_after_the_warm_up():
    watch = BlowUpWatch(rank=3)
    assert feed(watch, [1.0] * (WARMUP - 1) + [10.0]) == []  # still warming up
    watch = BlowUpWatch(rank=3)
    (alert,) = feed(watch, [1.0] * WARMUP + [1.2, 3.5])
    assert (alert.kind, alert.step, alert.rank, alert.value) == ("loss_spike", WARMUP + 1, 3, 3.5)
    assert alert.reference == pytest.approx(1.0 + 0.2 / (WARMUP + 1))


def test_a_run_of_spikes_warns_once_per_quiet_period_and_stays_out_of_the_mean():
    watch = BlowUpWatch(rank=0)
    alerts = feed(watch, [1.0] * 20 + [5.0] * 30)
    assert [a.step for a in alerts] == [20]
    assert max(watch.losses) == 1.0  # the spikes never became the baseline
    alerts = feed(BlowUpWatch(rank=0), [1.0] * 20 + [5.0] * (QUIET_STEPS + 1))
    assert [a.step for a in alerts] == [20, 20 + QUIET_STEPS]


def test_a_gradient_norm_ten_times_its_median_is_growth():
    norms = [1.0, 1.1, 0.9] * 5 + [9.0, 12.0]
    (alert,) = feed(BlowUpWatch(rank=0), [1.0] * len(norms), norms)
    assert (alert.kind, alert.step) == ("grad_growth", 16)


def test_a_step_that_went_non_finite_is_an_incident_not_a_warning():
    watch = BlowUpWatch(rank=0)
    feed(watch, [1.0] * 20)
    assert watch.look(row(20, 50.0), 0, None, clean=False) == []
    assert len(watch.losses) == 20


def alerts_of(path) -> list[dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [line["warning"] for line in lines if line["type"] == "warning"]


def test_a_planted_loss_spike_in_a_transformer_is_named_at_its_step(tmp_path):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
    model = nn.TransformerEncoder(layer, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(8, 16, 32), torch.randn(8, 16, 32)
    losses = []  # the ground truth: the loop's own losses
    with nand.watch(model, opt, events_file=str(tmp_path / "e.jsonl"), log_events=False) as w:
        for step in range(40):
            target = y * 30 if step == 30 else y  # one bad batch: labels off by 30x
            loss = F.mse_loss(model(x), target)
            w.loss(loss)
            losses.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad()
    spikes = [s for s in range(20, 40) if losses[s] > 3 * sum(losses[s - 20 : s]) / 20]
    assert spikes == [30]
    found = alerts_of(tmp_path / "e.jsonl")
    # The loss spike, and the gradient norm the bad batch blew up with it.
    assert sorted((a["kind"], a["step"]) for a in found) == [
        ("grad_growth", 30),
        ("loss_spike", 30),
    ]


def test_a_slow_learning_rate_blow_up_in_gpt2_warns_before_the_first_nan(tmp_path):
    gpt2 = case("gpt2")
    model = gpt2.build(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    first_nonfinite = None  # ground truth, from the loop's own loss
    with nand.watch(model, opt, events_file=str(tmp_path / "e.jsonl"), log_events=False) as w:
        for step in range(80):
            loss = gpt2.loss(model, gpt2.batch(step % 4))
            w.loss(loss)
            if first_nonfinite is None and not math.isfinite(loss.item()):
                first_nonfinite = step
            loss.backward()
            opt.step()
            opt.zero_grad()
            for group in opt.param_groups:
                group["lr"] *= 1.35  # a schedule gone wrong
    assert first_nonfinite is not None
    found = alerts_of(tmp_path / "e.jsonl")
    assert found, "no warning before the blow-up"
    first_warning = min(a["step"] for a in found)
    assert first_warning < first_nonfinite, (found, first_nonfinite)
    assert w.first is not None and w.first.step >= first_warning


@pytest.mark.parametrize("name", ["sequential_mlp", "custom_mlp", "transformer", "gpt", "resnet18"])
def test_healthy_training_of_the_benchmark_models_never_warns(tmp_path, name):
    model, inputs, loss_fn = getattr(shapes, name)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    steps = 60 if "mlp" in name else 25
    with nand.watch(model, opt, events_file=str(tmp_path / "e.jsonl"), log_events=False) as w:
        for _ in range(steps):
            loss = loss_fn(model(inputs()))
            w.loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert w.first is None
    path = tmp_path / "e.jsonl"
    assert not path.exists() or alerts_of(path) == []
