"""Many simulated ranks per process, speaking the agents' wire protocol.

    python benchmarks/loadgen.py --servers tcp://127.0.0.1:5557 --ranks 20000 --seconds 60

Each process takes a slice of the job's ranks (``rank % procs == i``) and sends,
over one DEALER socket per server (rank ``r`` reports to server ``r % n``),
what a real rank's agent sends, built with the agent's own classes
(``Event``, ``StepSummary``) and framed by ``nand.wire`` as its sender does:

- ``hello`` (world size, host, pid, three modules);
- a ``heartbeat`` every ``nand.cadence.heartbeat_s(--heartbeat-s, world)``
  seconds (the rule the agent follows: 5 s up to 10,000 ranks, 50 s at
  100,000), the ranks spread evenly over the period, one step further each;
- a ``fingerprint`` every ``--fingerprint-every`` heartbeats (three parameters,
  the same values on every rank);
- probes (:class:`Plan`): at ``probe_at`` + i * ``probe_every`` seconds rank
  ``probe_rank(i)`` sends a produced NaN at a step earlier than the one before,
  so each probe becomes the run's new origin (the event → verdict latency);
- the burst: at ``burst_at`` every other rank sends the NaN it received
  through the all-reduce, one step after the probes;
- ``bye`` from every rank at the end.

At most ``--window`` messages are unacknowledged per socket, as in the agent's
transport; a ``reject`` is counted, never retried.
"""

from __future__ import annotations

import argparse
import heapq
import json
import multiprocessing as mp
import os
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nand import cadence, wire  # noqa: E402
from nand.events import Event, StepSummary  # noqa: E402

#: Step of the first probe; probe i is at PROBE_STEP - i (each earlier than the last).
PROBE_STEP = 1_000_000
#: Seconds without room in the window before its messages count as unacknowledged.
STALL_S = 10.0
PARAMS = ["blocks.0.fc.weight", "blocks.0.fc.bias", "head.weight"]
MODULES = [{"name": n, "type": "Linear", "order": i, "params": 1} for i, n in enumerate(PARAMS)]


@dataclass(frozen=True)
class Plan:
    """One simulated job: who, where, for how long, and when its NaN comes."""

    run: str
    world: int
    servers: tuple[str, ...]
    seconds: float
    heartbeat_s: float = 5.0
    window: int = 500
    fingerprint_every: int = 10
    probes: int = 0
    probe_at: float = 5.0
    probe_every: float = 1.0
    #: None: no burst of received events.
    burst_at: float | None = None

    def probe_rank(self, i: int) -> int:
        return (i * 7919 + 1) % self.world

    @property
    def period(self) -> float:
        return cadence.heartbeat_s(self.heartbeat_s, self.world)


@dataclass
class Tally:
    """What one process sent and had acknowledged, and when each probe left."""

    sent: int = 0
    acked: int = 0
    rejected: int = 0
    #: Messages given up on after STALL_S without an acknowledgement.
    unacked: int = 0
    started: float = 0.0
    ended: float = 0.0
    probes_sent: dict[int, float] = field(default_factory=dict)
    #: When each probe left, after waiting for room in the socket's shared window
    #: (a real rank's own window is empty at the heartbeat rule's period).
    probes_left: dict[int, float] = field(default_factory=dict)


