"""What a :class:`~nand.agent.watch.Watch` tells of the run so far.

The read-only members of a watch (the first event, the incidents, the
counts, the flight recorder's window and a heartbeat's summary) are views
over the parts the watch wired: its incidents, the step boundary, the
GradScaler watch and the flight recorder. They read and never act, so they
live apart from the wiring and the step boundaries of ``watch.py``, in the
:class:`Readout` the watch is made from.
"""

from __future__ import annotations

from nand.agent.detect.amp import AmpWatch
from nand.agent.step.boundary import Boundary
from nand.agent.step.incidents import Incidents
from nand.agent.step.recorder import FlightRecorder
from nand.events import Event, FlightWindow, StepSummary

__all__ = ["Readout"]


class Readout:
    """The read-only members of a watch; :class:`~nand.agent.watch.Watch`
    sets the parts they read."""

    step: int
    recorder: FlightRecorder
    _incidents: Incidents
    _boundary: Boundary
    _amp: AmpWatch | None
    _closed: bool

    @property
    def first(self) -> Event | None:
        """The first non-finite event on this rank."""
        return self._incidents.first

    @property
    def events(self) -> list[Event]:
        """Incidents on this rank, oldest first; the first one is always kept."""
        return self._incidents.events

    @property
    def nonfinite_steps(self) -> int:
        """Steps read non-finite so far (an incident's later steps included)."""
        return self._incidents.nonfinite_steps

    @property
    def amp_skipped(self) -> int:
        """Overflow steps the GradScaler skipped (not incidents)."""
        return self._amp.skipped if self._amp is not None else 0

    @property
    def host_reads(self) -> int:
        """Host reads nand did so far (one per optimizer step at most)."""
        return self._boundary.reads

    @property
    def deferred(self) -> bool:
        """Whether each step is read one boundary late (``read=``, see the README)."""
        return self._boundary.deferred is not None

    @property
    def closed(self) -> bool:  # (close() ran, or the watch is disabled)
        return self._closed

    @property
    def read_waits(self) -> int:
        """Deferred reads that had to wait for their copy (the device a step behind)."""
        return self._boundary.deferred.waits if self._boundary.deferred is not None else 0

    def flight_window(self) -> FlightWindow:
        """The flight recorder: per-module telemetry of the last steps."""
        return self.recorder.window()

    def _summary(self, steps_per_s: float) -> StepSummary:  # (a heartbeat's)
        return self.recorder.summary(self.step, steps_per_s, self._amp)
