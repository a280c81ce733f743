"""A run with gaps says so: a real training process (``nand.watch``) trains while
no server is up, with a small memory queue and disk spool, so its agent drops
messages; then a real ``nand server`` process starts on its endpoint, the agent
reconnects and its heartbeats carry the counts. The rank's REST view,
``/metrics``, the verdict and the dashboard (real Chromium) show them by reason,
exactly as the agent counted them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import expect

from nand.testing import free_port
from tests.server.helpers import eventually
from tests.server.processes import ServerProcess
from tests.web.conftest import screenshot

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
RUN = "lossy"
#: Seconds the job trains before the server starts: ~600 heartbeats, 40 fit the spool.
OFFLINE_S = 6.0

TRAINER = """
import json, pathlib, sys, time
import torch
import nand
from nand.agent.transport import server_sink

done = pathlib.Path(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 8), torch.randn(32, 1)


def step():
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def dropped():
    (sink,) = list(server_sink._LIVE)
    return sink.dropped()


with nand.watch(model, optimizer=opt):
    end = time.monotonic() + OFFLINE_S
    while time.monotonic() < end:  # no server: a heartbeat every 10 ms, into a tiny spool
        step()
        time.sleep(0.001)
    time.sleep(0.5)  # the sender spools what it holds
    print("offline", json.dumps(dropped()), flush=True)
    while not done.exists():  # the server is up: train on until the test has looked
        step()
        time.sleep(0.05)
    final = dropped()
print("final", json.dumps(final), flush=True)
"""


@dataclass
class LossyRun:
    server: ServerProcess
    offline: dict[str, int]
    trainer: subprocess.Popen[str]
    done: Path

    @property
    def url(self) -> str:
        return self.server.http_url

    def finish(self) -> dict[str, int]:
        """Let the trainer exit; the counts it had at the end."""
        self.done.touch()
        final = json.loads(_line(self.trainer, "final "))
        assert self.trainer.wait(60) == 0
        return dict(final)


def _trainer(tmp: Path, zmq_port: int) -> subprocess.Popen[str]:
    script = tmp / "trainer.py"
    script.write_text(textwrap.dedent(TRAINER).replace("OFFLINE_S", str(OFFLINE_S)))
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        NAND_SERVER=f"tcp://127.0.0.1:{zmq_port}",
        NAND_RUN=RUN,
        NAND_SPOOL_DIR=str(tmp / "spool"),
        NAND_SPOOL_MAX_BYTES="8192",  # a few dozen heartbeats
        NAND_QUEUE_MAX="50",
        # Often, so the outage costs many messages; not 0, which would also make
        # the keepalive interval 0 (a keepalive on every wake of the sender).
        NAND_HEARTBEAT_S="0.01",
    )
    env.pop("NAND_TOKEN", None)
    return subprocess.Popen(
        [sys.executable, str(script), str(tmp / "done")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


@pytest.fixture(scope="module")
def lossy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LossyRun]:
    tmp = tmp_path_factory.mktemp("losses")
    zmq_port = free_port()
    trainer = _trainer(tmp, zmq_port)
    server = ServerProcess(f"sqlite:///{tmp / 'nand.db'}", zmq_port, NAND_TOKEN="")
    try:
        offline = json.loads(_line(trainer, "offline "))
        assert offline.get("spool_full", 0) > 0, offline  # the outage cost messages
        server.start()
        yield LossyRun(server, offline, trainer, tmp / "done")
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(10)
        server.stop()


def _line(trainer: subprocess.Popen[str], prefix: str) -> str:
    """The rest of the trainer's first output line that starts with ``prefix``
    (nand's start line and warnings come before it)."""
    assert trainer.stdout is not None
    seen = []
    for line in trainer.stdout:
        if line.startswith(prefix):
            return line[len(prefix) :]
        seen.append(line)
    raise AssertionError(f"the trainer exited ({trainer.wait()}) without {prefix!r}: {seen}")


def _rank0(url: str) -> dict:
    answer = httpx.get(f"{url}/api/runs/{RUN}/ranks")
    assert answer.status_code == 200, answer.text  # 404 until the agent's hello is in
    rows = answer.json()["items"]
    assert rows and rows[0]["rank"] == 0
    return dict(rows[0])


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_the_rest_view_metrics_and_dashboard_show_what_the_agent_dropped(lossy, page) -> None:
    # The first heartbeats after the outage already carry at least the offline counts.
    eventually(
        lambda: _rank0(lossy.url)["dropped"].get("spool_full", 0) >= lossy.offline["spool_full"],
        timeout=30,
    )
    # The agent counts a loss when it happens and reports it in its next heartbeat
    # (a bye carries no counts), so let it send live for a while before it exits.
    live_from = _rank0(lossy.url)["step"]
    eventually(lambda: _rank0(lossy.url)["step"] >= live_from + 20, timeout=30)
    final = lossy.finish()

    # Exactly what the agent counted, by reason: its last heartbeat's cumulative counts.
    def same() -> bool:
        shown = _rank0(lossy.url)["dropped"]
        assert shown == final, (shown, final)
        return True

    eventually(same, timeout=20)
    total = sum(final.values())
    assert _rank0(lossy.url)["messages_dropped"] == total

    verdict = httpx.get(f"{lossy.url}/api/runs/{RUN}/verdict").json()
    assert verdict["ranks_with_gaps"] == [0] and verdict["messages_dropped"] == total
    assert verdict["gaps_summary"].startswith(f"Rank 0 dropped {total:,} messages")

    metrics = httpx.get(f"{lossy.url}/metrics").text
    for reason, count in final.items():
        assert _metric(metrics, f'nand_agent_messages_dropped{{reason="{reason}"}}') == count
    assert _metric(metrics, "nand_runs_with_gaps") == 1

    page.goto(lossy.url)
    expect(page.locator(f'tr[data-run="{RUN}"] .gaps-mark')).to_have_text(f"{total:,} dropped")
    page.goto(f"{lossy.url}/#/runs/{RUN}")
    note = page.locator(".verdict .gaps-note")
    expect(note).to_contain_text(f"Rank 0 dropped {total:,} messages")
    expect(note).to_contain_text(f"spool_full {final['spool_full']:,}")
    expect(page.locator("#gaps-title")).to_have_text(f"Gaps: {total:,} messages dropped by 1 rank")
    row = page.locator('#gaps tbody tr[data-rank="0"]')
    expect(row.locator("td").first).to_have_text(f"{total:,}")
    header = page.locator("#gaps thead th", has_text="spool_full")
    expect(header).to_have_attribute("title", re.compile("spool was full"))
    screenshot(page, "run-with-gaps-light")