class Ranks:
    """A slice of the job's ranks behind one DEALER socket per server."""

    def __init__(self, plan: Plan, ranks: list[int]) -> None:
        self.plan = plan
        self.ranks = ranks
        self.ctx = zmq.Context()
        self.sockets = [self._socket(endpoint) for endpoint in plan.servers]
        self.poller = zmq.Poller()
        for sock in self.sockets:
            self.poller.register(sock, zmq.POLLIN)
        self.in_flight = [0] * len(self.sockets)
        self.seq = dict.fromkeys(ranks, 0)
        self.step = dict.fromkeys(ranks, 0)
        self.tally = Tally()

    def _socket(self, endpoint: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        return sock

    def send(self, rank: int, kind: str, body: dict) -> None:
        """Frame and send one message of ``rank``, first waiting for room in the window."""
        index = rank % len(self.sockets)
        waited = time.monotonic()
        while self.in_flight[index] >= self.plan.window:
            self.receive(1.0)
            if time.monotonic() - waited > STALL_S:  # (an agent would resend; we count them)
                self.tally.unacked += self.in_flight[index]
                self.in_flight[index] = 0
        self.seq[rank] += 1
        message = wire.agent_message(
            kind,
            agent=self.agent(rank),
            seq=self.seq[rank],
            run=self.plan.run,
            rank=rank,
            body=body,
        )
        self.sockets[index].send(wire.encode(message))
        self.in_flight[index] += 1
        self.tally.sent += 1

    def agent(self, rank: int) -> str:
        return f"{self.plan.run}-r{rank}"

    def receive(self, timeout_s: float) -> None:
        """Take the replies that arrive within ``timeout_s``."""
        for sock, _ in self.poller.poll(max(0, int(timeout_s * 1000))):
            index = self.sockets.index(sock)
            while sock.poll(0):
                reply = wire.decode(sock.recv())
                done = len(reply.get("seqs", ())) if reply["kind"] == "ack" else 0
                if reply["kind"] == "reject":
                    self.tally.rejected += 1
                    done = 1
                self.in_flight[index] -= done
                self.tally.acked += done if reply["kind"] == "ack" else 0

    def drain(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while any(self.in_flight) and time.monotonic() < deadline:
            self.receive(0.2)


def hello(plan: Plan, rank: int) -> dict:
    return {
        "run": plan.run,
        "rank": rank,
        "world_size": plan.world,
        "local_rank": rank % 8,
        "host": f"{socket.gethostname()}-sim{rank // 8}",
        "pid": os.getpid(),
        "device": f"cuda:{rank % 8}",
        "modules": MODULES,
        "optimizer": "AdamW",
        "on_nonfinite": "warn",
    }


def nan_event(plan: Plan, rank: int, step: int, produced: bool) -> dict:
    event = Event(
        run=plan.run,
        rank=rank,
        world_size=plan.world,
        step=step,
        phase="forward" if produced else "grad",
        module="blocks.0.fc" if produced else "blocks.0.fc.weight",
        module_type="Linear",
        order=0,
        cause="produced" if produced else "received",
        nan=1,
        shape=[64, 64],
        dtype="bfloat16",
    )
    return {"event": event.to_dict(), "flight": None}


def _schedule(plan: Plan, ranks: list[int], start: float) -> Iterator[tuple[float, str, int]]:
    """(due, what, rank) in time order: heartbeats, probes, the burst; then byes."""
    heap: list[tuple[float, int, str, int]] = []
    for rank in ranks:
        heap.append((start + plan.period * rank / plan.world, 0, "heartbeat", rank))
    mine = set(ranks)
    for i in range(plan.probes):
        rank = plan.probe_rank(i)
        if rank in mine:
            heap.append((start + plan.probe_at + i * plan.probe_every, 1, f"probe{i}", rank))
    probed = {plan.probe_rank(i) for i in range(plan.probes)}
    if plan.burst_at is not None:
        for rank in ranks:
            if rank not in probed:
                heap.append((start + plan.burst_at, 2, "received", rank))
    heapq.heapify(heap)
    end = start + plan.seconds
    while heap and heap[0][0] < end:
        due, _order, what, rank = heapq.heappop(heap)
        if what == "heartbeat":
            heapq.heappush(heap, (due + (plan.period or 0.01), 0, what, rank))
        yield due, what, rank


def run_slice(plan: Plan, ranks: list[int]) -> Tally:
    """Say hello for each rank, follow the schedule until ``plan.seconds``, say bye."""
    sim = Ranks(plan, ranks)
    sim.tally.started = time.time()
    for rank in ranks:
        sim.send(rank, "hello", hello(plan, rank))
    sim.drain(120.0)
    start = time.monotonic()
    for due, what, rank in _schedule(plan, ranks, start):
        if time.monotonic() >= start + plan.seconds:  # (behind schedule: stop on time)
            break
        while (wait := due - time.monotonic()) > 0:
            sim.receive(wait)
        _send_scheduled(sim, what, rank)
    for rank in ranks:
        sim.send(rank, "bye", {"step": sim.step[rank], "reason": "finished"})
    sim.drain(120.0)
    sim.tally.ended = time.time()
    sim.ctx.destroy(linger=0)
    return sim.tally


def _send_scheduled(sim: Ranks, what: str, rank: int) -> None:
    plan = sim.plan
    if what == "heartbeat":
        sim.step[rank] += 1
        beat = StepSummary(step=sim.step[rank], steps_per_s=1.0 / max(plan.period, 0.01))
        beat.loss, beat.grad_norm = 2.0 + (rank % 13) / 100, 1.0 + (rank % 7) / 10
        sim.send(rank, "heartbeat", beat.to_dict())
        if plan.fingerprint_every and sim.step[rank] % plan.fingerprint_every == 0:
            body = {"step": sim.step[rank], "names": PARAMS, "values": [11, 22, 33], "group": []}
            sim.send(rank, "fingerprint", body)
    elif what.startswith("probe"):
        i = int(what.removeprefix("probe"))
        sim.tally.probes_sent[i] = time.time()
        sim.send(rank, "event", nan_event(plan, rank, PROBE_STEP - i, produced=True))
        sim.tally.probes_left[i] = time.time()
    else:
        sim.send(rank, "event", nan_event(plan, rank, PROBE_STEP + 1, produced=False))


def _worker(plan: Plan, index: int, procs: int, out: mp.Queue) -> None:
    tally = run_slice(plan, list(range(index, plan.world, procs)))
    out.put(asdict(tally))


def run(plan: Plan, procs: int) -> list[dict]:
    """``procs`` processes, each a slice of the ranks; their tallies."""
    out: mp.Queue = mp.Queue()
    workers = [mp.Process(target=_worker, args=(plan, i, procs, out)) for i in range(procs)]
    for worker in workers:
        worker.start()
    tallies = [out.get() for _ in workers]
    for worker in workers:
        worker.join(30)
    return tallies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", required=True, help="ZeroMQ endpoints, comma-separated")
    parser.add_argument("--run", default="loadgen")
    parser.add_argument("--ranks", type=int, default=1000)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--heartbeat-s", type=float, default=5.0, help="0: as fast as acked")
    parser.add_argument("--window", type=int, default=500)
    parser.add_argument("--burst-at", type=float, default=None)
    args = parser.parse_args()
    plan = Plan(
        run=args.run,
        world=args.ranks,
        servers=tuple(args.servers.split(",")),
        seconds=args.seconds,
        heartbeat_s=args.heartbeat_s,
        window=args.window,
        burst_at=args.burst_at,
    )
    tallies = run(plan, args.procs)
    print(json.dumps(summarise(tallies), indent=1))


def summarise(tallies: list[dict]) -> dict:
    began, ended = min(t["started"] for t in tallies), max(t["ended"] for t in tallies)
    acked = sum(t["acked"] for t in tallies)
    return {
        "sent": sum(t["sent"] for t in tallies),
        "acked": acked,
        "rejected": sum(t["rejected"] for t in tallies),
        "unacked": sum(t["unacked"] for t in tallies)
        + sum(t["sent"] - t["acked"] - t["rejected"] - t["unacked"] for t in tallies),
        "seconds": ended - began,
        "msg_per_s": acked / max(ended - began, 1e-9),
    }


if __name__ == "__main__":
    main()
