"""nand through the frameworks people train with: Lightning, HF ``Trainer``, accelerate.

Each framework runs a :class:`~tests.integrations.scenario.Scenario` the way
its users write it (a ``LightningModule`` holding the model, a ``Trainer``
with a ``compute_loss``, accelerate's ``prepare``), with nand attached the
way the README says (the callbacks, or ``nand.watch`` on what ``prepare``
returned). The answer is the ground truth's in the plain loop: the framework
must not move it. Each framework is checked healthy (nothing reported,
``step`` counted as the framework counts it), with every fault kind, with
``raise`` (out of ``fit``/``train`` before the update: the weights stay
finite) and with ``stop`` (the framework's loop ends, the bad update skipped).
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import nand
from tests.integrations.faults import KINDS
from tests.integrations.loops import DEVICE, FP16_SCALER_NOT_PASSED, on_device, where
from tests.integrations.scenario import Scenario, healthy, scenario
from tests.integrations.truth import Finding

pytest.importorskip("transformers")
pytest.importorskip("lightning")
pytest.importorskip("accelerate")

MODEL = "gpt2"
STEPS = 4
ON_CPU = DEVICE.type == "cpu"  # else NAND_TEST_DEVICE=cuda: each framework trains on the GPU


@dataclasses.dataclass
class Trained:
    """What a framework run left: nand's watch, the framework's step count, the weights."""

    watch: nand.Watch | None
    steps: int
    model: nn.Module
    raised: nand.NonFiniteError | None  # what came out of fit/train/the loop, if anything
    prefix: str = ""  # what the framework's module adds in front of the model's names
    logged: dict[str, float] = dataclasses.field(default_factory=dict)  # (Lightning's metrics)

    def said(self) -> Finding | None:
        """nand's first event in the plain model's names."""
        found = where(self.watch.first) if self.watch is not None else None
        if found is None or not self.prefix:
            return found
        return found._replace(module=found.module.removeprefix(self.prefix))

    def weights_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.model.parameters())


# --- Lightning --------------------------------------------------------------


def run_lightning(s: Scenario, steps: int, fp16: bool = False, **options: Any) -> Trained:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins import MixedPrecision

    from nand.integrations.lightning import NandCallback

    class Module(pl.LightningModule):
        """As users write one: the model an attribute, the loss in training_step, logged."""

        def __init__(self) -> None:
            super().__init__()
            self.model = s.build()
            self.planted = s.plant(self.model)

        def on_after_batch_transfer(self, batch: dict, dataloader_idx: int) -> dict:
            # Bad data arrives with the batch, before training_step sees it.
            self.planted.arm(self.trainer.global_step)
            return self.planted.batch(batch)

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            loss = self.planted.loss(s.case.loss(self.model, batch))
            self.log("train_loss", loss)
            self.log("batches", 1.0, on_step=False, on_epoch=True, reduce_fx="sum")
            return loss

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            self.planted.before_update(optimizer, self.trainer.global_step)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return s.optimizer(self.model)

    callback = NandCallback(**options)
    module = Module()
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu" if ON_CPU else "gpu",
        devices=1,
        # Lightning's precision="16-mixed" is for GPUs; on CPU its plugin is named.
        plugins=[MixedPrecision("16-mixed", DEVICE.type)] if fp16 else None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    raised = None
    try:
        trainer.fit(module, DataLoader(s.dataset(steps), batch_size=None))
    except nand.NonFiniteError as exc:
        raised = exc
    logged = {name: float(value) for name, value in trainer.callback_metrics.items()}
    return Trained(callback.watch, trainer.global_step, module.model, raised, "model.", logged)


# --- HF Trainer ---------------------------------------------------------------


def run_hf_trainer(
    s: Scenario, steps: int, tmp_path: Path, fp16: bool = False, close: bool = True, **options: Any
) -> Trained:
    """``close``: close the watch after a raise, as the callback cannot (HF has no
    exception hook): a watch left open keeps its hooks and nand's GradScaler wrap."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from nand.integrations.transformers import NandCallback

    model = s.build()
    planted = s.plant(model)

    class PlantedTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            planted.arm(self.state.global_step)
            return planted.loss(s.case.loss(model, planted.batch(inputs)))

    class BeforeUpdate(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            planted.before_update(optimizer, state.global_step)

    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        max_steps=steps,
        per_device_train_batch_size=1,  # one item of the dataset: one whole batch
        train_sampling_strategy="sequential",  # the plain loop's order
        lr_scheduler_type="constant",
        fp16=fp16,
        use_cpu=ON_CPU,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        remove_unused_columns=False,
        disable_tqdm=True,
    )
    callback = NandCallback(**options)
    trainer = PlantedTrainer(
        model=model,
        args=args,
        train_dataset=s.dataset(steps),
        data_collator=lambda items: items[0],
        optimizers=(s.optimizer(model), None),
        callbacks=[BeforeUpdate(), callback],
    )
    raised = None
    try:
        trainer.train()
    except nand.NonFiniteError as exc:
        raised = exc
        if close and callback.watch is not None:
            callback.watch.close("exception: NonFiniteError")
    return Trained(callback.watch, trainer.state.global_step, model, raised)


# --- accelerate ----------------------------------------------------------------


