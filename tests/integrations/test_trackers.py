"""Incidents in the tracker the run already uses: W&B (offline) and TensorBoard.

The trackers' own files are read back with their own readers
(``tests.integrations.tracker_files``). The truth is the loop's: the step
whose loss the loop itself logged non-finite, the step whose loss spiked
(computed here), the planted fault's step from the plain-loop truth
(``scenario``). The incident must sit at that step, next to that loss.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import nand
from tests.integrations.scenario import Scenario, scenario
from tests.integrations.tracker_files import (
    first_nonfinite,
    tb_scalars,
    tb_texts,
    tensorboard,
    wandb_alerts,
    wandb_finished,
    wandb_history,
    wandb_summary,
)

SPIKE, POISONED, STEPS = 30, 35, 40


def spiking_loop(
    on_event: Any, log_loss: Callable[[int, float], None], read: str = "sync"
) -> nand.Watch:
    """A small transformer as a plain loop: labels off by 30x at ``SPIKE`` (a
    warning), a NaN in the input at ``POISONED`` (an incident); the loop logs
    its loss after ``optimizer.step()``, as loops do."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
    model = nn.TransformerEncoder(layer, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(8, 16, 32), torch.randn(8, 16, 32)
    options: dict[str, Any] = {"run": "tracked", "read": read, "log_events": False}
    with nand.watch(model, opt, on_event=on_event, **options) as watch:
        for step in range(STEPS):
            batch = x.clone()
            if step == POISONED:
                batch[0, 0, 0] = float("nan")
            loss = F.mse_loss(model(batch), y * 30 if step == SPIKE else y)
            watch.loss(loss)
            loss.backward()
            if step == POISONED:
                opt.zero_grad()  # (the NaN is reported; the weights stay finite)
            opt.step()
            opt.zero_grad()
            log_loss(step, loss.item())
    return watch


def spikes(losses: list[tuple[int, float]]) -> list[int]:
    """Steps whose loss is over 3x the mean of the 20 before: the truth, without nand."""
    values = [value for _, value in losses]
    return [s for s in range(20, STEPS) if values[s] > 3 * sum(values[s - 20 : s]) / 20]


@pytest.fixture
def wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """W&B offline, every file of it under ``tmp_path``; no network, no login.
    W&B reads its environment once per process setup: torn down on both sides."""
    wandb = pytest.importorskip("wandb")
    wandb.teardown()
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "WANDB_CACHE_DIR": str(tmp_path / "cache"),
        "WANDB_CONFIG_DIR": str(tmp_path / "config"),
        "WANDB_DATA_DIR": str(tmp_path / "data"),
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DISABLE_GIT": "true",
    }.items():
        monkeypatch.setenv(name, value)
    yield tmp_path
    wandb.teardown()


def test_wandb_offline_gets_alerts_summary_fields_and_rows_next_to_the_loop_s_loss(
    wandb_offline,
):
    import wandb

    from nand.integrations.wandb import to_wandb

    losses: list[tuple[int, float]] = []
    run = wandb.init(project="nand-test", dir=str(wandb_offline))
    try:

        def log_loss(step: int, loss: float) -> None:
            losses.append((step, loss))
            run.log({"loss": loss})

        spiking_loop(to_wandb(), log_loss)
    finally:
        run.finish()
    assert spikes(losses) == [SPIKE] and first_nonfinite(losses) == POISONED  # the truth
    records = wandb_finished(wandb_offline)

    alerts = wandb_alerts(records)
    errors = [(title, text) for level, title, text in alerts if level == "ERROR"]
    assert errors == [("nand: non-finite values in run tracked", errors[0][1])]
    assert f"step {POISONED}" in errors[0][1] and "input" in errors[0][1]
    warned = [title for level, title, _ in alerts if level == "WARN"]
    assert "nand: early warning (loss_spike)" in warned

    summary = wandb_summary(records)
    assert (summary["nand/state"], summary["nand/origin"], summary["nand/step"]) == (
        "diverged",
        "<root> (input) on rank 0",
        POISONED,
    )
    history = wandb_history(records)
    incident_rows = [row for row in history if row.get("nand/incident") == 1]
    (incident,) = incident_rows
    assert incident["_step"] == POISONED and first_nonfinite([(0, incident["loss"])]) == 0
    warning_steps = {row["_step"] for row in history if row.get("nand/warning") == 1}
    assert SPIKE in warning_steps
    assert len(history) == STEPS  # nand added no row of its own


