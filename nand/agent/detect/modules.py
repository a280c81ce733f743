"""The module table: every module of the watched model, with what the hooks need.

Each module gets a :class:`ModuleInfo` once, at ``nand.watch``: its reported
name, its position in the table (the flight recorder's column), whether it is a
leaf, whether it can make a finite value non-finite at all, and the module
whose ``forward`` calls it (for blaming inline code). Sites are created on
first use and cached, so hooks allocate no new bookkeeping per call.
"""

from __future__ import annotations

import fnmatch
import itertools
from collections.abc import Iterable
from typing import Any

from torch import Tensor, nn

from nand.agent.detect.names import module_names
from nand.agent.detect.probes import Site
from nand.events import Phase

CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)

#: Modules whose output (and input gradient) is finite whenever their input
#: (and output gradient) is: they cannot be the origin of a non-finite value,
#: so probing them would only repeat their neighbour's probe. Their hook just
#: keeps track of the last output (and checks for inline code before them).
FINITE_PRESERVING = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.PReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Tanh,
    nn.Sigmoid,
    nn.Hardtanh,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Softmax,
    nn.LogSoftmax,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.Identity,
    nn.Flatten,
    nn.Unflatten,
)

#: Of those, the ones whose backward zeroes the gradient exactly where their
#: input was cut: a non-finite gradient made by the *next* module can vanish
#: in their backward (ReLU before ``torch.where(x > 0, log(x), 0)``: the NaN
#: sits where x == 0), so the gradient at their output is still probed, unless
#: what consumes the output has a benign backward (:data:`BENIGN_BACKWARD`);
#: the forward probe is skipped all the same. Dropout masks at random places,
#: so a non-finite gradient mostly passes it and is seen at the next probe.
MASKING = (nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid)

#: Modules whose backward cannot turn a finite gradient into a non-finite one
#: (short of overflow, which never lines up with where a relu cut). When one
#: of them consumes a masking module's output, that output's gradient probe
#: would find nothing the next probe misses, so it is not attached.
BENIGN_BACKWARD = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
)


#: Modules whose bias gradient is their output gradient summed over every
#: position but the channel (exact types: a subclass may use its bias
#: otherwise). Their output gradient is probed through the bias (see
#: ``grads.BiasProxy``).
BIAS_IS_OUTPUT_SUM = frozenset(
    {
        nn.Linear,
        nn.Conv1d,
        nn.Conv2d,
        nn.Conv3d,
        nn.ConvTranspose1d,
        nn.ConvTranspose2d,
        nn.ConvTranspose3d,
        nn.LayerNorm,
        nn.GroupNorm,
        nn.BatchNorm1d,
        nn.BatchNorm2d,
        nn.BatchNorm3d,
    }
)


def runs_as(module: nn.Module, kinds: tuple[type[nn.Module], ...]) -> bool:
    """Whether a call of ``module`` computes exactly what one of ``kinds``' forward does.

    The shortcuts nand takes (not probing a ReLU, reading a Linear's output
    gradient from its bias) are facts about a type's ``forward``. A module
    can do more when called: a subclass that overrides ``forward``, a
    ``forward`` set on the instance (a wrapper, a patch), or forward hooks
    and pre-hooks of someone else's, registered before nand's, that change
    what goes in or comes out. Then the module gets every check.
    """
    if "forward" in module.__dict__ or module._forward_hooks or module._forward_pre_hooks:
        return False
    forward = type(module).forward
    return any(forward is kind.forward for kind in kinds)


#: Where torch makes the classes it swaps a module's class for: FSDP2's
#: ``fully_shard`` (``FSDPLinear``) and ``replicate`` subclass the module's own.
_WRAPPER_CLASS_MODULES = ("torch.distributed.fsdp.", "torch.distributed._composable.")


def type_name(module: nn.Module) -> str:
    """The module's class as the user wrote it (``Linear``, not ``FSDPLinear``)."""
    cls = type(module)
    if cls.__module__.startswith(_WRAPPER_CLASS_MODULES) and len(cls.__bases__) > 1:
        return cls.__bases__[-1].__name__
    return cls.__name__


class ModuleInfo:
    """One hooked module: its sites (cached, so hooks allocate nothing new)."""

    def __init__(self, name: str, module: nn.Module, index: int, allow_neginf: bool) -> None:
        self.name = name
        self.type = type_name(module)
        self.index = index
        self.allow_neginf = allow_neginf
        self.leaf = not any(True for _ in module.children())
        #: The rules below hold for a type's own forward only (see runs_as).
        self.safe = self.leaf and runs_as(module, FINITE_PRESERVING)
        self.masking = self.safe and runs_as(module, MASKING)
        self.benign = runs_as(module, BENIGN_BACKWARD)
        self.parent: ModuleInfo | None = None  # the module whose forward calls this one
        self._outputs: dict[str, Site] = {}
        self._inline: Site | None = None

    def output_site(self, slot: str) -> Site:
        site = self._outputs.get(slot)
        if site is None:
            site = self._new_site("forward", slot, "output")
            self._outputs[slot] = site
        return site

    def input_site(self, slot: str) -> Site:
        """The site of the root's input data at ``slot`` (argument path)."""
        site = self._outputs.get("input:" + slot)
        if site is None:
            site = self._site("input", slot, "input")
            self._outputs["input:" + slot] = site
        return site

    def loss_site(self, slot: str) -> Site:
        """The site of the gradient arriving at the root output ``slot``."""
        site = self._outputs.get("loss:" + slot)
        if site is None:
            site = self._site("loss", slot, "loss")
            site.forward = self.output_site(slot)
            self._outputs["loss:" + slot] = site
        return site

    def inline_site(self) -> Site:
        """The site of a value computed inline in this module's forward."""
        if self._inline is None:
            self._inline = self._new_site("forward", "", "inline")
        return self._inline

    def _new_site(self, phase: Phase, slot: str, kind: str) -> Site:
        site = self._site(phase, slot, kind)
        site.backward = self._site("backward", slot, kind)
        site.backward.forward = site
        site.allow_neginf = self.allow_neginf and kind == "output"
        return site

    def _site(self, phase: Phase, slot: str, kind: str) -> Site:
        """A site of this module (its name, type and place in the table)."""
        return Site(
            phase=phase,
            module=self.name,
            module_type=self.type,
            index=self.index,
            slot=slot,
            kind=kind,
        )


