"""The event model shared by the agent, the wire, the server and the tests.

An :class:`Event` says where a non-finite value was seen on one rank. Events
are ordered *logically*, never by wall clock::

    (step, micro_step, phase, order)

with phases in the order of :data:`PHASES`. The server uses the same key across
ranks, so "first" means the same thing everywhere.

This module imports nothing heavy (no torch, no FastAPI): both a training job
and a server host import it.

>>> e = Event(run="r1", rank=0, step=3, phase="forward", module="fc1")
>>> e.sort_key() < Event(run="r1", rank=0, step=3, phase="backward").sort_key()
True
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

#: Where in a training step a value was checked, in execution order.
#:
#: - ``input``: data entering the root module (positional and keyword args)
#: - ``forward``: a module's output
#: - ``loss``: the gradient arriving at the model's output is non-finite although
#:   the forward was finite (the loss computation outside the model made it)
#: - ``backward``: a gradient flowing out of a module (w.r.t. its input)
#: - ``grad``: a parameter's ``.grad`` after backward, before the optimizer step
#: - ``param``: a parameter after ``optimizer.step()``
#: - ``optimizer_state``: an optimizer state tensor (e.g. Adam's ``exp_avg_sq``)
Phase = Literal["input", "forward", "loss", "backward", "grad", "param", "optimizer_state"]
PHASES: tuple[Phase, ...] = get_args(Phase)
PHASE_RANK: dict[str, int] = {name: i for i, name in enumerate(PHASES)}

#: Why the value was non-finite, as far as this rank can tell.
#:
#: - ``data``: the input batch already held it
#: - ``produced``: non-finite output out of finite inputs (this is the origin)
#: - ``propagated``: a non-finite input made a non-finite output
#: - ``received``: it arrived through a collective (all-reduce, all-gather)
Cause = Literal["data", "produced", "propagated", "received"]
CAUSES: tuple[Cause, ...] = get_args(Cause)

#: A run's state on the server: that of its first failure in time (see
#: ``nand.server.analysis.failures``). ``replica_mismatch``: everything is
#: finite, but one DDP rank's parameters differ from the other replicas'
#: (``nand.server.analysis.replicas``).
RunState = Literal[
    "healthy", "diverged", "stalled", "finished", "lost", "crashed", "replica_mismatch"
]
RUN_STATES: tuple[RunState, ...] = get_args(RunState)

#: One rank's state on the server.
RankState = Literal["running", "diverged", "finished", "lost", "stalled", "crashed"]
RANK_STATES: tuple[RankState, ...] = get_args(RankState)

#: How a rank's first event relates to the run's origin (``nand.server.analysis.correlate``).
Relation = Literal["origin", "simultaneous", "received", "produced"]
RELATIONS: tuple[Relation, ...] = get_args(Relation)

#: The collectives a ``received`` value can come through (``Event.via``), in
#: the words the verdict says them: "rank 0 received it through <via>".
#: Defined once here for the agent (which sets them) and the server (whose
#: fallback for an event without one names the collective its phase implies).
#: A newer agent may send words not listed; they are shown as sent.
VIA_GRAD_ALL_REDUCE = "the gradient all-reduce"  # (DDP's; FSDP's reduce-scatter too)
VIA_FSDP_ALL_GATHER = "FSDP's parameter all-gather"
VIA_ZERO_BROADCAST = "ZeRO's parameter broadcast"  # (ZeroRedundancyOptimizer's, after step)
VIA_TP_ALL_REDUCE = "the tensor-parallel all-reduce"  # (a row-parallel layer's output)
VIA_TP_GRAD_ALL_REDUCE = "the tensor-parallel all-reduce of the input gradient"
#: A pipeline stage's neighbour sent it (an activation forward, a gradient back).
VIA_PIPELINE = "the pipeline's send/recv from stage {}"  # (.format(the sending stage))

#: Why an agent dropped messages before the server had them (its transport
#: counts them and sends the cumulative counts in every heartbeat as ``dropped``):
#:
#: - ``queue_full``: the in-memory hand-off queue was full (``NAND_QUEUE_MAX``)
#: - ``spool_full``: the disk spool was full and compacted (``NAND_SPOOL_MAX_BYTES``)
#: - ``disk_full``: the disk under the spool was full, and memory could hold no more
#: - ``spool_error``: the spool could not be written
#: - ``too_large``: one message was larger than a frame may be
#: - ``encode_error``: a message could not be encoded
#: - ``rejected``: the server rejected the agent (a bad token), which stopped sending
#: - ``closed``: a message came after the agent was closed
#: - ``commands_full``: the server's commands piled up unread on the agent
#:
#: A newer agent may send a reason not listed here; the wire accepts it if it
#: is a short identifier, the REST API shows it as sent and ``/metrics`` counts
#: it as ``other``.
DropReason = Literal[
    "queue_full",
    "spool_full",
    "disk_full",
    "spool_error",
    "too_large",
    "encode_error",
    "rejected",
    "closed",
    "commands_full",
]
DROP_REASONS: tuple[DropReason, ...] = get_args(DropReason)


#: What an early warning is about (``nand.agent.step.blowup``, ``nand.server``):
#:
#: - ``loss_spike``: the loss jumped well above its recent values
#: - ``grad_growth``: the gradient norm grew by an order of magnitude or more
#: - ``headroom``: an activation came within 2x of its dtype's largest value
#: - ``grad_outlier``: one rank's own gradients stood out from the other ranks'
WarningKind = Literal["loss_spike", "grad_growth", "headroom", "grad_outlier"]
WARNING_KINDS: tuple[WarningKind, ...] = get_args(WarningKind)


def phase_of(value: str) -> Phase:
    """``value`` as a :data:`Phase` (stored values were checked on the wire)."""
    for phase in PHASES:
        if phase == value:
            return phase
    raise ValueError(f"unknown phase {value!r}; known: {', '.join(PHASES)}")


def cause_of(value: str) -> Cause:
    """``value`` as a :data:`Cause` (stored values were checked on the wire)."""
    for cause in CAUSES:
        if cause == value:
            return cause
    raise ValueError(f"unknown cause {value!r}; known: {', '.join(CAUSES)}")


@dataclass(kw_only=True)
class Event:
    """One non-finite observation on one rank.

    ``module`` is the qualified module name as the user wrote it (``""`` for
    the root module) or, for ``grad``/``param``/``optimizer_state``, the
    qualified parameter name (``optimizer_state`` appends ``:<state key>``,
    e.g. ``"fc1.weight:exp_avg_sq"``).

    The value statistics (``nan``, ``posinf``, ``neginf``, ``min``, ``max``,
    ``max_abs``) are filled by the slow path that runs only once something was
    found; any of them may be ``None`` when it was not computed.
    """

    run: str = ""
    rank: int = 0
    world_size: int = 1
    host: str = ""
    pid: int = 0
    step: int = 0
    micro_step: int = 0
    phase: Phase = "forward"
    module: str = ""
    module_type: str = ""
    order: int = 0
    cause: Cause = "produced"
    #: For a ``received`` value: the collective it came through (``VIA_*``
    #: above; "" when the agent could not tell, or for a value made here).
    via: str = ""
    nan: int | None = None
    posinf: int | None = None
    neginf: int | None = None
    min: float | None = None
    max: float | None = None
    max_abs: float | None = None
    shape: list[int] = field(default_factory=list)
    dtype: str = ""
    time: float = field(default_factory=time.time)
    seq: int = 0
    #: How many times this module had already run in this micro-step
    #: (0 for the first call); reused modules are called several times.
    call: int = 0
    #: A one-line human summary; filled by the agent, shown by log and web.
    message: str = ""
    #: The replay of the step (``nand.agent.rerun``): the aten op that made
    #: the value (``aten::log``), the user's line that ran it (``path:line``;
    #: in backward, the forward line its node came from), whether the replay
    #: made the value again (None: not replayed), and what was replayed or why not.
    op: str = ""
    source: str = ""
    reproduced: bool | None = None
    replay: str = ""

    def sort_key(self) -> tuple[int, int, int, int]:
        """The logical order: (step, micro_step, phase, order)."""
        return (self.step, self.micro_step, PHASE_RANK.get(self.phase, len(PHASES)), self.order)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Event:
        """Build an event from a mapping, ignoring keys this version does not know.

        Unknown keys are dropped so that a newer agent can talk to an older
        server; type checking of the values is the wire decoder's job.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        if "shape" in kwargs and kwargs["shape"] is not None:
            kwargs["shape"] = list(kwargs["shape"])
        return cls(**kwargs)

    def where(self) -> str:
        """The module, as a sentence names it: ``layers.0.act (Act)``, ``<root>``."""
        where = self.module or "<root>"
        return f"{where} ({self.module_type})" if self.module_type else where

    def describe(self, shape: str | None = None) -> str:
        """A sentence a person can act on, e.g. for the log. ``shape``: what to
        say instead of the shape (one that was not recorded)."""
        where = self.where()
        kinds = value_kinds(self)
        how = {
            "data": "arrived in the input data",
            "produced": "was produced here from finite inputs",
            "propagated": "came from a non-finite input",
            "received": f"was received through {self.via or 'a collective'}",
        }.get(self.cause, self.cause)
        step = f"step {self.step}" + (f".{self.micro_step}" if self.micro_step else "")
        shape = shape or "x".join(str(d) for d in self.shape) or "scalar"
        return (
            f"rank {self.rank}: {kinds} in {self.phase} of {where} at {step} "
            f"[{shape} {self.dtype}]; it {how}"
        )


