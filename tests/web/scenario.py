"""Runs for the dashboard tests, as the real wire messages agents send.

A :class:`Scenario` is the messages of every agent of one run (one agent per
rank, ``seq`` from 1) plus what was planted in it, so a test can check that
the page names it. :func:`replay` sends them to a server over ZeroMQ from one
DEALER socket per agent, exactly as agents do, and waits for the server's
acknowledgements. A recording of a real multi-rank torchrun job (the same
``{agent: [message, ...]}`` shape, e.g. captured by ``nand.testing.Receiver``)
can replace the synthetic runs below without touching the tests.

>>> s = diverged_run()
>>> s.planted.rank, s.planted.module, s.planted.step
(5, 'encoder.layers.5.mlp.fc2', 48)
"""

from __future__ import annotations

import math
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import zmq

from nand import wire
from nand.events import Event, FlightWindow, StepSummary

FLOAT16_MAX = 65504.0


@dataclass(frozen=True)
class Planted:
    """Where a scenario's run first goes non-finite."""

    run: str
    rank: int
    module: str
    module_type: str
    step: int
    phase: str


@dataclass
class Scenario:
    run: str
    world_size: int
    #: agent id -> that agent's messages in send order
    messages: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    planted: Planted | None = None

    def count(self) -> int:
        return sum(len(m) for m in self.messages.values())

    @classmethod
    def recorded(
        cls, messages: dict[str, list[dict[str, Any]]], planted: Planted | None = None
    ) -> Scenario:
        """A run captured from real agents, e.g. ``nand.testing.Receiver.messages``
        after a torchrun job pointed at the receiver; ``planted`` is the fault the
        job was told to make."""
        hello = next(m for msgs in messages.values() for m in msgs if m["kind"] == "hello")
        return cls(
            run=hello["run"],
            world_size=hello["body"]["world_size"],
            messages={agent: list(msgs) for agent, msgs in messages.items()},
            planted=planted,
        )


def model_modules(layers: int = 6) -> list[dict[str, Any]]:
    """A small transformer's modules in execution order, as a hello lists them."""
    mods = [{"name": "embed", "type": "Embedding", "params": 32000 * 512}]
    for i in range(layers):
        p = f"encoder.layers.{i}"
        mods += [
            {"name": f"{p}.attn.qkv", "type": "Linear", "params": 512 * 1536},
            {"name": f"{p}.attn.out", "type": "Linear", "params": 512 * 512},
            {"name": f"{p}.mlp.fc1", "type": "Linear", "params": 512 * 2048},
            {"name": f"{p}.mlp.fc2", "type": "Linear", "params": 2048 * 512},
            {"name": f"{p}.norm", "type": "LayerNorm", "params": 1024},
        ]
    mods.append({"name": "head", "type": "Linear", "params": 512 * 32000})
    for order, m in enumerate(mods):
        m["order"] = order
    return mods


class _Agent:
    """Builds one rank's messages with consecutive sequence numbers."""

    def __init__(self, scenario: Scenario, rank: int, host: str) -> None:
        self.id = f"web-{uuid.uuid4().hex[:12]}"
        self.scenario = scenario
        self.rank = rank
        self.host = host
        self.pid = 40000 + rank
        self.out = scenario.messages.setdefault(self.id, [])

    def send(self, kind: str, body: dict[str, Any], at: float) -> None:
        message = wire.agent_message(
            kind,
            agent=self.id,
            seq=len(self.out) + 1,
            run=self.scenario.run,
            rank=self.rank,
            body=body,
        )
        message["time"] = at
        self.out.append(message)

    def hello(self, modules: list[dict[str, Any]], at: float) -> None:
        body = {
            "run": self.scenario.run,
            "rank": self.rank,
            "local_rank": self.rank % 8,
            "world_size": self.scenario.world_size,
            "host": self.host,
            "pid": self.pid,
            "versions": {"nand": "0.1.0", "torch": "2.13.0"},
            "device": "cuda" if self.scenario.world_size > 1 else "cpu",
            "modules": modules,
            "optimizer": "AdamW",
        }
        self.send("hello", body, at)

    def heartbeat(self, summary: StepSummary, at: float) -> None:
        self.send("heartbeat", summary.to_dict(), at)

    def event(self, event: Event, flight: FlightWindow | None, at: float) -> None:
        event.run, event.rank, event.host, event.pid = (
            self.scenario.run,
            self.rank,
            self.host,
            self.pid,
        )
        event.world_size, event.time = self.scenario.world_size, at
        event.seq = len(self.out) + 1
        body = {"event": event.to_dict(), "flight": flight.to_dict() if flight else None}
        self.send("event", body, at)


