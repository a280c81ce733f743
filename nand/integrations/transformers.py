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
"""

from __future__ import annotations

import os
from typing import Any

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.integrations import integration_utils
except ImportError as exc:  # pragma: no cover - the integration is optional
    raise ImportError(
        f"nand.integrations.transformers needs transformers: pip install transformers ({exc})"
    ) from exc

import nand
from nand.integrations import watch_options, with_run


class NandCallback(TrainerCallback):
    """Watches the model a ``Trainer`` trains; takes :func:`nand.watch`'s options.

    ``watch`` is the :class:`nand.Watch` of the last ``train`` (``watch.first``...).
    """

    def __init__(self, **options: Any) -> None:
        self.options = watch_options(options)
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


integration_utils.INTEGRATION_TO_CALLBACK.setdefault("nand", NandCallback)