def value_kinds(event: Event) -> str:
    """What the values were, in words: ``"NaN"``, ``"+inf x3"``, ``"NaN and -inf"``...

    Counts win when the agent computed them (parameters, gradients, state).
    Activations are gone by the time anything is read, so their events carry
    only the NaN-propagating min and max of one ``aminmax``: an infinite max
    means +inf, an infinite min -inf, a NaN min/max means NaN was there.
    """
    if any(count is not None for count in (event.nan, event.posinf, event.neginf)):
        counted = [(event.nan, "NaN"), (event.posinf, "+inf"), (event.neginf, "-inf")]
        parts = [f"{name} x{n}" if n > 1 else name for n, name in counted if n]
    else:
        lo, hi = event.min, event.max
        nan = any(v is not None and math.isnan(v) for v in (lo, hi))
        found = [(nan, "NaN"), (hi == math.inf, "+inf"), (lo == -math.inf, "-inf")]
        parts = [name for present, name in found if present]
    return " and ".join(parts) if parts else "a non-finite value"


def replay_words(event: Event) -> str:
    """What the replay of ``event``'s step found, in words ("" without one)."""
    where = f"{event.op} at {event.source or 'an unknown line'}" if event.op else ""
    if event.reproduced is None:
        return event.replay
    if not event.reproduced:
        return "the replay did not make it again: suspect the device (a transient fault)"
    if event.phase == "input":
        return "the replay saw it again: it is in the batch"
    look = "the loss computation" if event.phase == "loss" else "the layer"
    if not where:
        return f"the replay made it again (look at the batch, {look})"
    return f"made by {where}; the replay made it again (look at the batch, {look})"