def _flight(modules: list[str], steps: list[int], bad: str, rng: random.Random) -> FlightWindow:
    """Per-layer max|x| where `bad` builds up towards the float16 limit and overflows
    (+inf) in the last step; everything after it in the last step is NaN. The
    first step has no gradients recorded (null: "not recorded", not non-finite)."""
    act: list[list[float | None]] = []
    grad: list[list[float | None]] = []
    bad_j = modules.index(bad)
    for i, _step in enumerate(steps):
        last = i == len(steps) - 1
        growth = (
            300.0 * (FLOAT16_MAX * 0.93 / 300.0) ** (i / (len(steps) - 2)) if not last else None
        )
        row: list[float | None] = []
        grow: list[float | None] = []
        for j, _name in enumerate(modules):
            base = 2.0 + 40.0 * ((j * 7) % 11) / 11 * rng.uniform(0.9, 1.1)
            if last and j >= bad_j:
                row.append(math.inf if j == bad_j else math.nan)
                grow.append(math.nan)
            elif i == 0:
                row.append(base)
                grow.append(None)
            elif j == bad_j:
                row.append(growth)
                grow.append(None if last else growth / 900.0)
            else:
                row.append(base * (1.0 + 0.5 * (j > bad_j) * i / len(steps)))
                grow.append(base / 1000.0 * rng.uniform(0.8, 1.2))
        act.append(row)
        grad.append(grow)
    norms: list[float | None] = [0.8 * 1.12**i for i in range(len(steps) - 1)] + [None]
    losses: list[float | None] = [2.6 - 0.004 * i for i in range(len(steps) - 1)] + [None]
    return FlightWindow(
        steps=steps,
        modules=modules,
        act_max_abs=act,
        grad_max_abs=grad,
        grad_norm=norms,
        loss=losses,
        dtype="float16",
        dtype_max=FLOAT16_MAX,
    )


def diverged_run(
    run: str = "gpt-small-fp16-diverged",
    world_size: int = 8,
    origin_rank: int = 5,
    bad_step: int = 48,
    after: int = 4,
    seed: int = 0,
) -> Scenario:
    """A DDP run where rank `origin_rank` overflows in encoder.layers.5.mlp.fc2
    (float16) during forward at `bad_step`; the other ranks receive the
    non-finite gradient through the all-reduce of the same step."""
    rng = random.Random(seed)
    scenario = Scenario(run=run, world_size=world_size)
    modules = model_modules()
    names = [m["name"] for m in modules]
    bad = "encoder.layers.5.mlp.fc2"
    scenario.planted = Planted(run, origin_rank, bad, "Linear", bad_step, "forward")
    rate = 3.2  # steps per second
    end = time.time()
    start = end - (bad_step + after) / rate
    for rank in range(world_size):
        agent = _Agent(scenario, rank, host=f"gpu-node-{rank // 8:02d}")
        agent.hello(modules, start)
        for step in range(bad_step + after + 1):
            at = start + step / rate + rank * 0.003
            finite = step < bad_step
            agent.heartbeat(
                StepSummary(
                    step=step,
                    steps_per_s=rate * rng.uniform(0.93, 1.04) * (0.7 if step < 2 else 1.0),
                    loss=(4.2 * math.exp(-step / 30) + 2.4 + rng.uniform(-0.05, 0.05))
                    if finite
                    else None,
                    grad_norm=(0.8 * 1.07 ** max(0, step - 20) * rng.uniform(0.95, 1.05))
                    if finite
                    else None,
                    max_activation=(
                        min(FLOAT16_MAX * 0.93, 300 * 1.2 ** max(0, step - 17)) if finite else None
                    ),
                ),
                at,
            )
            if step == bad_step:
                agent.event(_first_event(rank, origin_rank, bad, bad_step), None, at)
                if rank == origin_rank:
                    window = list(range(bad_step - 31, bad_step + 1))
                    agent.send(
                        "flight",
                        {
                            "flight": _flight(names, window, bad, rng).to_dict(),
                            "reason": "incident",
                        },
                        at,
                    )
    return scenario


