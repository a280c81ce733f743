"""PyTorch Lightning: ``Trainer(callbacks=[NandCallback()])``.

>>> from nand.integrations.lightning import NandCallback
>>> trainer = lightning.Trainer(callbacks=[NandCallback(on_nonfinite="stop")])  # doctest: +SKIP

The callback watches the trained module (through the strategy's DDP/FSDP
wrapper, so a rank that produced a NaN is told from those that received it)
and the first optimizer. Each training batch starts a micro-step and is
checked as the input data: Lightning hands it to ``training_step``, not to
``forward``. With automatic optimization a replay (``mode="light"``, see the
README) runs ``training_step`` again on the batch, with ``self.log`` off
(:func:`replay_steps`). ``step`` is ``trainer.global_step``. With
``on_nonfinite="stop"`` the bad update is skipped and ``trainer.should_stop``
ends ``fit`` cleanly; ``"raise"`` lets :class:`nand.NonFiniteError` out of
``trainer.fit``. The framework's run name is the logger's ``name/version``,
reported as ``name-version`` (the default logger's first run: ``lightning_logs-0``).

``NandCallback(to_tracker=True)`` also writes each incident and warning to
the trainer's ``TensorBoardLogger`` (at the step Lightning logs that batch's
metrics at) and ``WandbLogger`` (``nand.integrations.tensorboard``, ``.wandb``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

try:
    import lightning.pytorch as pl
except ImportError as exc:  # pragma: no cover - the integration is optional
    raise ImportError(
        f"nand.integrations.lightning needs PyTorch Lightning: pip install lightning ({exc})"
    ) from exc

import nand
from nand.integrations import watch_options, with_run, with_trackers

log = logging.getLogger("nand")


class NandCallback(pl.Callback):
    """Watches the LightningModule being fitted; takes :func:`nand.watch`'s options.

    ``watch`` is the :class:`nand.Watch` of the last ``fit`` (``watch.first``...).
    """

    def __init__(self, **options: Any) -> None:
        self.options = watch_options(options)
        self.to_tracker = bool(self.options.pop("to_tracker", False))
        self.watch: nand.Watch | None = None
        self._steps: Callable[[int], Callable[[Any], Any]] | None = None  # (replay_steps)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizers = trainer.optimizers
        if len(optimizers) > 1:
            log.warning(
                "nand: %d optimizers; watching the first one's parameters and steps",
                len(optimizers),
            )
        options = with_run(self.options, _run_name(trainer))
        if self.to_tracker:
            options = with_trackers(options, trackers_of(trainer))

        def stop() -> None:
            trainer.should_stop = True

        model = trainer.strategy.model or pl_module
        optimizer = optimizers[0] if optimizers else None
        self.watch = nand.watch(model, optimizer, on_stop=stop, **options)
        self.watch.step = trainer.global_step
        self._steps = replay_steps(trainer, pl_module)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.watch is not None:
            step = self._steps(batch_idx) if self._steps is not None else None
            self.watch.new_batch(batch, step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close("closed")

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._close(f"exception: {type(exception).__name__}")

    def _close(self, reason: str) -> None:
        if self.watch is not None:  # (kept: watch.first and watch.events stay readable)
            self.watch.close(reason)


def replay_steps(
    trainer: pl.Trainer, module: pl.LightningModule
) -> Callable[[int], Callable[[Any], Any]] | None:
    """For batch ``batch_idx``, what Lightning's closure runs before its
    backward, for a replay of the batch: ``training_step`` under the precision's autocast, with
    ``self.log``/``log_dict`` doing nothing (a replay must not log twice, nor
    reduce across ranks with ``sync_dist``), its loss divided for gradient
    accumulation as Lightning's backward is. None (every module probed, see
    ``Watch.new_batch``) with manual optimization, whose ``training_step``
    steps the optimizer itself, and with a GradScaler ("16-mixed"): the light
    checks see no output of the model there (``training_step`` calls its
    parts), and a NaN made in forward is then told from the scaler's
    overflow by the per-module probes only."""
    precision = trainer.strategy.precision_plugin
    if not module.automatic_optimization or getattr(precision, "scaler", None) is not None:
        return None
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    takes_index = is_param_in_hook_signature(module.training_step, "batch_idx", min_args=2)

    def step_of(batch_idx: int) -> Callable[[Any], Any]:
        index = (batch_idx,) if takes_index else ()  # (as Lightning's loop decides)

        def step(batch: Any) -> Any:
            with _logging_off(module), precision.train_step_context():
                output = module.training_step(batch, *index)
            loss = output["loss"] if isinstance(output, Mapping) else output
            return None if loss is None else loss / trainer.accumulate_grad_batches

        return step

    return step_of


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


@contextmanager
def _logging_off(module: pl.LightningModule) -> Iterator[None]:
    """``module.log`` and ``log_dict`` do nothing in the block (instance attributes)."""
    module.log = module.log_dict = _ignore  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log, module.log_dict


def _run_name(trainer: pl.Trainer) -> str | None:
    """``name/version`` of the first logger, as rank 0 has it (others may
    count versions differently before rank 0 made its directory)."""
    logger = trainer.logger
    name = f"{logger.name}/{logger.version}" if logger is not None and logger.name else None
    return trainer.strategy.broadcast(name)


def trackers_of(trainer: pl.Trainer) -> list[Any]:
    """``on_event`` bridges to the trainer's TensorBoard and W&B loggers (on
    the global rank 0: the only one that writes to them)."""
    from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

    if not trainer.is_global_zero:
        return []
    bridges: list[Any] = []
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            from nand.integrations.tensorboard import to_tensorboard

            # Lightning logs a batch's metrics at the steps done before it: nand's step.
            bridges.append(to_tensorboard(logger.experiment))
        elif isinstance(logger, WandbLogger):
            from nand.integrations.wandb import to_wandb

            bridges.append(to_wandb(logger.experiment, step_metric="trainer/global_step"))
    if not bridges:
        log.warning("nand: to_tracker=True, but the trainer has no TensorBoard or W&B logger")
    return bridges
