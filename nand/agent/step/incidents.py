"""One message per incident: the first event of a run of non-finite steps.

A NaN usually stays: every step after the first is non-finite too. Those
steps are counted, not reported again, until a finite step ends the incident.
The first event of the rank is kept for good; later incidents are kept up to
a bound.
"""

from __future__ import annotations

from collections import deque

from nand.events import Event


class Incidents:
    def __init__(self, max_events: int) -> None:
        self.first: Event | None = None
        self.nonfinite_steps = 0
        self._kept: deque[Event] = deque(maxlen=max(1, max_events - 1))
        self._open = False  # the last step read was non-finite

    def finite_step(self) -> None:
        self._open = False

    def nonfinite_step(self, event: Event) -> bool:
        """Count a non-finite step; whether it starts a new incident (report it)."""
        self.nonfinite_steps += 1
        if self._open:
            return False
        self._open = True
        if self.first is None:
            self.first = event
        self._kept.append(event)
        return True

    @property
    def events(self) -> list[Event]:
        """Oldest first; the first one is always kept."""
        rest = [e for e in self._kept if e is not self.first]
        return ([self.first] if self.first is not None else []) + rest