def _first_event(rank: int, origin_rank: int, bad: str, step: int) -> Event:
    if rank == origin_rank:
        return Event(
            step=step,
            phase="forward",
            module=bad,
            module_type="Linear",
            order=22,
            cause="produced",
            nan=0,
            posinf=3,
            neginf=0,
            max_abs=61234.0,
            min=-512.0,
            max=None,
            shape=[16, 1024, 512],
            dtype="float16",
            message=f"rank {rank}: +inf x3 in forward of {bad} (Linear) at step {step}",
        )
    return Event(
        step=step,
        phase="grad",
        module=f"{bad}.weight",
        module_type="Linear",
        order=3,
        cause="received",
        nan=1024,
        posinf=0,
        neginf=0,
        shape=[512, 2048],
        dtype="float16",
        message=f"rank {rank}: NaN x1024 in grad of {bad}.weight at step {step}; received",
    )


def healthy_run(
    run: str = "resnet50-bf16", world_size: int = 2, steps: int = 120, seed: int = 1
) -> Scenario:
    """A run that stays finite."""
    rng = random.Random(seed)
    scenario = Scenario(run=run, world_size=world_size)
    modules = [{"name": f"layer{i}", "type": "Conv2d", "order": i} for i in range(1, 5)]
    end = time.time()
    start = end - steps / 8
    for rank in range(world_size):
        agent = _Agent(scenario, rank, host="trainer-01")
        agent.hello(modules, start)
        for step in range(0, steps + 1, 2):
            agent.heartbeat(
                StepSummary(
                    step=step,
                    steps_per_s=8 * rng.uniform(0.95, 1.05),
                    loss=6.9 * math.exp(-step / 60) + 0.8 + rng.uniform(-0.03, 0.03),
                    grad_norm=1.5 * math.exp(-step / 90) + 0.2,
                    max_activation=12 + rng.uniform(-1, 1),
                ),
                start + step / 8,
            )
    return scenario


def many_events_run(
    run: str = "perf-10k-events", world_size: int = 4, events: int = 10_000
) -> Scenario:
    """A run with `events` non-finite observations, for a page of 10,000 rows."""
    scenario = Scenario(run=run, world_size=world_size)
    modules = model_modules()
    start = time.time() - 60
    per_rank = events // world_size
    for rank in range(world_size):
        agent = _Agent(scenario, rank, host="gpu-node-00")
        agent.hello(modules, start)
        for i in range(per_rank):
            m = modules[i % len(modules)]
            event = Event(
                step=10 + i // len(modules),
                phase="forward",
                module=m["name"],
                module_type=m["type"],
                order=m["order"],
                cause="propagated" if i else "produced",
                nan=i % 7 + 1,
                shape=[8, 512],
                dtype="bfloat16",
                # Markup in a message must reach the page as text, never as HTML.
                message=f"<b>not bold</b> rank {rank} event {i}",
            )
            agent.event(event, None, start + i * 0.001)
    return scenario


def wide_run(run: str = "perf-256-ranks", world_size: int = 256, steps: int = 60) -> Scenario:
    """256 ranks with a planted origin on rank 137, every other rank receiving."""
    return diverged_run(
        run=run, world_size=world_size, origin_rank=137, bad_step=steps - 6, after=5, seed=3
    )


