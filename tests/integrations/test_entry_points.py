"""Data made non-finite outside every module, where the model is entered.

Lightning's ``training_step`` and custom loops often never call the watched
module's ``forward``: they call a part of it (``self.net(x)``, a
transformer's embedding and then its encoder). A module called while no
module of the model runs is an entry point: what it receives was made
outside the model, so a non-finite input is ``input``/``data``, named by
that module, not a value its first layer produced.

The answer is established without nand: the loop checks, before the model
sees it, whether what it hands over is finite; or, for a fault planted
inside the model, the ground truth of :mod:`tests.integrations.truth`.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import nand
from tests.integrations.faults import Fault, Planted
from tests.integrations.loops import where
from tests.integrations.truth import Finding, Truth
from tests.integrations.zoo import case

STEPS = 6
ZERO_STD_STEP = 4  # the batch whose every value is the same: its std is 0


# --- Lightning: training_step normalises the batch, then calls self.net -------


def constant_at(step: int) -> list[torch.Tensor]:
    """Batches of 8x4; the one at ``step`` holds one value: dividing by its std gives NaN."""
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randn(8, 4, generator=gen) for _ in range(STEPS)]
    batches[step] = torch.full((8, 4), 0.5)
    return batches


def fit_normalising_module(batches: list[torch.Tensor], **options: object) -> tuple[object, list]:
    """A real ``lightning.Trainer`` fitting a module whose ``training_step``
    divides the batch by its std and calls ``self.net(x)``; returns the
    callback and, per step, whether ``x`` was finite before ``net`` ran."""
    pl = pytest.importorskip("lightning.pytorch")
    from nand.integrations.lightning import NandCallback

    finite_before_net: list[bool] = []

    class Normalising(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            x = (batch - batch.mean()) / batch.std()
            finite_before_net.append(bool(torch.isfinite(x).all()))  # the truth, no nand
            return self.net(x).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    callback = NandCallback(log_events=False, **options)
    trainer = pl.Trainer(
        max_steps=len(batches),
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(Normalising(), DataLoader(batches, batch_size=None))
    return callback, finite_before_net


def test_a_batch_divided_by_a_zero_std_in_training_step_is_data_into_net_not_made_by_net_0():
    callback, finite_before_net = fit_normalising_module(constant_at(ZERO_STD_STEP))
    bad_step = finite_before_net.index(False)  # the truth: non-finite before net ran
    assert bad_step == ZERO_STD_STEP
    first = callback.watch.first
    assert where(first) == Finding(bad_step, 0, "input", "net", "data")
    assert first.module_type == "Sequential" and "NaN" in first.message


def test_a_lightning_module_calling_its_net_on_healthy_batches_reports_nothing():
    callback, finite_before_net = fit_normalising_module(constant_at(ZERO_STD_STEP)[:ZERO_STD_STEP])
    assert all(finite_before_net)
    assert callback.watch.first is None and callback.watch.events == []
    assert callback.watch.step == ZERO_STD_STEP


# --- a custom loop calling a transformer's parts ------------------------------


def bert_in_parts(
    observer: str, steps: int, scale_at: int | None = None, fault: Fault | None = None
) -> tuple[object, list[bool]]:
    """Trains BERT by calling its parts, as a custom loop would: the embedding,
    then the encoder with the loop's own scaling in between, then the
    classifier. ``scale_at``: the step whose scale is 1/0. Returns the
    observer (a watch or the ground truth) and, per step, whether what the
    loop handed the encoder was finite."""
    zoo = case("bert")
    model = zoo.build()
    planted = Planted(fault, model)  # (before the observer: see faults.py)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    watched = nand.watch(model, opt, log_events=False) if observer == "nand" else Truth(model, opt)
    handed_finite = []
    bert = model.bert
    try:
        for step in range(steps):
            planted.arm(step)
            batch = zoo.batch(step)
            hidden = bert.embeddings(input_ids=batch["input_ids"])
            hidden = hidden * (1 / torch.tensor(0.0 if step == scale_at else 1.0))
            handed_finite.append(bool(torch.isfinite(hidden).all()))  # the truth, no nand
            encoded = bert.encoder(hidden).last_hidden_state
            logits = model.classifier(encoded[:, 0])
            nn.functional.cross_entropy(logits, batch["labels"]).backward()
            opt.step()
            opt.zero_grad()
            if isinstance(watched, Truth):
                watched.end_step()
    finally:
        watched.close()
    return watched, handed_finite


def test_a_custom_loop_calling_the_parts_of_a_healthy_model_reports_nothing():
    watch, handed_finite = bert_in_parts("nand", steps=3)
    assert all(handed_finite)
    assert watch.first is None and watch.events == [] and watch.step == 3


def test_a_value_the_loop_made_non_finite_between_two_parts_is_data_into_the_second():
    watch, handed_finite = bert_in_parts("nand", steps=3, scale_at=1)
    bad_step = handed_finite.index(False)
    assert where(watch.first) == Finding(bad_step, 0, "input", "bert.encoder", "data")
    assert watch.first.module_type == "BertEncoder"


def test_a_nan_made_inside_the_first_part_is_blamed_there_not_on_the_second_parts_input():
    fault = Fault("forward", 1, "bert.embeddings.LayerNorm")
    truth, _ = bert_in_parts("truth", steps=3, fault=fault)
    watch, handed_finite = bert_in_parts("nand", steps=3, fault=fault)
    assert handed_finite[1] is False  # the encoder got it: its input is non-finite too
    assert truth.first == Finding(1, 0, "forward", "bert.embeddings.LayerNorm", "produced")
    assert where(watch.first) == truth.first
