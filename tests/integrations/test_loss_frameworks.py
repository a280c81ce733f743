"""The NaN in the loss under the frameworks: Lightning's ``training_step`` and the HF ``Trainer``.

Supervised fine-tuning of a small GPT-2 (built from a config) with the
prompt masked out: in one batch truncation leaves no answer token, every
label is -100, and the loss is 0/0 = NaN while every gradient is 0. Lightning
computes the loss in the user's ``training_step`` (a cross-entropy of the
logits); the HF ``Trainer`` has the model compute it (``labels=``). nand is
attached by each framework's callback, and no ``watch.loss`` is called: the
loss is seen where the backward starts. The ground truth is found without
nand, in the same framework: the first step whose loss is non-finite, its
gradients, and the first op that made a non-finite value from finite inputs
with the innermost line outside torch (:class:`FirstOp`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

import nand
from tests.first_op import FirstOp
from tests.integrations.zoo import VOCAB, case

pytest.importorskip("transformers")
pytest.importorskip("lightning")

STEPS, BAD = 3, 1


class Dataset(torch.utils.data.Dataset):
    """GPT-2's batches; at BAD every label is -100 (no answer token left)."""

    def __len__(self) -> int:
        return STEPS

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        batch = case("gpt2").batch(index)
        labels = batch["input_ids"].clone()
        labels[:, : labels.shape[1] // 2] = -100  # the prompt
        if index == BAD:
            labels[:] = -100
        return {"input_ids": batch["input_ids"], "labels": labels}


def sft_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)


# --- Lightning ----------------------------------------------------------------


def lightning_run(with_nand: bool, **options: Any) -> tuple[Any, list[tuple[str, str] | None]]:
    """Trains; returns nand's callback (or None) and, without nand, the truth
    of each step (the first op that made its loss non-finite, or None)."""
    import lightning.pytorch as pl

    from nand.integrations.lightning import NandCallback

    seen: list[tuple[str, str] | None] = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = case("gpt2").build()

        def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
            if with_nand:
                return sft_loss(self.model, batch)
            with FirstOp() as first:
                loss = sft_loss(self.model, batch)
            seen.append(first.found)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01, weight_decay=0.1)

    callback = NandCallback(**options) if with_nand else None
    trainer = pl.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback] if callback is not None else [],
    )
    with contextlib.suppress(nand.NonFiniteError):  # (raise: the test looks at the watch)
        trainer.fit(Module(), DataLoader(Dataset(), batch_size=None))
    return callback, seen


@pytest.mark.parametrize("mode", ["light", "full"])
def test_lightning_a_nan_loss_of_training_step_is_named_with_its_op_and_line(mode):
    _, seen = lightning_run(False)
    assert [found is not None for found in seen] == [i == BAD for i in range(STEPS)]
    op, line = seen[BAD]
    assert line.endswith(f"{Path(__file__).name}:{_line_of('return F.cross_entropy')}")
    callback, _ = lightning_run(True, mode=mode)
    event = callback.watch.first
    assert event is not None
    assert (event.step, event.phase, event.module) == (BAD, "loss", "")
    assert (event.op, event.source, event.reproduced) == (op, line, True)


def test_lightning_raise_stops_fit_before_the_update_of_a_nan_loss_with_zero_gradients():
    callback, _ = lightning_run(True, on_nonfinite="raise")
    event = callback.watch.first
    assert event is not None and (event.step, event.phase) == (BAD, "loss")
    assert callback.watch.step == BAD  # the bad step's update was not counted: it did not run


def _line_of(text: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


# --- HF Trainer ---------------------------------------------------------------


def hf_run(tmp_path: Path, with_nand: bool, **options: Any) -> tuple[Any, list, list[bool]]:
    """Trains with the model computing its loss (``labels=``); returns nand's
    callback, and without nand the truth per step: the first op that made
    the loss non-finite, and whether every gradient was 0 before the update."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from nand.integrations.transformers import NandCallback

    seen: list[tuple[str, str] | None] = []
    zero: list[bool] = []

    class TruthTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            with FirstOp() as first:
                loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            seen.append(first.found)
            return loss

    class Gradients(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            zero.append(all(bool((p.grad == 0).all()) for p in model.parameters()))

    model = case("gpt2").build()
    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        max_steps=STEPS,
        per_device_train_batch_size=1,
        train_sampling_strategy="sequential",
        lr_scheduler_type="constant",
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        learning_rate=0.01,
        weight_decay=0.1,
    )
    callback = NandCallback(**options) if with_nand else None
    trainer = (Trainer if with_nand else TruthTrainer)(
        model=model,
        args=args,
        train_dataset=Dataset(),
        data_collator=lambda items: items[0],
        callbacks=[callback] if callback is not None else [Gradients()],
    )
    try:
        trainer.train()
    except nand.NonFiniteError:
        callback.watch.close("exception: NonFiniteError")
    return callback, seen, zero


@pytest.mark.parametrize("mode", ["light", "full"])
def test_hf_trainer_a_nan_loss_the_model_computed_is_named_with_its_op_and_line(mode, tmp_path):
    _, seen, zero = hf_run(tmp_path, False)
    assert [found is not None for found in seen] == [i == BAD for i in range(STEPS)]
    assert zero[BAD]  # nothing but the loss shows it
    op, line = seen[BAD]
    callback, _, _ = hf_run(tmp_path, True, mode=mode)
    event = callback.watch.first
    assert event is not None
    assert (event.step, event.phase, event.module) == (BAD, "loss", "")
    assert (event.op, event.source, event.reproduced) == (op, line, True)


def test_hf_trainer_raise_stops_train_before_the_update_of_a_nan_loss(tmp_path):
    callback, _, _ = hf_run(tmp_path, True, on_nonfinite="raise")
    event = callback.watch.first
    assert event is not None and (event.step, event.phase) == (BAD, "loss")
    assert callback.watch.step == BAD
