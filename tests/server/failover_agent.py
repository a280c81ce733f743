"""One real agent process for ``test_failover``: a ``ServerSink`` given every server.

    python -m tests.server.failover_agent RUN RANK WORLD "tcp://a,tcp://b,tcp://c" GO_FILE

Says hello, then one heartbeat per step (``STEP_S`` apart). At ``EVENT_STEP`` it
waits for ``GO_FILE`` (the test writes it once a server is killed), then
reports the non-finite value: ``ORIGIN_RANK`` produced it in ``fc2``'s
backward, the others received it through the gradient all-reduce. Then the
remaining steps, bye, a flush, and one JSON line with its stats on stdout.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from nand.agent.identity import Identity
from nand.agent.transport.server_sink import ServerSink
from nand.events import Event, StepSummary

STEPS = 120
EVENT_STEP = 80
ORIGIN_RANK = 3
STEP_S = 0.02
TOKEN = "failover-token"


def event_of(run: str, rank: int, world: int) -> Event:
    if rank == ORIGIN_RANK:
        where = {"phase": "backward", "module": "fc2", "module_type": "Linear"}
    else:
        where = {"phase": "grad", "module": "fc2.weight"}
    return Event(run=run, rank=rank, world_size=world, step=EVENT_STEP, nan=2, **where)


def main(run: str, rank: int, world: int, servers: str, go_file: str) -> None:
    me = Identity(run=run, rank=rank, local_rank=rank, world_size=world, host="h", pid=os.getpid())
    sink = ServerSink(
        servers,
        me,
        token=TOKEN,
        spool_dir=tempfile.mkdtemp(prefix="nand-failover-"),
        ack_timeout_s=1.0,
        connect_grace_s=0.2,
    )
    sink.hello({"modules": [{"name": "fc1", "type": "Linear"}, {"name": "fc2", "type": "Linear"}]})
    for step in range(1, STEPS + 1):
        if step == EVENT_STEP:
            deadline = time.monotonic() + 60
            while not os.path.exists(go_file) and time.monotonic() < deadline:
                time.sleep(0.02)
            sink.event(event_of(run, rank, world), None)
        sink.heartbeat(StepSummary(step=step, loss=1.0))
        time.sleep(STEP_S)
    sink.bye(STEPS, "done")
    flushed = sink.flush(60)
    stats = sink.stats()
    sink.close(5.0)
    print(json.dumps({"rank": rank, "flushed": flushed, **stats}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