def described(infos: dict[nn.Module, ModuleInfo]) -> list[dict[str, Any]]:
    """The watched modules as ``hello`` announces them, in execution order."""
    return [
        {
            "name": info.name,
            "type": info.type,
            "order": info.index,
            "params": sum(p.numel() for p in module.parameters(recurse=False)),
        }
        for module, info in infos.items()
    ]


def is_allowed(name: str, type_name: str, patterns: Iterable[str]) -> bool:
    """Whether a module may emit -inf on purpose (glob on name or type name)."""
    return any(fnmatch.fnmatchcase(name, p) or p == type_name for p in patterns)


def module_table(
    root: nn.Module, wrapped: bool, allow: tuple[str, ...]
) -> dict[nn.Module, ModuleInfo]:
    """A :class:`ModuleInfo` per module, in definition order (the table's order)."""
    names = module_names(root, wrapped)
    containers = {n for m, n in names.items() if isinstance(m, (nn.ModuleList, nn.ModuleDict))}
    infos: dict[nn.Module, ModuleInfo] = {}
    by_name: dict[str, ModuleInfo] = {}
    for index, (module, name) in enumerate(names.items()):
        info = ModuleInfo(name, module, index, is_allowed(name, type_name(module), allow))
        infos[module] = by_name[name] = info
    for module, info in infos.items():
        if module is not root:
            info.parent = _caller(info.name, by_name, infos[root], containers)
    return infos


def _caller(
    name: str, by_name: dict[str, ModuleInfo], root: ModuleInfo, containers: set[str]
) -> ModuleInfo:
    """The nearest ancestor with a forward of its own (skips ModuleList/Dict)."""
    parts = name.split(".")
    while len(parts) > 1:
        parts.pop()
        parent = ".".join(parts)
        if parent in by_name and parent not in containers:
            return by_name[parent]
    return root


def proxy_bias(root: nn.Module, infos: dict[nn.Module, ModuleInfo]) -> dict[nn.Module, Tensor]:
    """Modules whose output gradient can be read from their bias, and that bias.

    The bias must be trained (it gets a gradient) and belong to that module
    alone (a shared bias sums several modules' gradients). Allow-listed
    modules keep their real probe.
    """
    owners: dict[int, int] = {}
    for module in root.modules():
        for p in module._parameters.values():
            if p is not None:
                owners[id(p)] = owners.get(id(p), 0) + 1
    found: dict[nn.Module, Tensor] = {}
    for module, info in infos.items():
        bias = getattr(module, "bias", None)
        if (
            type(module) in BIAS_IS_OUTPUT_SUM
            and runs_as(module, (type(module),))
            and not info.allow_neginf
            and isinstance(bias, nn.Parameter)
            and bias.requires_grad
            and bias.is_floating_point()
            and owners.get(id(bias)) == 1
        ):
            found[module] = bias
    return found


class Chains:
    """What the data flow of exact ``nn.Sequential`` containers makes certain.

    ``nn.Sequential.forward`` hands each child's output to the next child and
    nothing else, so there:

    - a finite-preserving child followed by a probed leaf needs no hook at all
      (``unhooked``): it cannot make anything non-finite, the leaf's input is
      its output and not inline code, and when it masks (ReLU), a leaf with a
      benign backward needs no gradient probe between them;
    - that leaf need not examine its input (``trusting``).

    Only for modules registered once in the model: a module that is also used
    elsewhere keeps every check.
    """

    def __init__(self, root: nn.Module, infos: dict[nn.Module, ModuleInfo]) -> None:
        self.unhooked: set[nn.Module] = set()
        self.trusting: set[nn.Module] = set()
        self._uses: dict[int, int] = {}
        for _, module in root.named_modules(remove_duplicate=False):
            self._uses[id(module)] = self._uses.get(id(module), 0) + 1
        for seq in infos:
            if type(seq) is not nn.Sequential:
                continue
            children = list(seq._modules.values())  # call order, repeats included
            for i, (before, after) in enumerate(itertools.pairwise(children)):
                feeder = infos.get(children[i - 1]) if i > 0 else None
                if feeder is not None and feeder.masking:
                    continue  # its gradient probe is handed on through ``before``'s hook
                if self._chained(before, after, infos):
                    assert before is not None and after is not None
                    self.unhooked.add(before)
                    self.trusting.add(after)

    def once(self, module: nn.Module) -> bool:
        """Whether ``module`` is registered once in the model (called from one place)."""
        return self._uses.get(id(module), 0) == 1

    def _chained(
        self,
        before: nn.Module | None,
        after: nn.Module | None,
        infos: dict[nn.Module, ModuleInfo],
    ) -> bool:
        if before is None or after is None:
            return False
        first, second = infos.get(before), infos.get(after)
        if first is None or second is None or not first.safe or first.allow_neginf:
            return False
        if not _probed_leaf(second) or (first.masking and not second.benign):
            return False
        return self.once(before) and self.once(after)


def _probed_leaf(info: ModuleInfo | None) -> bool:
    """A leaf that probes its own output (not a finite-preserving one)."""
    return info is not None and info.leaf and not info.safe