@pytest.mark.parametrize("read", ["sync", "deferred"])
def test_tensorboard_gets_incident_and_warning_text_at_their_steps_next_to_the_loss(tmp_path, read):
    """Deferred (the default on CUDA), reports come a step late: at their own step all the same."""
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    from nand.integrations.tensorboard import to_tensorboard

    writer = SummaryWriter(str(tmp_path / "tb"))
    watch = spiking_loop(
        to_tensorboard(writer), lambda s, loss: writer.add_scalar("loss", loss, s), read
    )
    assert watch.deferred == (read == "deferred")
    writer.close()
    acc = tensorboard(tmp_path / "tb")
    losses = tb_scalars(acc, "loss")
    assert spikes(losses) == [SPIKE] and first_nonfinite(losses) == POISONED  # the truth
    ((step, text),) = tb_texts(acc, "nand/incident")
    assert step == POISONED and "input" in text and "<root>" in text
    assert tb_scalars(acc, "nand/incident") == [(POISONED, 1.0)]
    warnings = tb_texts(acc, "nand/warning")
    assert any(s == SPIKE and "loss" in t for s, t in warnings), warnings


# --- through the trainers' own loggers (to_tracker=True) ---------------------------

FAULT_STEP = 2
TRAIN_STEPS = 5


@pytest.fixture
def planted() -> Scenario:
    """A NaN out of a GPT-2 layer's forward at step 2, its answer from the plain loop."""
    return scenario("gpt2", "forward", step=FAULT_STEP, steps=TRAIN_STEPS)


def train_hf(s: Scenario, tmp_path: Path, report_to: str) -> Any:
    """An HF ``Trainer`` reporting to ``report_to``, with ``NandCallback(to_tracker=True)``."""
    from transformers import Trainer, TrainingArguments

    from nand.integrations.transformers import NandCallback

    model = s.build()
    faults = s.plant(model)

    class PlantedTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            faults.arm(self.state.global_step)
            return faults.loss(s.case.loss(model, faults.batch(inputs)))

    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        max_steps=TRAIN_STEPS,
        per_device_train_batch_size=1,
        train_sampling_strategy="sequential",
        use_cpu=True,
        report_to=[report_to],
        logging_strategy="steps",
        logging_steps=1,
        logging_nan_inf_filter=False,  # (HF's default logs a NaN loss as the mean before it)
        save_strategy="no",
        remove_unused_columns=False,
        disable_tqdm=True,
    )
    callback = NandCallback(to_tracker=True, log_events=False)
    PlantedTrainer(
        model=model,
        args=args,
        train_dataset=s.dataset(TRAIN_STEPS),
        data_collator=lambda items: items[0],
        optimizers=(s.optimizer(model), None),
        callbacks=[callback],
    ).train()
    assert callback.watch is not None and callback.watch.first.step == s.answer.step
    return callback


def test_hf_trainer_report_to_tensorboard_gets_the_incident_at_the_step_of_its_nan_loss(
    planted, tmp_path
):
    pytest.importorskip("transformers")
    pytest.importorskip("tensorboard")
    train_hf(planted, tmp_path, "tensorboard")
    acc = tensorboard(tmp_path / "hf")
    nan_loss_at = first_nonfinite(tb_scalars(acc, "train/loss"))  # the Trainer's own
    assert nan_loss_at == planted.answer.step + 1  # (HF logs an update's loss at the step after)
    ((step, text),) = tb_texts(acc, "nand/incident")
    assert step == nan_loss_at and planted.answer.module in text
    assert tb_scalars(acc, "nand/incident") == [(nan_loss_at, 1.0)]


