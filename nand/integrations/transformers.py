"""Hugging Face ``Trainer``: ``Trainer(..., callbacks=[NandCallback()])``.

>>> from nand.integrations.transformers import NandCallback
>>> trainer = Trainer(model, args, train_dataset=data, callbacks=[NandCallback()])  # doctest: +SKIP

Importing this module also registers ``"nand"`` among the names
``TrainingArguments(report_to=[...])`` accepts; the callback then takes its
options from the ``NAND_*`` variables.

The callback watches the model and optimizer the ``Trainer`` hands to its
callbacks (accelerate's wrapper is looked through; a DDP wrapper is found at
the first forward). ``step`` is ``state.global_step``. With
``on_nonfinite="stop"`` the bad update is skipped and
``control.should_training_stop`` ends ``train`` after that step; ``"raise"``
lets :class:`nand.NonFiniteError` out of ``trainer.train()``. The framework's
run name is ``args.run_name``, else the name of ``args.output_dir`` (of the
directory it names: ``"."`` is the working directory's name), each ``/`` made ``-``.

``NandCallback(to_tracker=True)`` also writes each incident and warning to
what ``report_to`` made: the ``"tensorboard"`` callback's writer and the
``"wandb"`` callback's run (``nand.integrations.tensorboard``, ``.wandb``), at
``state.global_step`` after that update (where the ``Trainer`` logs its loss;
set ``logging_nan_inf_filter=False`` to see a NaN loss there as it was).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.integrations import integration_utils
except ImportError as exc:  # pragma: no cover - the integration is optional
    raise ImportError(
        f"nand.integrations.transformers needs transformers: pip install transformers ({exc})"
    ) from exc

import nand
from nand.integrations import watch_options, with_run, with_trackers

log = logging.getLogger("nand")


class NandCallback(TrainerCallback):
    """Watches the model a ``Trainer`` trains; takes :func:`nand.watch`'s options.

    ``watch`` is the :class:`nand.Watch` of the last ``train`` (``watch.first``...).
    """

    def __init__(self, **options: Any) -> None:
        self.options = watch_options(options)
        self.to_tracker = bool(self.options.pop("to_tracker", False))
        self.watch: nand.Watch | None = None
        self._stop = False

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: Any = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        name = args.run_name or os.path.basename(os.path.abspath(args.output_dir or ""))
        options = with_run(self.options, name)
        if self.to_tracker and state.is_world_process_zero:
            # HF hands a callback no handle on the others; the CallbackHandler
            # calling this does have them (report_to's come before the user's).
            handler = sys._getframe(1).f_locals.get("self")
            options = with_trackers(options, trackers_of(getattr(handler, "callbacks", [])))
        self._stop = False
        self.watch = nand.watch(model, optimizer, on_stop=self._request_stop, **options)
        self.watch.step = state.global_step

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._stop:
            control.should_training_stop = True

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.watch is not None:  # (kept: watch.first and watch.events stay readable)
            self.watch.close("closed")

    def _request_stop(self) -> None:
        self._stop = True


def trackers_of(callbacks: list[Any]) -> list[Any]:
    """``on_event`` bridges to what ``report_to`` made: TensorBoard's writer,
    W&B's run. The ``Trainer`` logs an update's loss at the ``global_step``
    after it: nand's step + 1."""
    bridges: list[Any] = []
    for callback in callbacks:
        if isinstance(callback, integration_utils.TensorBoardCallback) and callback.tb_writer:
            from nand.integrations.tensorboard import to_tensorboard

            bridges.append(to_tensorboard(callback.tb_writer, offset=1))
        elif isinstance(callback, integration_utils.WandbCallback):
            from nand.integrations.wandb import to_wandb

            run = callback._wandb.run if callback._wandb is not None else None
            bridges.append(to_wandb(run, step_metric="train/global_step", offset=1))
    if not bridges:
        log.warning("nand: to_tracker=True, but report_to made no TensorBoard or W&B callback")
    return bridges


integration_utils.INTEGRATION_TO_CALLBACK.setdefault("nand", NandCallback)
