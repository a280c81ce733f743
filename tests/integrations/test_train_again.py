"""Training again in the same process after an exception ended HF ``train()``.

HF's ``Trainer`` calls no callback when ``train()`` raises, so the
``NandCallback``'s watch stays open with its hooks on the model. People then
train again in the same process (the bad batch dropped, or resumed from a
checkpoint): the new ``train()`` opens a second watch on the same model.
Before, both ran on every step and the stale one judged the new training; a
model is now watched by one watch at a time, the earlier one closed first.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from tests.integrations.loops import DEVICE
from tests.integrations.scenario import Scenario, healthy

pytest.importorskip("transformers")

STEPS = 3


class BrokenLoader(RuntimeError):
    """The user's collator failing on a batch: any exception ends ``train()``."""


def _train(s: Scenario, model: nn.Module, tmp_path: Path, fail_at: int | None) -> Any:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from nand.integrations.transformers import NandCallback

    seen: list[int] = []

    def collate(items: list[Any]) -> Any:
        if fail_at is not None and len(seen) == fail_at:
            raise BrokenLoader("a bad batch")
        seen.append(1)
        return items[0]

    class CountHooks(TrainerCallback):
        """The model root's forward hooks at each step's end (nand's, and nobody else's)."""

        def __init__(self) -> None:
            self.hooks: list[int] = []

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.hooks.append(len(model._forward_hooks) + len(model._forward_pre_hooks))

    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        max_steps=STEPS,
        per_device_train_batch_size=1,
        train_sampling_strategy="sequential",
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        remove_unused_columns=False,
        disable_tqdm=True,
        use_cpu=DEVICE.type == "cpu",
    )
    nand_callback, counter = NandCallback(run="again"), CountHooks()
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=s.dataset(STEPS),
        data_collator=collate,
        optimizers=(s.optimizer(model), None),
        callbacks=[nand_callback, counter],
    )
    with contextlib.suppress(BrokenLoader):  # (what the user's own except does)
        trainer.train()
    return nand_callback.watch, counter.hooks


def test_training_again_after_train_raised_runs_one_watch_and_closes_the_stale_one(
    tmp_path, caplog
):
    s = healthy("gpt2", steps=STEPS)
    model = s.build()
    stale, hooks_before = _train(s, model, tmp_path / "first", fail_at=2)
    assert not stale.closed and hooks_before  # a step or more, then the exception left it open
    again, hooks_after = _train(s, model, tmp_path / "second", fail_at=None)
    assert stale.closed, "the earlier watch still runs its hooks"
    assert hooks_after == [hooks_before[0]] * STEPS  # one watch's hooks, not two
    assert again.closed and again.step == STEPS and again.events == []
    assert len(model._forward_hooks) + len(model._forward_pre_hooks) == 0
    assert "never closed" in caplog.text
