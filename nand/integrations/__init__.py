"""nand where people train through a framework: one line each.

- PyTorch Lightning: ``Trainer(callbacks=[nand.integrations.lightning.NandCallback()])``
- Hugging Face ``Trainer``:
  ``Trainer(..., callbacks=[nand.integrations.transformers.NandCallback()])``, or
  ``TrainingArguments(report_to=["nand"])`` once ``nand.integrations.transformers``
  is imported
- accelerate: ``nand.watch(model, optimizer)`` with what ``accelerator.prepare`` returned

Each callback takes the options of :func:`nand.watch` (``on_nonfinite``,
``server``, ``run``, ``allow_nonfinite``...), counts ``step`` as the framework
does (``trainer.global_step``, ``state.global_step``), takes the framework's
run name when it has one and no ``run`` was given, and reports the model's
module names as written. ``on_nonfinite="raise"`` raises
:class:`nand.NonFiniteError` out of the framework's ``fit``/``train`` before
the update; ``"stop"`` skips that update and stops the framework's loop the
way its own callbacks do. The run id is, in this order: ``run=``,
``NAND_RUN``, torchrun's or Slurm's id, the framework's run name (each ``/``
made ``-``: :func:`nand.runids.run_id_from`). Each
framework is imported only by its module here: the agent depends on none.

Incidents in the tracker the run already uses: ``NandCallback(to_tracker=True)``
writes each incident and warning to the trainer's TensorBoard or W&B; a plain
loop passes ``on_event=to_wandb()`` / ``to_tensorboard(writer)``
(``nand.integrations.wandb``, ``.tensorboard``, built on ``on_event``).
"""

from __future__ import annotations

import inspect
from typing import Any

from nand.errors import ConfigError

#: Options the framework callbacks set themselves.
_SET_BY_CALLBACK = frozenset({"on_stop"})
#: Options the framework callbacks take besides nand.watch's: ``to_tracker=True``
#: also writes incidents to the trainer's own TensorBoard / W&B (``trackers_of``).
CALLBACK_ONLY = frozenset({"to_tracker"})


def watch_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` checked against :func:`nand.watch`'s keyword arguments now,
    when the callback is made, rather than when training starts."""
    from nand.agent.api import watch

    allowed = set(inspect.signature(watch).parameters) - {"model", "optimizer"} | CALLBACK_ONLY
    unknown = sorted(set(options) - (allowed - _SET_BY_CALLBACK))
    if unknown:
        raise ConfigError(
            f"NandCallback got unknown option(s) {', '.join(unknown)}; "
            f"it takes those of nand.watch: {', '.join(sorted(allowed - _SET_BY_CALLBACK))}"
        )
    return dict(options)


def with_run(options: dict[str, Any], framework_run: str | None) -> dict[str, Any]:
    """``options`` with the framework's run name made a run id
    (:func:`nand.runids.run_id_from`: ``lightning_logs/0`` → ``lightning_logs-0``),
    unless one was given or the environment names one (``NAND_RUN``,
    torchrun's, Slurm's: a scheduler waits on those)."""
    from nand.agent.identity import launcher_run_id
    from nand.config import AgentConfig
    from nand.runids import run_id_from

    chosen = AgentConfig.resolve(run=options.get("run")).run  # (or NAND_RUN)
    made = run_id_from(framework_run or "")
    if chosen or launcher_run_id() or made is None:
        return options
    return {**options, "run": made}


def with_trackers(options: dict[str, Any], bridges: list[Any]) -> dict[str, Any]:
    """``options`` with ``bridges`` (``to_tracker=True``: the trainer's own
    TensorBoard or W&B) called after the user's ``on_event``."""
    if not bridges:
        return options
    given = options.get("on_event")
    mine = [] if given is None else [given] if callable(given) else list(given)
    return {**options, "on_event": mine + bridges}
