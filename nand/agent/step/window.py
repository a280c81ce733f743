"""What one step boundary hands on: the :class:`Outcome` the caller acts on,
and the :class:`Window` the analysis reads a window's values with."""

from __future__ import annotations

from copy import copy
from dataclasses import dataclass, field

from torch import Tensor

from nand.agent.detect.probes import Site
from nand.agent.detect.stage import Handoff
from nand.agent.detect.tensor_parallel import Partial
from nand.events import Alert, Event


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """What one boundary found that the caller acts on (what it read stays
    on the boundary: ``row``, ``micro_steps``)."""

    event: Event | None = None  # this window's first verified non-finite entry
    any_rank_bad: bool = False  # agreed across ranks (skip/stop with a process group)
    overflow: bool = False  # an AMP overflow step, skipped by the scaler (not an incident)
    alerts: tuple[Alert, ...] = ()  # early warnings of a clean step (``blowup.py``)


@dataclass(slots=True, kw_only=True)
class Window:
    """What the analysis of one window needs besides its values, taken from
    the probe buffer when the window closed (deferred, the buffer holds the
    next window by the time this one is read)."""

    step: int
    prev_step: int
    prev_micro: int
    skipped: bool  # the scaler skipped this step (overflow)
    record: bool
    micro_base: int
    sites: list[Site | None]
    norm_sites: list[Site]
    n_pairs: int  # values that are (min, max) pairs: the slab's and compiled slots'
    n_norms: int
    spans: dict[str, tuple[int, int]]  # "grad"/"param" spans among the norms
    compiled: bool  # probed under torch.compile (see compiled.py)
    grads_scaled: bool  # the .grad norms still carry the loss scale
    lagged: bool  # read one boundary late: its tensors have moved on
    #: This rank's own parts of tensor-parallel reductions (``detect.tensor_parallel``).
    partials: list[Partial] = field(default_factory=list)
    pipeline: Handoff | None = None  # a pipeline stage's micro-batch marks (``handoff.py``)
    #: The losses of the window, in backward order, with their marks, and its
    #: micro-steps (``losses.py``).
    losses: tuple[list[Tensor], list[int]] = field(default_factory=lambda: ([], []))
    micro_steps: int = 0

    def __post_init__(self) -> None:  # the buffer's marks start afresh at its clear: keep these
        self.pipeline = copy(self.pipeline)


#: A window with nothing to act on: the common case, one shared value.
HEALTHY = Outcome()

#: The phases a loss scaler's overflow makes non-finite: the gradients of the
#: scaled loss. A non-finite input, output, weight or optimizer state in a
#: window the scaler skipped is an incident all the same.
SCALED_PHASES = frozenset({"loss", "backward", "grad"})
