"""The step boundary of one watch, built with its collaborators (``Watch.__init__``).

Everything the :class:`~nand.agent.step.boundary.Boundary` works with is
known when the watch is made, so it is handed over here, once: the optimizer's
parameters (the slow path of a forward finding), the compiled probes' slots,
the DDP replicas' fingerprints, whether ranks agree on each step's flag and
whether it reads one step late. Only what is found while the loop runs is
learnt later: the wrapper (``Boundary.wrapped_in``), a framework's GradScaler
(``Boundary.amp``) and the loss (``Boundary.losses``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from nand.agent.detect.compiled import CompiledSlots
from nand.agent.detect.modules import ModuleInfo
from nand.agent.detect.names import param_owners
from nand.agent.detect.param_cache import ParamCache
from nand.agent.detect.probes import ProbeBuffer
from nand.agent.identity import distributed_up
from nand.agent.output.session import Session
from nand.agent.step.boundary import Boundary
from nand.agent.step.fingerprint import Fingerprints
from nand.agent.step.recorder import FlightRecorder
from nand.config import AgentConfig


def param_cache(
    settings: AgentConfig,
    optimizer: Any,
    root: nn.Module,
    infos: dict[nn.Module, ModuleInfo],
    wrapped: bool,
) -> ParamCache | None:
    """The optimizer's parameters by name, for its hooks and for the boundary
    (None: no optimizer, or a watch that is disabled)."""
    if optimizer is None or settings.disabled:
        return None
    owners = {module: (info.name, info.type) for module, info in infos.items()}
    return ParamCache(optimizer, param_owners(root, owners, wrapped))


def build_boundary(
    settings: AgentConfig,
    session: Session,
    *,
    root: nn.Module,
    buf: ProbeBuffer,
    recorder: FlightRecorder,
    slots: CompiledSlots,
    optimizer: Any,
    params: ParamCache | None,
    read: tuple[bool, bool],
) -> Boundary:
    """``read``: (deferred, skip on the device), from ``deferred.read_mode``.

    Disabled (``NAND_DISABLE``), nothing distributed is looked at: the
    boundary is never called."""
    who, deferred, on_device = session.who, *read
    agrees = settings.on_nonfinite.agrees_across_ranks and who.world_size > 1
    live = not settings.disabled
    return Boundary(
        buf,
        who=who,
        recorder=recorder,
        root_type=type(root).__name__,
        agree=live and agrees and distributed_up(),
        slots=slots,
        params=params,
        fingerprints=Fingerprints.wanted(settings, root, session, optimizer) if live else None,
        deferred=deferred,
        skip_on_device=on_device,
    )
