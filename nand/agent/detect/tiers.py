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
a compiled model, the
replays spent, inputs not held, a replay that raised or did not make the
value again) the event says what was checked and :meth:`Tiers.go_full`
hooks every module for the rest of the run, so that the next incident is
exact. Where no replay could ever be exact the watch goes full before any
incident: micro-steps marked by ``new_batch`` (:meth:`Tiers.new_batch`), a
step that never called the root (:meth:`Tiers.window_read`), and a compiled
model: compiled code ignores hooks added after dynamo traced it, so a model
compiled before ``nand.watch`` runs full from the start, and one compiled
after it turns full while its first compiled call is traced
(``compile_switch.py``). So do models under tensor parallelism and with
``SyncBatchNorm``: a replay on one rank would wait in their collectives.
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
from nand.agent.detect.hooks import Hooks
from nand.agent.detect.modules import ModuleInfo
from nand.agent.detect.probes import ProbeBuffer
from nand.agent.detect.sampling import LayerSampler
from nand.agent.detect.state import HookState
from nand.agent.detect.tensor_parallel import TensorParallelCheck
from nand.agent.safety import Guard

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
        self._proxies = True
        self._switch: CompileSwitch | None = None
        #: This rank's parts of tensor-parallel reductions (None: no such layer).
        self.tp: TensorParallelCheck | None = None
        #: The light mode's rotating sample of module outputs (sampling.py).
        self.sampler: LayerSampler | None = None

    def install(self, mode: str, model: nn.Module, proxies: bool) -> None:
        """Hook the root (light) or every module (full); see the module."""
        self._proxies = proxies
        self.tp = TensorParallelCheck.install(self.infos, self.hooks)
        unreplayable = self._unreplayable(type(model).__name__ == "OptimizedModule")
        if mode == "light" and unreplayable:
            log.info("nand: %s: every module probed from the start", unreplayable)
        self.light = mode == "light" and not unreplayable
        self.hooks.install(self.root, self.infos, proxies=proxies, modules=not self.light)
        listener = pipeline.listen(self.root, model, self.hooks.state)  # (a stage's chunks)
        if listener is not None:
            self.hooks.handles.append(cast(RemovableHandle, listener))
        if self.light:  # compiled later: full from the first compiled call (compile_switch.py)
            self.sampler = LayerSampler(self.hooks.state, self.root, self.infos)
            self.hooks.handles.append(cast(RemovableHandle, self.sampler))  # (removed at close)
            self._switch = CompileSwitch(self.root, self._compiled_now)
            self.hooks.handles.append(self._switch.handle)

    def _unreplayable(self, compiled: bool) -> str:
        """Why no replay of this model's steps could be exact ("" if one can)."""
        if compiled:
            return "a compiled model (compiled code ignores hooks added for a replay)"
        if self.tp is not None:
            return "tensor parallelism (a replay would need the other ranks)"
        if any(isinstance(module, nn.SyncBatchNorm) for module in self.root.modules()):
            return "SyncBatchNorm (a replay would gather statistics with the other ranks)"
        return ""

    def _compiled_now(self) -> None:
        self.go_full("the model is being compiled, and compiled code ignores hooks added later")

    def go_full(self, why: str) -> str:
        """Hook every module from now on; said once in the log, and returned."""
        said = COMPILED if self.compiled and not _is_compiling() else SWITCHED
        if self.light:
            self.light = False
            if self.sampler is not None:
                self.sampler.remove()
            self.hooks.install_modules(self.root, self.infos, proxies=self._proxies)
            log.warning("nand: %s; %s", why, said)
        return said

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
        if self.light and self.sampler is not None:
            self.sampler.advance()  # the next modules' outputs are sampled
        return micro_steps

    @property
    def compiled(self) -> bool:
        """A hook of this watch ran under torch.compile: hooks added now are ignored."""
        return self.hooks.state.slots.active

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
