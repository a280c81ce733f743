"""On a new incident, run its micro-step again and say what made the value.

:class:`Rerun` is what the watch calls (:meth:`Rerun.explain`) with the
incident's event, at the step boundary, before the policy acts and before
the event is logged or sent. It fills the event's ``op``, ``source``,
``reproduced`` and ``replay`` fields and adds a sentence to its message.

What is replayed, and when (``replay`` says why not, otherwise):

- the forward of the micro-step the event names, and its backward too when
  the event is a gradient's (``backward``, ``grad``);
- at the boundary before the optimizer's update, for every policy, ``warn``
  included: the weights are those the step ran with. Read one step late
  (``read="deferred"``) the update was applied, and there is no replay,
  unless the optimizer skipped it on the device (``skip``, and every policy
  in the light mode: ``step.deferred.read_mode``) or there is no optimizer:
  then the step's micro-steps are replayed at the next boundary, before
  that step's update, with the weights they ran with;
- a ``loss`` event with its loss computation: the calls recorded between
  the root's return and the backward (``loss.py``, ``recorder.py``), a
  framework's step, or the model's own output; not where none was recorded;
- not ``param``/``optimizer_state`` (made by the
  update), nor a value ``received`` through a collective (the rank that
  made it replays its own), nor a GradScaler's overflow (no incident), nor
  under FSDP (a sharded forward all-gathers: the other ranks would have to
  take part, and a replay is one rank's alone);
- at most one replay per incident, and ``NAND_REPLAYS`` per run and rank.

In the light mode (``detect/tiers.py``) the replay runs with every module
probed and names the module, phase and cause too (``light.py``); where it
cannot (any reason above, or a replay that raised or found nothing), the
event says what was checked and the watch probes every module from then on.

The op chosen: in forward, among the ops that ran inside the event's module
(or its children), the first that made a non-finite value from finite
inputs; in backward, the first such op of the backward. Failing that, the
first op there that output a non-finite value (its input was a tensor no op
of the step made: a constant, a buffer). Ops that write an infinity given
as a Python number (an attention mask) are passed over, also where a
checkpointed forward is recomputed inside the backward, unless no other op
there output one (``masked_fill(..., nan)``: the code wrote it). Ops that
nand's own probes run during the replay are never named. ``reproduced`` says
whether the replay saw the non-finite value again there (for ``input``: the
held batch).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from nand.agent.detect.ddp import params_are_gathered
from nand.agent.detect.state import HookState
from nand.agent.detect.tiers import CHECKED, Tiers
from nand.agent.rerun.attrs import own_dicts
from nand.agent.rerun.held import MAX_HELD, Held, HeldStep
from nand.agent.rerun.light import before_the_loss, make_exact, needs_probes, probed_finding
from nand.agent.rerun.loss import NOT_RECORDED, LossRun, LossSteps
from nand.agent.rerun.opwatch import OpRecord
from nand.agent.rerun.run import Replayed, replay
from nand.agent.safety import Guard
from nand.agent.step.boundary import Boundary
from nand.agent.step.finding import Finding
from nand.events import Event, replay_words

log = logging.getLogger("nand")

#: Why an event is not replayed, by phase or cause (see the module).
NOT_REPLAYED = {
    "param": "not replayed: made by the optimizer's update, which a replay does not run",
    "optimizer_state": "not replayed: made by the optimizer's update, which a replay does not run",
    "received": "not replayed: received through a collective; the rank that made it replays",
}
GRADIENT_PHASES = ("backward", "grad")


class Rerun:
    """Replays of one watch; ``budget`` replays at most (0: nothing held)."""

    def __init__(
        self,
        root: nn.Module,
        guard: Guard,
        state: HookState,
        boundary: Boundary,
        tiers: Tiers | None = None,
    ) -> None:
        self.root = root
        self.guard = guard
        self.state = state
        self.boundary = boundary
        self.left = 0
        self.held: Held | None = None
        self.tiers = tiers  # (the light mode's, see tiers.py)
        self.loss = LossSteps(guard, boundary)  # (the losses backwards start from: loss.py)
        self._names = {module: name for name, module in root.named_modules()}
        self._modules = {name: module for module, name in self._names.items()}

    def install(self, budget: int) -> None:
        """Hold each micro-step from now on (after nand's own hooks: see ``held``)."""
        self.left = budget
        if budget > 0:
            param = next(iter(self.root.parameters()), None)
            device = param.device if param is not None else torch.device("cpu")
            lagged = self.boundary.deferred is not None
            dicts = own_dicts(self.root)
            self.held = Held(self.state, device, self._windows, dicts, keep_earlier=lagged)
        self.loss.install(self.root, self.held)

    def _windows(self) -> int:
        """The boundary's windows so far: read, or copied to be read (deferred).
        The one read last is number ``reads - 1``."""
        pending = self.boundary.deferred
        return self.boundary.reads + (len(pending) if pending is not None else 0)

    def _steps(self) -> list[HeldStep]:
        """The micro-steps held of the window read last (deferred: the one before)."""
        assert self.held is not None
        return self.held.of_window(self.boundary.reads - 1)

    def _weights_kept(self) -> bool:
        """Read one step late, the step's weights are still there: its update
        was skipped on the device (the window's flag), or there is no optimizer."""
        return self.boundary.skip_on_device or self.boundary.params is None

    def remove(self) -> None:
        self.loss.remove()
        if self.held is not None:
            self.held.remove()

    def explain(self, event: Event, lagged: bool) -> None:
        """Replay ``event``'s micro-step; fill its replay fields and message."""
        tiers = self.tiers if self.tiers is not None and self.tiers.read_light else None
        light = tiers is not None and needs_probes(event, self.state.external_batches)
        if self.held is None and not light:
            return
        try:
            why_not = self._why_not(event, lagged)
            if why_not:
                event.replay = why_not
            else:
                self.left -= 1
                self._replay(event, light)
        except Exception as exc:  # nand's own error: said, not raised
            log.warning("nand: the replay of step %d failed: %r", event.step, exc)
            event.replay = f"replay failed: {type(exc).__name__}: {exc}"[:300]
        if light and tiers is not None and not event.reproduced:  # not exact: said, then full
            why = f"the incident at step {event.step} could not be made exact"
            said = tiers.go_full(why, bounded=True)
            event.replay = f"{event.replay}; {CHECKED}; {said}"
        words = replay_words(event)
        if words:
            event.message = f"{event.message}; {words}"

    def _why_not(self, event: Event, lagged: bool) -> str:
        if self.held is None:
            return "not replayed: NAND_REPLAYS=0 (nothing held)"
        if event.cause in NOT_REPLAYED or (event.phase in NOT_REPLAYED and not _second(event)):
            return NOT_REPLAYED.get(event.phase) or NOT_REPLAYED[event.cause]
        if lagged and not self._weights_kept():
            return "not replayed: read one step late (read='deferred'), after the update"
        if self.boundary.params_gathered or any(map(params_are_gathered, self.root.modules())):
            return "not replayed: FSDP shards the parameters (a replay would need the other ranks)"
        if self.boundary.tp is not None:
            return "not replayed: tensor parallelism (a replay would need the other ranks)"
        steps = self._steps()  # (the window replayed: under a late read, the one before)
        if self.state.external_batches and not steps:  # (held with a step only)
            return "not replayed: micro-steps are marked by new_batch, not by calls of the model"
        if self.left <= 0:
            return "not replayed: this run's replays (NAND_REPLAYS) are spent"
        if event.micro_step >= len(steps):
            return (
                f"not replayed: the inputs of micro-step {event.micro_step} were not held "
                f"(the model ran compiled or outside its root module, or after {MAX_HELD} calls)"
            )
        held = steps[event.micro_step]
        if _loss(event) and held.step is None and held.loss is None:
            return NOT_RECORDED
        if _backward(event) and not held.grads and held.step is None:
            return "not replayed: no gradient reached the model's outputs"
        return ""

    def _replay(self, event: Event, light: bool) -> None:
        assert self.held is not None
        backward, loss = _backward(event), _loss(event)
        # A gradient read in light mode sums every micro-step's: the first that makes it.
        micros = range(len(self._steps())) if light and backward else [event.micro_step]
        was_off, self.guard.off, self.held.paused = self.guard.off, True, True
        try:
            for micro in micros:
                replayed, finding = self._run(micro, backward, light, loss)
                finding = before_the_loss(finding) if loss else finding  # (else: the loss's)
                if finding is not None:
                    break
        except Exception as exc:  # the user's code raised, run again: said in the event
            event.replay = f"replay raised {type(exc).__name__}: {exc}"[:300]
            return
        finally:
            self.guard.off, self.held.paused = was_off, False
        what = "forward and backward" if replayed.backward else "forward"
        what += " and the loss computation" if loss else ""
        which = f"micro-step {micro if finding is not None else event.micro_step}"
        if finding is None and len(micros) > 1:
            which = f"micro-steps 0 to {len(micros) - 1}"
        event.replay = f"replayed the {what} of {which}"
        if finding is not None:
            make_exact(event, finding, self.boundary, self.held.before)
        if event.phase == "param":  # (the module's own weight: see light.make_exact)
            event.replay += "; the module's parameter was non-finite before it ran"
            event.reproduced = True
            return
        chosen, event.reproduced = conclude(event, replayed)
        if (
            light
            and not loss
            and finding is None
            and not _seen_without_probes(event, replayed, backward)
        ):
            return
        event.reproduced = event.reproduced or finding is not None  # (the probes saw it)
        if chosen is not None:
            event.op, event.source = chosen.op, chosen.source
            self._blame_node_owner(event, backward_owner(replayed.records))
            if chosen.kind == "constant":
                event.replay += "; written from a non-finite Python number in the code"
            elif chosen.kind != "produced":
                event.replay += _made_from(chosen, replayed.records)

    def _blame_node_owner(self, event: Event, owner: str | None) -> None:
        """A backward event names the module whose backward node made the
        value (``owners.py``) where the probes' order of arrival named
        another: one consumer of a value read twice (q, k and v), or a branch
        beside another (a shortcut). (A ``grad`` event names a parameter.)"""
        if event.phase != "backward" or owner is None or owner == event.module:
            return
        before = event.where()
        event.module, event.module_type = owner, type(self._modules[owner]).__name__
        event.message = event.message.replace(f" of {before} at ", f" of {event.where()} at ", 1)

    def _run(
        self, micro: int, backward: bool, light: bool, loss: bool = False
    ) -> tuple[Replayed, Finding | None]:
        """Replay micro-step ``micro``; in light mode with every module probed;
        with ``loss``, its loss computation too (``loss.py``)."""
        assert self.held is not None
        held, device = self._steps()[micro], self.held.device
        then = LossRun(held.loss) if loss else None
        if not light or self.tiers is None:
            return replay(self.root, held, self._names, device, backward, then), None
        with self.tiers.probed() as buf:
            replayed = replay(self.root, held, self._names, device, backward, then)
        return replayed, probed_finding(buf, micro)


def _made_from(chosen: OpRecord, records: list[OpRecord]) -> str:
    """What the op named took its non-finite input from, in words that agree
    with the event's cause: an infinity the code wrote (a mask covering a
    whole row), else a tensor no op of the step made (a buffer, a constant)."""
    at = records.index(chosen)
    written = [r for r in records[:at] if r.kind == "constant" and r.phase == chosen.phase]
    if written:
        w = written[-1]
        return (
            f"; from finite inputs, through an infinity the code wrote ({w.op} at "
            f"{w.source or 'an unknown line'}): a whole row masked, say"
        )
    return "; its input held a non-finite value that no op of the step made (a buffer, a constant)"


def _second(event: Event) -> bool:
    """A gradient that reached the model's output a second time in its
    micro-step (a gradient penalty's backward, ``call`` > 0): the first
    backward, held, went through the modules and is replayed."""
    return event.phase == "loss" and event.call > 0


def _loss(event: Event) -> bool:
    """A loss event whose loss value, or the gradient it started, is replayed
    with its loss computation (not a second backward's: ``_second``)."""
    return event.phase == "loss" and not _second(event)


def _backward(event: Event) -> bool:
    return event.phase in GRADIENT_PHASES or _second(event)


def conclude(event: Event, replayed: Replayed) -> tuple[OpRecord | None, bool]:
    """The op to name and whether the replay reproduced the value (see the module)."""
    if event.phase == "input":
        return None, not replayed.inputs_finite
    phase = "forward" if event.phase == "forward" or _loss(event) else "backward"
    scope = [
        r
        for r in replayed.records
        if r.phase == phase and (phase == "backward" or _within(r, event))
    ]
    if not scope and _loss(event):  # a finite loss, its gradient not: the loss's backward
        scope = [r for r in replayed.records if r.phase == "backward" and not r.module]
    made = [r for r in scope if r.kind != "constant"]  # (a mask's -inf: on purpose)
    produced = [r for r in made if r.kind == "produced"]
    candidates = produced or made or scope
    return (candidates[0] if candidates else None), bool(scope)


def backward_owner(records: list[OpRecord]) -> str | None:
    """The module of the backward node where the value was made: the first op
    of the backward that made a non-finite value from finite inputs; failing
    that, the first that output one, a Python infinity written on purpose
    included (a custom backward's ``fill_``): the forward was finite, so the
    backward's first non-finite value is where it began."""
    backward = [r for r in records if r.phase == "backward"]
    produced = [r for r in backward if r.kind == "produced"]
    first = produced[0] if produced else (backward[0] if backward else None)
    return first.module if first is not None else None


def _seen_without_probes(event: Event, replayed: Replayed, backward: bool) -> bool:
    """The light replay's probes found nothing: whether the value was seen all
    the same. Only a parameter's gradient is (a first layer's backward, which
    no probe comes after): the op watch saw it made in the backward of the
    parameter's own module, as the full mode's replay does, and the event
    stays that parameter's. Otherwise a forward event is not reproduced (the
    root's output came out finite), a gradient's unknown (``.grad`` is not
    checked)."""
    event.replay += "; its probes found nothing non-finite"
    if not backward:
        event.reproduced = False
        return False
    owner = backward_owner(replayed.records)
    if event.reproduced and owner is not None and _owns(owner, event.module):
        return True
    event.reproduced = None
    return False


def _owns(module: str, param: str) -> bool:
    """Whether ``param`` (a qualified parameter name) is ``module``'s own."""
    return param.rpartition(".")[0] == module


def _within(record: OpRecord, event: Event) -> bool:
    name, module = record.module, event.module
    if _loss(event):  # the root's own code (a loss the model computes) or none of the model's
        return not name
    return name is not None and (not module or name == module or name.startswith(module + "."))
