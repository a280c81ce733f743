"""One message of every agent kind, sent through a real ``ServerSink`` and found
again through a real server's REST API (used by ``test_delivery_paths``, also
in the processes it starts and kills).

``SEND`` and ``FIND`` each hold one function per kind of ``nand.wire.AGENT_KINDS``;
a test fails while a new kind has none, so every kind goes through every path.
Each message carries values found nowhere else, so finding it means that very
message was stored.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from nand import wire
from nand.agent.identity import Identity
from nand.agent.transport.server_sink import ServerSink
from nand.client import ApiError, request_json, run_url
from nand.events import Alert, Event, FlightWindow, StepSummary

HOST = "matrix-host"
STEP = 6  # the step every message of the matrix speaks of
PARAMS = ["fc.weight", "fc.bias"]
PRINT = [11, -22]  # the parameters' fingerprint
FLIGHT = FlightWindow(
    steps=[STEP - 1, STEP], modules=["fc"], act_max_abs=[[1.5], [2.5]], grad_max_abs=[[0.5], [0.75]]
)


def identity(run: str, pid: int | None = None) -> Identity:
    """Rank 0 of two: rank 1 (``FakeAgent``) sends the other fingerprint."""
    return Identity(run=run, rank=0, local_rank=0, world_size=2, host=HOST, pid=pid or os.getpid())


SEND: dict[str, Callable[[ServerSink, str], None]] = {
    "hello": lambda sink, run: sink.hello({"modules": [{"name": "fc", "type": "Linear"}]}),
    "event": lambda sink, run: sink.event(
        Event(run=run, step=STEP, phase="forward", module="matrix.fc", nan=3), None
    ),
    "heartbeat": lambda sink, run: sink.heartbeat(StepSummary(step=STEP, loss=0.125)),
    "flight": lambda sink, run: sink.flight(FLIGHT, "asked"),
    "fingerprint": lambda sink, run: sink.fingerprint(STEP, PARAMS, PRINT, []),
    "warning": lambda sink, run: sink.alert(
        Alert(kind="loss_spike", step=STEP, value=9.0, reference=1.0, message="matrix")
    ),
    "bye": lambda sink, run: sink.bye(STEP, "matrix"),
}


def send_all(
    sink: ServerSink,
    run: str,
    after_hello: Callable[[], None] = lambda: None,
    before_bye: Callable[[], None] = lambda: None,
) -> None:
    """One message of each kind: hello first, bye last, the others in the wire's order."""
    SEND["hello"](sink, run)
    after_hello()
    for kind in wire.AGENT_KINDS:
        if kind not in ("hello", "bye"):
            SEND[kind](sink, run)
    before_bye()
    SEND["bye"](sink, run)


def _get(base: str, run: str, suffix: str) -> Any:
    try:
        return request_json(run_url(base, run, suffix))
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise


def _rank0(base: str, run: str) -> dict[str, Any]:
    page = _get(base, run, "/ranks") or {"items": []}
    return next((r for r in page["items"] if r["rank"] == 0), {})


def _flight_found(base: str, run: str) -> bool:
    flight = _get(base, run, "/flight?rank=0")
    return flight is not None and flight["steps"] == FLIGHT.steps


def _heartbeat_found(base: str, run: str) -> bool:
    series = _get(base, run, "/series?points=5000") or []
    points = [p for s in series if s["rank"] == 0 for p in s["points"]]
    return any((p["step"], p["loss"]) == (STEP, 0.125) for p in points)


def _fingerprint_found(base: str, run: str) -> bool:
    replica = (_get(base, run, "/verdict") or {}).get("replica") or {}
    return (replica.get("state"), replica.get("last_good_step")) == ("consistent", STEP)


FIND: dict[str, Callable[[str, str], bool]] = {
    "hello": lambda base, run: _rank0(base, run).get("host") == HOST,
    "event": lambda base, run: any(
        e["module"] == "matrix.fc" and e["rank"] == 0
        for e in (_get(base, run, "/events") or {"items": []})["items"]
    ),
    "heartbeat": _heartbeat_found,
    "flight": _flight_found,
    "fingerprint": _fingerprint_found,
    "warning": lambda base, run: any(
        (w["kind"], w["step"], w["message"]) == ("loss_spike", STEP, "matrix")
        for w in _get(base, run, "/warnings") or []
    ),
    "bye": lambda base, run: _rank0(base, run).get("bye_reason") == "matrix",
}


def missing(base: str, run: str) -> list[str]:
    """The kinds whose message the server does not have."""
    return [kind for kind in wire.AGENT_KINDS if not FIND[kind](base, run)]