def split_before_first_event(scenario: Scenario) -> tuple[Scenario, Scenario]:
    """The run up to its first event, and the rest: to watch it go bad live."""
    cut = min(
        (m["time"] for msgs in scenario.messages.values() for m in msgs if m["kind"] == "event"),
        default=float("inf"),
    )
    before = Scenario(scenario.run, scenario.world_size, planted=scenario.planted)
    after = Scenario(scenario.run, scenario.world_size, planted=scenario.planted)
    for agent, messages in scenario.messages.items():
        before.messages[agent] = [m for m in messages if m["time"] < cut]
        after.messages[agent] = [m for m in messages if m["time"] >= cut]
    return before, after


def replay(
    endpoint: str, scenario: Scenario, *, token: str | None = None, timeout: float = 60.0
) -> None:
    """Send every agent's messages over ZeroMQ and wait until the server acked them all.

    With a ``token``, each hello carries it, as an agent started with NAND_TOKEN does.
    """
    ctx = zmq.Context.instance()
    sockets: dict[zmq.Socket, tuple[str, set[int]]] = {}
    poller = zmq.Poller()
    try:
        for agent, messages in scenario.messages.items():
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(endpoint)
            for message in messages:
                if token and message["kind"] == "hello":
                    message = {**message, "body": {**message["body"], "token": token}}
                sock.send(wire.encode(message))
            sockets[sock] = (agent, {m["seq"] for m in messages})
            poller.register(sock, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        while any(pending for _agent, pending in sockets.values()):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = {a: len(p) for a, p in sockets.values() if p}
                raise TimeoutError(
                    f"server did not ack {scenario.run}: unacked per agent {missing}"
                )
            for sock, _ in poller.poll(int(left * 1000)):
                reply = wire.decode(sock.recv())
                if reply["kind"] == "reject":
                    raise RuntimeError(f"server rejected {scenario.run}: {reply['reason']}")
                if reply["kind"] == "ack":
                    sockets[sock][1].difference_update(reply["seqs"])
    finally:
        for sock in sockets:
            sock.close(0)


def short_run(
    run: str,
    *,
    world_size: int = 2,
    beats: int = 3,
    bad_step: int | None = None,
    origin_rank: int = 1,
    said_bye: bool = False,
    rate: float = 2.0,
) -> Scenario:
    """A run that ended early: a few heartbeats (the first 5 s after the start, as
    NAND_HEARTBEAT_S makes them), each rank's gradient norm identical (after
    DDP's all-reduce), and, with ``bad_step``, a first event *after* the last
    heartbeat on ``origin_rank`` (received by the others). ``said_bye``: every
    rank has exited."""
    scenario = Scenario(run=run, world_size=world_size)
    modules = model_modules(2)
    start = time.time() - 60
    for rank in range(world_size):
        agent = _Agent(scenario, rank, host=f"node-{rank}")
        agent.hello(modules, start)
        for i in range(beats):
            at = start + 5.0 * (i + 1)
            step = int(rate * 5.0 * (i + 1))
            summary = StepSummary(
                step=step, steps_per_s=rate, loss=2.0 - 0.1 * i + 0.05 * rank, grad_norm=1.0 + i
            )
            agent.heartbeat(summary, at)
        last = start + 5.0 * beats
        if bad_step is not None:
            if rank == origin_rank:
                event = Event(
                    step=bad_step,
                    phase="forward",
                    module=modules[1]["name"],
                    module_type="Linear",
                    cause="produced",
                    posinf=1,
                    shape=[4, 8],
                    dtype="float32",
                )
            else:
                event = Event(
                    step=bad_step,
                    phase="grad",
                    module=f"{modules[1]['name']}.weight",
                    cause="received",
                    nan=32,
                    shape=[8, 8],
                    dtype="float32",
                )
            agent.event(event, None, last + 1)
        if said_bye:
            agent.send(
                "bye", {"step": bad_step or int(rate * 5.0 * beats), "reason": "closed"}, last + 2
            )
    if bad_step is not None:
        scenario.planted = Planted(
            run, origin_rank, modules[1]["name"], "Linear", bad_step, "forward"
        )
    return scenario
