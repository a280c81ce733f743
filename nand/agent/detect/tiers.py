"""Which probes run on every step: :class:`Tiers`.

``mode="light"`` (the default): only the root module is hooked: its
inputs (the data), its outputs (the loss a model returns, or its logits)
and the gradient arriving there (the loss computation's). The rest of the
step's checks are the same in both modes, and need no module hook: the loss
given to ``watch.loss``, one multi-tensor norm of the gradients and of the
parameters by the implied-finite rules (``optimizer.py``), the GradScaler's
``found_inf`` (``amp.py``), DDP's pre-all-reduce bucket check (``ddp.py``).
No device work per module but a rotating sample of a few modules' outputs a
step, telemetry for the flight recorder and ``headroom`` (``sampling.py``).
``mode="full"`` (``NAND_MODE=full``, the mode for hunting by hand): every
module output and activation gradient gets a probe (``hooks.py``) on every
step.

On a hit the exact answer comes from a replay (``nand.agent.rerun``): the
micro-step runs again with every module hooked for that replay only
(:meth:`Tiers.probed`: the hooks are registered on a state and a buffer of
their own and removed afterwards), and its first finding is the event the
full mode would have given. Where no replay can be exact (read one step
late after the update: ``step.deferred.read_mode``; a value received through
a collective; FSDP, but for a shard the ranks agree on: ``step.agreement``;
the replays spent, inputs not held, a replay that raised or did not make the
value again) the event says what was checked and :meth:`Tiers.go_full`
hooks every module for the next ``NAND_FULL_STEPS`` steps (100), so that
the next incident is exact, then unhooks them: the light mode again, said
in the log (a new inexact incident meanwhile starts the count again).
Where no replay could ever be exact the watch goes full for good before any
incident: micro-steps marked by ``new_batch`` (:meth:`Tiers.new_batch`), a
step that never called the root (:meth:`Tiers.window_read`). So do models
under tensor parallelism and with ``SyncBatchNorm``: a replay on one rank
would wait in their collectives.

A compiled model stays light: compiled code calls the root's hooks outside
its graph, so a compiled step is held as an eager one is, and its replay
runs the model eagerly under ``torch.compiler.set_stance("force_eager")``,
where the probes added for the replay fire (``eager.py``). Its bounded
full mode runs its compiled parts eagerly (``EagerForwards``: the model
compiled whole, in place, or block by block), so every probe fires, at the
eager step's cost for those steps, and compiled again after them. On a torch
without that stance (< 2.6) compiled code ignores hooks added after dynamo
traced it: a model compiled before ``nand.watch`` runs full from the start,
and one compiled after it turns full while its first compiled call is
traced (``compile_switch.py``), said once in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from nand.agent.detect import pipeline
from nand.agent.detect.compile_switch import CompileSwitch
from nand.agent.detect.compiled import CompiledSlots
from nand.agent.detect.eager import HAS_STANCE, NO_STANCE, EagerForwards
from nand.agent.detect.hooks import Hooks
from nand.agent.detect.modules import ModuleInfo
from nand.agent.detect.probes import ProbeBuffer
from nand.agent.detect.sampling import LayerSampler
from nand.agent.detect.state import HookState
from nand.agent.detect.tensor_parallel import TensorParallelCheck
from nand.agent.safety import Guard
from nand.config import AgentConfig

log = logging.getLogger("nand")
_is_compiling = torch.compiler.is_dynamo_compiling

#: What the light mode checked, said in an event it could not make exact
#: (short: the server keeps 300 characters of an event's ``replay``).
CHECKED = (
    "light mode checked the root's inputs and outputs, the loss, the gradients and the "
    "parameters, not each module"
)
#: Said when the watch switches to the full mode.
SWITCHED = "every module is probed from now on (mode='full')"
#: Said instead when it does for a bounded number of steps.
BOUNDED = "every module is probed for the next {steps} steps (mode='full'), then light again"
#: Said instead where the model (or a part of it) runs compiled (``eager.py``).
BOUNDED_EAGER = (
    "every module is probed for the next {steps} steps (mode='full'), "
    "the compiled model running eagerly meanwhile, then light again"
)
#: Said where NAND_FULL_STEPS=0.
STAYS_LIGHT = "the light mode goes on (NAND_FULL_STEPS=0)"
#: Said instead when the model runs compiled: hooks added now are not seen.
COMPILED = (
    "the model runs compiled, which ignores hooks added now: "
    "watch it with mode='full' before compiling it"
)


class Tiers:
    """The mode of one watch: ``light`` until :meth:`go_full` (or ``mode="full"``)."""

    def __init__(self, hooks: Hooks, root: nn.Module, infos: dict[nn.Module, ModuleInfo]) -> None:
        self.hooks = hooks
        self.root = root
        self.infos = infos
        self.light = False
        #: Whether the window read last was probed in the light mode.
        self.read_light = False
        self._proxies = True
        self._switch: CompileSwitch | None = None
        #: This rank's parts of tensor-parallel reductions (None: no such layer).
        self.tp: TensorParallelCheck | None = None
        #: The light mode's rotating sample of module outputs (sampling.py).
        self.sampler: LayerSampler | None = None
        #: Steps probed in full after an incident not made exact (NAND_FULL_STEPS).
        self.full_steps = 0
        #: Full for a bounded time: the steps left, and the module hooks to remove.
        self._left = 0
        self._bounded: list[RemovableHandle] = []
        #: The compiled parts run eagerly while the bounded full mode lasts.
        self._eager = EagerForwards()

    def install(self, settings: AgentConfig, model: nn.Module, proxies: bool) -> None:
        """Hook the root (light) or every module (full); see the module."""
        mode, self.full_steps = settings.mode, settings.full_steps
        self._proxies = proxies
        self.tp = TensorParallelCheck.install(self.infos, self.hooks)
        unreplayable = self._unreplayable(type(model).__name__ == "OptimizedModule")
        if mode == "light" and unreplayable:
            log.info("nand: %s: every module probed from the start", unreplayable)
        self.light = self.read_light = mode == "light" and not unreplayable
        outside = self.light and HAS_STANCE  # (compiled: the root's hooks as in eager code)
        self.hooks.install(
            self.root, self.infos, proxies=proxies, modules=not self.light, outside_graph=outside
        )
        listener = pipeline.listen(self.root, model, self.hooks.state)  # (a stage's chunks)
        if listener is not None:
            self.hooks.handles.append(cast(RemovableHandle, listener))
        if self.light:
            self._sample()
        if self.light and not HAS_STANCE:  # full from the first compiled call (compile_switch.py)
            self._switch = CompileSwitch(self.root, self._compiled_now)
            self.hooks.handles.append(self._switch.handle)

    def _unreplayable(self, compiled: bool) -> str:
        """Why no replay of this model's steps could be exact ("" if one can)."""
        if compiled and not HAS_STANCE:  # (with the stance a replay runs it eagerly: eager.py)
            return f"a compiled model ({NO_STANCE})"
        if self.tp is not None:
            return "tensor parallelism (a replay would need the other ranks)"
        if any(isinstance(module, nn.SyncBatchNorm) for module in self.root.modules()):
            return "SyncBatchNorm (a replay would gather statistics with the other ranks)"
        return ""

    def _compiled_now(self) -> None:
        self.go_full(f"the model is being compiled, and {NO_STANCE}")

    def _sample(self) -> None:
        self.sampler = LayerSampler(self.hooks.state, self.root, self.infos)
        self.hooks.handles.append(cast(RemovableHandle, self.sampler))  # (removed at close)

    def go_full(self, why: str, bounded: bool = False) -> str:
        """Hook every module, from now on or (``bounded``: an incident not
        made exact) for :attr:`full_steps` steps; said in the log, and returned."""
        if bounded and not self.full_steps and self.light:
            return STAYS_LIGHT
        compiled = self.compiled and not _is_compiling()
        said = SWITCHED if not bounded else BOUNDED.format(steps=self.full_steps)
        said = COMPILED if compiled and not bounded else said
        if bounded and self._left:  # full for a while already: the count starts again
            self._left = self.full_steps
        elif not bounded:  # full for good: the hooks of a bounded switch stay
            self._left, self._bounded = 0, []
        if self.light:
            self.light = False
            if self.sampler is not None:
                self.sampler.remove()
            first = len(self.hooks.handles)
            self.hooks.install_modules(self.root, self.infos, proxies=self._proxies)
            # Compiled code would not call the hooks just added: run it eagerly (eager.py).
            if bounded and self._eager.start(self.root, compiled):
                self.hooks.handles.append(cast(RemovableHandle, self._eager))
                said = BOUNDED_EAGER.format(steps=self.full_steps)
            if bounded:
                self._left, self._bounded = self.full_steps, self.hooks.handles[first:]
            log.warning("nand: %s; %s", why, said)
        return said

    def _back_to_light(self) -> None:
        """The bounded full mode is over: unhook the modules, sample again."""
        bounded = set(map(id, self._bounded))
        for handle in self._bounded:
            handle.remove()
        self.hooks.handles[:] = [h for h in self.hooks.handles if id(h) not in bounded]
        self._bounded = []
        self.light = True
        self._sample()
        steps = self.full_steps
        log.warning("nand: %d steps probed every module; back to the light mode", steps)

    def new_batch(self, batch: Any, step: Callable[[Any], Any] | None) -> None:
        """``Watch.new_batch``: micro-steps are marked by batches, not by calls
        of the root (Lightning's ``training_step`` calls the model's parts).
        Without the ``step`` that runs a batch again no replay can be exact,
        so every module is probed from the first one."""
        if self.light and step is None:
            self.go_full("micro-steps are marked by new_batch, which no replay can repeat")
        self.hooks.new_batch(self.infos[self.root], batch, step)

    def window_read(self, micro_steps: int, stepped: bool) -> int:
        """A step's window was read (``stepped``: by a step, not at close).
        A step without a root call entered the model elsewhere (a loop that
        calls its parts): its inputs are never held, no replay can repeat
        it, so every module is probed from then on (the entry points too)."""
        if self.light and stepped and not micro_steps:
            self.go_full("a step ran without calling the watched model, which no replay can repeat")
        self.read_light = self.light  # (a bounded full mode ends after its last window)
        if self._left and stepped:
            self._left -= 1
            if not self._left:
                self._back_to_light()
        if self.light and self.sampler is not None and not self.compiled:
            # The next modules' outputs are sampled. Not in compiled code: its
            # sample hooks do nothing, and each move would recompile the model.
            self.sampler.advance()
        return micro_steps

    @property
    def compiled(self) -> bool:
        """A hook of this watch ran under torch.compile: hooks added now are ignored."""
        outside = self.hooks.outside
        return self.hooks.state.slots.active or (outside is not None and outside[0].compiled)

    @contextmanager
    def probed(self) -> Iterator[ProbeBuffer]:
        """Every module hooked, into a buffer of its own, while the block runs
        (a replay); the hooks are removed after it, also when it raises."""
        buf = ProbeBuffer()
        slots = CompiledSlots.for_model(self.root, self.infos.values())
        hooks = Hooks(HookState(buf, Guard(), slots))
        try:
            hooks.install(self.root, self.infos, proxies=False)  # (.grad is not touched)
            yield buf
        finally:
            hooks.remove()