def test_hf_trainer_report_to_wandb_gets_the_incident_at_the_step_of_its_nan_loss(
    planted, tmp_path, wandb_offline
):
    pytest.importorskip("transformers")
    import wandb

    try:
        train_hf(planted, tmp_path, "wandb")
    finally:
        wandb.finish()
    records = wandb_finished(wandb_offline)
    rows = [row for row in wandb_history(records) if "train/loss" in row]
    losses = [(row["train/global_step"], row["train/loss"]) for row in rows]
    nan_loss_at = first_nonfinite(losses)  # the Trainer's own
    assert nan_loss_at == planted.answer.step + 1
    (incident,) = [row for row in wandb_history(records) if row.get("nand/incident") == 1]
    assert incident["train/global_step"] == nan_loss_at  # (the charts' x axis)
    summary = wandb_summary(records)
    assert (summary["nand/state"], summary["nand/step"]) == ("diverged", planted.answer.step)
    assert planted.answer.module in summary["nand/origin"]
    assert [level for level, _, _ in wandb_alerts(records)] == ["ERROR"]


def train_lightning(s: Scenario, logger: Any, read: str = "sync") -> None:
    """A Lightning ``fit`` logging to ``logger``, with ``NandCallback(to_tracker=True)``."""
    import lightning.pytorch as pl

    from nand.integrations.lightning import NandCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = s.build()
            self.faults = s.plant(self.model)

        def on_after_batch_transfer(self, batch: dict, dataloader_idx: int) -> dict:
            self.faults.arm(self.trainer.global_step)
            return self.faults.batch(batch)

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            loss = self.faults.loss(s.case.loss(self.model, batch))
            self.log("train_loss", loss, on_step=True, on_epoch=False)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return s.optimizer(self.model)

    seen: list[Any] = []  # the user's own on_event, next to the bridges
    callback = NandCallback(to_tracker=True, log_events=False, read=read, on_event=seen.append)
    trainer = pl.Trainer(
        max_steps=TRAIN_STEPS,
        accelerator="cpu",
        devices=1,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(Module(), DataLoader(s.dataset(TRAIN_STEPS), batch_size=None))
    assert callback.watch is not None and callback.watch.first.step == s.answer.step
    assert callback.watch.deferred == (read == "deferred")
    assert [r for r in seen if isinstance(r, nand.Event)] == [callback.watch.first]


def test_lightning_tensorboard_logger_gets_the_incident_at_the_step_of_its_nan_loss(
    planted, tmp_path
):
    pytest.importorskip("lightning")
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import TensorBoardLogger

    train_lightning(planted, TensorBoardLogger(str(tmp_path / "lightning"), name="run"))
    acc = tensorboard(tmp_path / "lightning")
    nan_loss_at = first_nonfinite(tb_scalars(acc, "train_loss"))  # Lightning's own
    assert nan_loss_at == planted.answer.step
    ((step, text),) = tb_texts(acc, "nand/incident")
    assert step == nan_loss_at and planted.answer.module in text


@pytest.mark.parametrize("read", ["sync", "deferred"])
def test_lightning_wandb_logger_gets_the_incident_at_the_step_of_its_nan_loss(
    planted, wandb_offline, read
):
    """Deferred (the default on CUDA), the incident comes a step late: at its step all the same."""
    pytest.importorskip("lightning")
    import wandb
    from lightning.pytorch.loggers import WandbLogger

    try:
        logger = WandbLogger(project="nand-test", save_dir=str(wandb_offline))
        train_lightning(planted, logger, read=read)
    finally:
        wandb.finish()
    records = wandb_finished(wandb_offline)
    history = wandb_history(records)
    losses = [
        (row["trainer/global_step"], row["train_loss"]) for row in history if "train_loss" in row
    ]
    nan_loss_at = first_nonfinite(losses)  # Lightning's own
    assert nan_loss_at == planted.answer.step
    (incident,) = [row for row in history if row.get("nand/incident") == 1]
    assert incident["trainer/global_step"] == nan_loss_at  # (the charts' x axis)
    assert wandb_summary(records)["nand/state"] == "diverged"


def test_to_wandb_without_a_run_says_so_once_and_writes_nothing(caplog):
    pytest.importorskip("wandb")
    import wandb

    from nand.integrations.wandb import to_wandb

    assert wandb.run is None
    bridge = to_wandb()
    with caplog.at_level(logging.WARNING, logger="nand"):
        for step in (3, 4):
            bridge(nand.Event(run="r", step=step))
    said = [r.getMessage() for r in caplog.records if r.name == "nand"]
    assert said == ["nand: to_wandb: no W&B run (call wandb.init first); not writing to W&B"]
