"""What the analysis of a step finds (:class:`Finding`) and what it reads the
window's entries from (:class:`Probed`): apart from ``analysis.py`` so that
the helpers it calls (``handoff.py``) can name them without importing it."""

from __future__ import annotations

import dataclasses
from typing import Protocol

from torch import Tensor

from nand.agent.detect.probes import Site
from nand.agent.detect.stage import Handoff
from nand.events import Cause, Phase


@dataclasses.dataclass(slots=True, kw_only=True)
class Finding:
    """The logically first non-finite entry of a step."""

    site: Site
    phase: Phase
    module: str
    module_type: str
    micro: int
    order: int
    call: int = 0  # the module's calls before this one in its micro-step
    lo: float
    hi: float
    cause: Cause
    tensor: Tensor | None = None  # norm entries: the tensor to count on
    #: What was checked when it was less than usual (under torch.compile).
    note: str = ""
    via: str = ""  # a received value: the collective it came through (Event.via)


class Probed(Protocol):
    """Where a window's values came from: a :class:`ProbeBuffer`, or what a
    deferred read kept of one (``boundary.Window``)."""

    @property
    def sites(self) -> list[Site | None]: ...

    @property
    def norm_sites(self) -> list[Site]: ...

    @property
    def pipeline(self) -> Handoff | None: ...
