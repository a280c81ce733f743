"""The agent's outputs: identity, sinks, heartbeats and server commands.

Every sink call is guarded: a failing sink is logged once and dropped, never
raised into the training loop. Sinks are called at step boundaries only.

Calls, in order: ``hello(info)`` once from ``nand.watch``; ``event(event,
flight)`` when an incident starts (the flight window rides along);
``heartbeat(summary)`` every ``NAND_HEARTBEAT_S`` seconds at a step end, built
from figures already read (never an extra sync); ``commands()`` at every
optimizer step boundary (``{"command": "stop", "step": S}`` makes
``optimizer.step()`` raise :class:`nand.StopRequested` once ``watch.step >= S``;
``{"command": "send_flight"}`` answers with ``flight(window, "requested")``);
``bye(step, reason)`` then ``close(timeout)`` from ``watch.close()``.
"""

from __future__ import annotations

import logging
import platform
import sys
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import torch

import nand
from nand import cadence
from nand.agent.identity import Identity, resolve_identity
from nand.agent.output.sinks import JsonlSink, LogSink, server_sink
from nand.agent.sink import Sink
from nand.config import AgentConfig
from nand.events import Alert, Event, FlightWindow, StepSummary

log = logging.getLogger("nand")


class Session:
    def __init__(
        self, who: Identity, sinks: list[Sink], settings: AgentConfig | None = None
    ) -> None:
        self.who = who
        self.settings = settings or AgentConfig()
        self.sinks: list[Sink] = []
        #: A sink takes heartbeats and commands (see ``Sink.per_step``).
        self.per_step = False
        for sink in sinks:
            self.add_sink(sink)
        self.stop_at: int | None = None
        # A big job's ranks report less often (nand.cadence: one rule with the server).
        self.heartbeat_s = cadence.heartbeat_s(self.settings.heartbeat_s, who.world_size)
        self._last_beat = time.monotonic()
        self._last_step = 0

    def add_sink(self, sink: Sink) -> None:
        self.sinks.append(sink)
        self._sinks_changed()

    def _sinks_changed(self) -> None:
        self.per_step = any(getattr(sink, "per_step", True) for sink in self.sinks)

    @classmethod
    def open(cls, settings: AgentConfig) -> Session:
        """This rank's identity and the sinks ``settings`` ask for."""
        who = resolve_identity(settings.run)
        sinks: list[Sink] = [LogSink()] if settings.log_events else []
        if settings.events_file:
            sinks.append(JsonlSink(settings.events_file, who.rank))
        if settings.server:
            remote = server_sink(settings.server, who, settings.transport)
            if remote is not None:
                sinks.append(remote)
        return cls(who, sinks, settings)

    def hello(
        self, device: str, modules: list[dict[str, Any]], optimizer: str | None, policy: str
    ) -> None:
        """Announce this rank: who, where, what it watches (``modules``: name,
        type, order, params of each)."""
        info = {
            **self.who.to_dict(),
            "versions": {
                "nand": nand.__version__,
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "python": platform.python_version(),
            },
            "device": device,
            "modules": modules,
            "optimizer": optimizer,
            "on_nonfinite": policy,
        }
        if self.settings.launch:  # tells the server a rerun under the same id apart
            info["launch"] = self.settings.launch
        self._call("hello", info)
        if self.who.rank == 0 and self.settings.log_events:
            print(self.start_line(policy), file=sys.stderr, flush=True)

    def start_line(self, policy: str) -> str:
        """What rank 0 says when the watch starts: the run, where it reports, where to look."""
        who, settings = self.who, self.settings
        ranks = f"{who.world_size} ranks" if who.world_size > 1 else "1 process"
        where = f"server {settings.server}" if settings.server else "no server (log only)"
        line = f"nand: watching run {who.run} ({ranks}, on_nonfinite={policy}); {where}"
        if settings.server and settings.url:
            line += f"; dashboard {settings.url.rstrip('/')}/#/runs/{quote(who.run, safe='')}"
        return line

    def event(self, event: Event, flight: FlightWindow | None) -> None:
        self._call("event", event, flight)

    @property
    def world_size(self) -> int:
        return self.who.world_size

    def fingerprint(self, step: int, names: list[str], values: list[int], group: list[int]) -> None:
        """A replica fingerprint (``step.fingerprint``), for the sinks that take one."""
        self._call_optional("fingerprint", True, step, names, values, group)

    def alert(self, alert: Alert) -> None:
        """An early warning (``step.blowup``), for every sink that takes one."""
        self._call_optional("alert", False, alert)

    def _call_optional(self, method: str, per_step: bool, *args: Any) -> None:
        """``method`` of the sinks that have it (``per_step``: of those that
        want per-step calls only)."""
        for sink in list(self.sinks):
            send = getattr(sink, method, None)
            if send is None or (per_step and not getattr(sink, "per_step", True)):
                continue
            try:
                send(*args)
            except Exception as exc:
                self._drop(sink, method, exc)

    def step_done(self, step: int, summary: Callable[[float], StepSummary]) -> None:
        """Heartbeat when due: ``summary(steps_per_s)`` builds it from the
        figures this step already read (never an extra sync)."""
        now = time.monotonic()
        if now - self._last_beat < self.heartbeat_s or not self.per_step:
            return
        rate = self._rate(step, now)
        self._last_beat, self._last_step = now, step
        self._call("heartbeat", summary(rate))

    def _rate(self, step: int, now: float) -> float:
        """Steps per second since the last heartbeat."""
        return (step - self._last_step) / max(now - self._last_beat, 1e-9)

    def poll(self, step: int, flight: Callable[[], FlightWindow]) -> None:
        """Server commands, at an optimizer step boundary."""
        for sink in list(self.sinks):
            try:
                commands = sink.commands()
            except Exception as exc:
                self._drop(sink, "commands", exc)
                continue
            for command in commands:
                self._command(command, step, flight)

    def _command(
        self, command: dict[str, Any], step: int, flight: Callable[[], FlightWindow]
    ) -> None:
        kind = command.get("command")
        if kind == "stop":
            at = int(command.get("step", step))
            self.stop_at = at if self.stop_at is None else min(self.stop_at, at)
        elif kind == "send_flight":
            self._call("flight", flight(), "requested")

    def close(
        self, step: int, reason: str, summary: Callable[[float], StepSummary] | None = None
    ) -> None:
        """Bye, after a last heartbeat if the steps since the previous one
        left DDP local gradient norms unsent (the server compares them)."""
        if summary is not None and self.per_step and step > self._last_step:
            last = summary(self._rate(step, time.monotonic()))
            if last.local_grad_norms:
                self._call("heartbeat", last)
        self._call("bye", step, reason)
        self._call("close", self.settings.close_timeout_s)

    def _call(self, method: str, *args: Any) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(*args)
            except Exception as exc:
                self._drop(sink, method, exc)

    def _drop(self, sink: Sink, method: str, exc: Exception) -> None:
        log.error(
            "nand: sink %s failed in %s (%s); not using it any more",
            type(sink).__name__,
            method,
            exc,
            exc_info=exc,
        )
        if sink in self.sinks:
            self.sinks.remove(sink)
            self._sinks_changed()
