"""The light mode's per-layer history: a rotating sample of module outputs.

The light mode hooks the root only (``tiers.py``), so without this its flight
recorder would hold the root's row alone, and neither the ``headroom``
warning (``step/blowup.py``) nor the server's overflow hint (a layer's max|x|
running away over the window) could see a layer blow up before it went
non-finite. :class:`LayerSampler` hooks a few modules at a time
(:func:`per_step`), in module order, and moves on to the next ones at each
step's read, so each module is sampled every :data:`PERIOD` steps, or every
``ceil(N / MAX_PER_STEP)`` in a large model (``N``: the modules the full mode
probes the outputs of: every one but the root, the containers and the
finite-preserving leaves, whose outputs are their inputs' size).

A sample is what a full-mode probe is: one ``aminmax`` of the module's
(first floating) output into the step's probe buffer, read with the rest of
the step in its one read, no sync. Its site is
of kind :data:`SAMPLE`: telemetry only, never a finding (a module's output
alone cannot tell produced from received; the light mode's events come from
its own checks and the replay). Hooks are moved by removing the last step's
handles and registering the next ones: a handful of dict operations per
step, where a hook on every module would cost each module call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from nand.agent.detect.modules import CONTAINERS, ModuleInfo
from nand.agent.detect.probes import Site, iter_tensors
from nand.agent.detect.savable import SavableHook
from nand.agent.detect.state import HookState

_is_compiling = torch.compiler.is_dynamo_compiling

#: Each module is sampled at least every PERIOD steps in a model of up to
#: PERIOD * MAX_PER_STEP such modules; in a larger one MAX_PER_STEP modules a
#: step bound the cost (a probe is a kernel launch: issue 32 allows a GPT-2
#: step a dozen more), and each is sampled every ceil(N / MAX_PER_STEP) steps.
PERIOD, MAX_PER_STEP = 4, 4


def per_step(n: int) -> int:
    """Modules sampled per step among ``n``: one for a three-layer MLP, four for a GPT-2."""
    return min(MAX_PER_STEP, -(-n // PERIOD))


#: The kind of a sampled site (``probes.Site.kind``): telemetry, not a finding.
SAMPLE = "sample"


class LayerSampler:
    """Hooks :func:`per_step` of the model's modules at a time; see the module."""

    def __init__(
        self, state: HookState, root: nn.Module, infos: dict[nn.Module, ModuleInfo]
    ) -> None:
        self.state = state
        #: (module, its sampling hook), in module order; the hooks are made once.
        self.sampled = [
            (module, SavableHook(self._hook(module, info)))
            for module, info in infos.items()
            if module is not root and not isinstance(module, CONTAINERS) and not info.safe
        ]
        self.k = per_step(len(self.sampled))
        self._next = 0
        self._handles: list[RemovableHandle] = []
        self.advance()

    def advance(self) -> None:
        """Unhook this step's modules and hook the next ones."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        n, k = len(self.sampled), self.k
        for i in range(k):
            module, hook = self.sampled[(self._next + i) % n]
            self._handles.append(module.register_forward_hook(hook))
        if k:
            self._next = (self._next + k) % n

    def remove(self) -> None:
        """Sample no more: the watch closed, or the full mode probes every module."""
        self.sampled, self.k = [], 0
        self.advance()

    def _hook(self, owner: nn.Module, info: ModuleInfo) -> Callable[..., None]:
        state, sites = self.state, _Sites(info)

        def sample_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            # (a shallow copy shares the hook dicts; under compile no sample)
            if state.guard.off or module is not owner or _is_compiling() or state.slots.active:
                return
            try:  # (tensors_of inlined: a frame less on every sample)
                outputs = (("", output),) if isinstance(output, Tensor) else iter_tensors(output)
                for slot, t in outputs:
                    if t.is_floating_point() and t.numel():
                        site = sites[slot]
                        state.buf.probe(t, site)
                        site.shape, site.dtype = t.shape, t.dtype
                        return  # the first float output only (a block's hidden state,
                        # not its key-value cache): one launch a sampled module
            except Exception as exc:
                state.guard.failed(exc, f"sampled output of {info.name!r}")

        return sample_hook


class _Sites(dict[str, Site]):
    """A module's sample sites by output slot, made on first use."""

    def __init__(self, info: ModuleInfo) -> None:
        super().__init__()
        self.info = info

    def __missing__(self, slot: str) -> Site:
        info = self.info
        site = self[slot] = Site(
            phase="forward",
            module=info.name,
            module_type=info.type,
            index=info.index,
            slot=slot,
            kind=SAMPLE,
            allow_neginf=info.allow_neginf,
        )
        return site