@dataclass(kw_only=True)
class StepSummary:
    """What a heartbeat says about the training progress of one rank.

    Every figure is optional: the agent never forces a host sync to get one.
    ``loss`` is known only when the user called ``watch.loss(loss)``.
    """

    step: int = 0
    steps_per_s: float | None = None
    loss: float | None = None
    grad_norm: float | None = None
    max_activation: float | None = None
    amp_skipped: int = 0
    amp_scale: float | None = None
    #: DDP: ``(step, norm)`` of this rank's own gradients before the
    #: all-reduce, for the steps since the last heartbeat (the server compares
    #: the ranks: ``nand.server.analysis.outliers``).
    local_grad_norms: list[tuple[int, float]] | None = None

    def to_dict(self) -> dict[str, Any]:
        """What ``dataclasses.asdict`` gives (the norms copied, pairs and all),
        without its generic deep copy: that was a third of what a heartbeat
        cost the agent's training thread."""
        out = dict(self.__dict__)
        norms = self.local_grad_norms
        if norms is not None:
            out["local_grad_norms"] = type(norms)(copy.copy(pair) for pair in norms)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepSummary:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(kw_only=True)
class FlightWindow:
    """The telemetry of the last N steps before an incident ("flight recorder").

    Step-major matrices: ``act_max_abs[i][j]`` is the max |x| of the output of
    ``modules[j]`` during ``steps[i]`` (``None`` when the module did not run);
    ``grad_max_abs`` is the same for the gradient flowing out of the module.
    ``grad_norm[i]`` is the total 2-norm of the parameter gradients of step i,
    ``loss[i]`` the loss when known. ``dtype_max`` is the largest finite value
    of the activations' dtype (65504 for float16), so a viewer can show how
    close the values came to overflowing.
    """

    steps: list[int] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)
    act_max_abs: list[list[float | None]] = field(default_factory=list)
    grad_max_abs: list[list[float | None]] = field(default_factory=list)
    grad_norm: list[float | None] = field(default_factory=list)
    loss: list[float | None] = field(default_factory=list)
    dtype: str = ""
    dtype_max: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FlightWindow:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def finite_or_none(value: float | None) -> float | None:
    """JSON has no NaN/inf: map them to None for JSON outputs."""
    if value is None or not math.isfinite(value):
        return None
    return value


@dataclass(kw_only=True)
class Alert:
    """An early warning on one rank: still finite, but heading for trouble.

    "Warning" is the one name users see (``on_warning``, ``nand.EarlyWarning``,
    the wire kind ``warning``, ``GET /api/runs/{run}/warnings``); this class is
    the record of one, named ``Alert`` so as not to shadow Python's ``Warning``.
    Never an incident: it does not make a run diverged. ``value`` is what was
    seen (the loss, the gradient norm, the activation's max|x|) and
    ``reference`` what it was compared with (the recent maximum or median, the
    dtype's limit).
    """

    kind: WarningKind
    step: int
    rank: int = 0
    module: str = ""
    value: float | None = None
    reference: float | None = None
    message: str = ""
    time: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
