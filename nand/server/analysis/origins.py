"""A run's non-finite origin and its events as REST bodies: stored rows to
``nand.events.Event`` and to the ``nand.server.schemas`` shapes, with correlation."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from nand.events import Event, cause_of, phase_of, value_kinds
from nand.server.analysis import correlate
from nand.server.schemas.events import EventOut, Origin
from nand.server.storage.models import EventRow, Rank
from nand.wire import json_safe

RankRows = Sequence[tuple[Rank, EventRow | None]]


def to_event(row: EventRow, run: str = "") -> Event:
    event = _event_fields(row, run)
    if "NaN" in row.kinds and event.nan is None:
        # SQLite stored the NaN min/max as NULL; the kinds kept at ingest say it was NaN.
        event.min = event.min if event.min is not None else math.nan
        event.max = event.max if event.max is not None else math.nan
    return event


def _event_fields(row: EventRow, run: str) -> Event:
    return Event(
        run=run,
        rank=row.rank,
        world_size=row.world_size,
        host=row.host,
        pid=row.pid,
        step=row.step,
        micro_step=row.micro_step,
        phase=phase_of(row.phase),
        module=row.module,
        module_type=row.module_type,
        order=row.ord,
        cause=cause_of(row.cause),
        call=row.call,
        nan=row.nan,
        posinf=row.posinf,
        neginf=row.neginf,
        min=row.min,
        max=row.max,
        max_abs=row.max_abs,
        shape=list(row.shape or []),
        dtype=row.dtype,
        time=row.time,
        seq=row.seq,
        message=row.message,
        op=row.op,
        source=row.source,
        reproduced=row.reproduced,
        replay=row.replay,
        via=row.via,
    )


def event_out(row: EventRow, run: str, event: Event | None = None) -> EventOut:
    """``event``: the row as :func:`to_event` makes it, when the caller has it already."""
    event = event if event is not None else to_event(row, run)
    # JSON has no NaN/inf: ``values`` keeps in words what min/max said.
    return EventOut(id=row.id, values=value_kinds(event), **_fields(event))


#: An event's field names. Its fields are flat (``shape`` a list of ints), so a
#: page of 500 ranks need not pay for ``dataclasses.asdict``'s deep copy (two
#: thirds of a /ranks page's time at 100,000 ranks) nor for ``json_safe``'s
#: walk of every value (a sixth of what was left).
_FIELDS = tuple(field.name for field in dataclasses.fields(Event))


def _fields(event: Event) -> dict[str, Any]:
    """The event's fields, JSON-safe: a NaN or infinite float as None."""
    fields = {name: getattr(event, name) for name in _FIELDS}
    for name, value in fields.items():
        if isinstance(value, float) and not math.isfinite(value):
            fields[name] = None
    return fields


def origin_row(ranks: RankRows) -> EventRow | None:
    firsts = [e for _, e in ranks if e is not None]
    head = correlate.origin([to_event(e) for e in firsts])
    return next((e for e in firsts if head is not None and e.rank == head.rank), None)


def origin_out(row: EventRow, ranks: RankRows, together: list[int] | None = None) -> Origin:
    """The origin; with several ranks at the same point, ``rank`` is null (none was first).
    ``together``: those ranks, when known (else found among ``ranks``)."""
    event = to_event(row)
    fields = json_safe(event.to_dict())
    shared = {name: fields[name] for name in Origin.model_fields if name in fields}
    if together is None:
        together = correlate.first_ranks([to_event(e) for _, e in ranks if e is not None])
    shared["rank"] = event.rank if len(together) <= 1 else None
    return Origin(event_id=row.id, values=value_kinds(event), ranks=together, **shared)