def run_accelerate(s: Scenario, steps: int, fp16: bool = False, **options: Any) -> Trained:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    # accelerate keeps one process-wide state: a run of another precision in
    # this process (a test before this one) must not be taken for this run's.
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=ON_CPU, mixed_precision="fp16" if fp16 else "no")
    model = s.build()
    planted = s.plant(model)
    model, optimizer = accelerator.prepare(model, s.optimizer(model))
    raised = None
    with nand.watch(model, optimizer, **options) as watch:
        try:
            for step, batch in enumerate(DataLoader(s.dataset(steps), batch_size=None)):
                planted.arm(step)
                loss = planted.loss(s.case.loss(model, planted.batch(on_device(batch))))
                accelerator.backward(loss)
                planted.before_update(optimizer, step)
                optimizer.step()
                optimizer.zero_grad()
        except nand.NonFiniteError as exc:
            raised = exc
    return Trained(watch, watch.step, accelerator.unwrap_model(model), raised)


Runner = Callable[..., Trained]


@pytest.fixture(params=["lightning", "hf-trainer", "accelerate"])
def framework(request: pytest.FixtureRequest, tmp_path: Path) -> Runner:
    if request.param == "lightning":
        return run_lightning
    if request.param == "hf-trainer":
        return lambda s, steps, **options: run_hf_trainer(s, steps, tmp_path, **options)
    return run_accelerate


def test_a_healthy_run_reports_nothing_and_counts_steps_as_the_framework(framework):
    s = healthy(MODEL)
    trained = framework(s, STEPS)
    assert trained.watch is not None and trained.watch.events == []
    assert trained.watch.step == trained.steps == STEPS
    assert trained.weights_finite()


@pytest.mark.parametrize("kind", KINDS)
def test_a_fault_is_reported_where_the_plain_loop_s_truth_saw_it(framework, kind):
    s = scenario(MODEL, kind)
    trained = framework(s, STEPS)
    assert trained.said() == s.answer


@pytest.mark.parametrize("kind", ["forward", "backward", "input", "loss"])
def test_raise_comes_out_of_the_framework_before_the_bad_update(framework, kind):
    s = scenario(MODEL, kind)
    trained = framework(s, STEPS, on_nonfinite="raise")
    assert trained.raised is not None
    event = trained.raised.event
    assert (event.step, event.phase) == (s.answer.step, s.answer.phase)
    assert trained.weights_finite()  # raised before the optimizer applied the bad gradients


def test_an_hf_trainer_that_raised_out_of_train_leaves_no_scaler_wrap_once_it_is_gone(tmp_path):
    """The watch a raise left open (see ``run_hf_trainer``) wrapped
    ``GradScaler.step`` for the process: a test module run after this one on
    the same CI worker found the class still wrapped."""
    gc.collect()  # (watches earlier tests dropped)
    original = torch.amp.GradScaler.step
    s = scenario(MODEL, "forward")
    trained = run_hf_trainer(s, STEPS, tmp_path, close=False, on_nonfinite="raise")
    assert trained.raised is not None and torch.amp.GradScaler.step is not original
    del trained  # the trainer, the model, the optimizer and the open watch with them
    gc.collect()
    assert torch.amp.GradScaler.step is original


def test_stop_skips_the_bad_update_and_ends_the_loop(framework):
    s = scenario(MODEL, "backward")
    trained = framework(s, STEPS + 4, on_nonfinite="stop")
    assert trained.said() == s.answer and trained.weights_finite()
    if framework is run_accelerate:  # the user's own loop: on this rank stop ends it as raise
        assert trained.raised is not None
    else:  # the callback ends fit/train cleanly after the step, well before max_steps
        assert trained.raised is None and trained.steps <= s.answer.step + 1


# --- fp16: the framework holds the GradScaler ---------------------------------
# Lightning's "16-mixed" makes a GradScaler the user never sees (on CPU too).
# HF Trainer and accelerate make theirs on accelerators only: on CPU,
# fp16=True trains without one, so theirs are tested with NAND_TEST_DEVICE=cuda.

FP16_STEPS = 6


@pytest.mark.parametrize("kind", ["forward", "lr"])
def test_lightning_16_mixed_s_scaler_is_found_and_the_answer_holds(kind):
    s = scenario(MODEL, kind, step=4, mode=FP16_SCALER_NOT_PASSED, steps=FP16_STEPS)
    trained = run_lightning(s, FP16_STEPS, fp16=True)
    assert trained.said() == s.answer
    assert trained.watch is not None and trained.watch._amp is not None  # the scaler, found
    assert trained.watch.step == FP16_STEPS


def test_lightning_16_mixed_reports_nothing_on_a_healthy_run():
    s = healthy(MODEL, FP16_SCALER_NOT_PASSED, FP16_STEPS)
    trained = run_lightning(s, FP16_STEPS, fp16=True)
    assert trained.watch is not None and trained.watch.events == []
    assert trained.watch._amp is not None
    assert trained.watch.step == trained.steps == FP16_STEPS


@pytest.mark.gpu
@pytest.mark.skipif(ON_CPU, reason="HF Trainer and accelerate make a GradScaler on GPUs only")
@pytest.mark.parametrize("runner", ["hf-trainer", "accelerate"])
@pytest.mark.parametrize("kind", ["forward", "lr"])
def test_the_fp16_scaler_hf_trainer_or_accelerate_makes_is_found_and_the_answer_holds(
    runner, kind, tmp_path
):
    s = scenario(MODEL, kind, step=4, mode=FP16_SCALER_NOT_PASSED, steps=FP16_STEPS)
    if runner == "hf-trainer":
        trained = run_hf_trainer(s, FP16_STEPS, tmp_path, fp16=True)
    else:
        trained = run_accelerate(s, FP16_STEPS, fp16=True)
    assert trained.said() == s.answer
    assert trained.watch is not None and trained.watch._amp is not None  # the scaler, found
