"""A pipeline stage's place in the pipeline (:class:`Handoff`), as the probe
buffer holds it: the lowest layer, so that the buffer (``probes.py``), the
stage's listener (``pipeline.py``) and the analysis (``step/handoff.py``) can
all name it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class Handoff:
    """A stage's place in the pipeline and, for the window being filled,
    ``marks``: (position in ``ProbeBuffer.sites``, micro-batch index) where
    each chunk's entries begin."""

    stage: int
    stages: int
    marks: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1
