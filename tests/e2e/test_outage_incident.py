"""A run whose server is away: early warnings, then an incident, all spooled to
disk, said at exit, and replayed later with ``nand spool replay`` to a real
``nand server``: the verdict is the one the run deserves."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nand.client import request_json, run_url
from nand.testing import free_port
from tests.server.processes import ServerProcess

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

# A small transformer; at step 30 one batch's labels are 30x off (a loss spike
# and a gradient norm blown up with it), at step 34 the input holds -inf. The
# loop prints its own losses: the ground truth, known without nand.
TRAINER = """
import json, math, sys
import torch
from torch import nn
import torch.nn.functional as F
import nand

spike = "--no-spike" not in sys.argv
torch.manual_seed(0)
layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
model = nn.TransformerEncoder(layer, 2)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x, y = torch.randn(8, 16, 32), torch.randn(8, 16, 32)
losses = []
with nand.watch(model, opt, log_events=False) as w:
    for step in range(36):
        batch = x.clone()
        if step == 34:
            batch[0, 0, 0] = float("-inf")
        target = y * 30 if (spike and step == 30) else y
        loss = F.mse_loss(model(batch), target)
        w.loss(loss)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
print(json.dumps({"losses": losses}), flush=True)
"""


def _train(tmp_path: Path, endpoint: str, run: str, *args: str) -> tuple[list[float], str]:
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(TRAINER))
    env = dict(os.environ, PYTHONPATH=str(ROOT), NAND_SERVER=endpoint, NAND_RUN=run)
    env.update(NAND_SPOOL_DIR=str(tmp_path / "spool"), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])["losses"], done.stderr


def _replay(spool_dir: Path, endpoint: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "nand", "spool", "replay", str(spool_dir)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [*command, "--server", endpoint, "--timeout", "20"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _spooled_kinds(spool_dir: Path) -> list[str]:
    command = [sys.executable, "-m", "nand", "spool", "show", str(spool_dir)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    shown = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    return [line.split()[0] for line in shown.stdout.splitlines() if line.startswith("  ")]


@pytest.mark.parametrize("spike", [True, False], ids=["spike_then_inf", "inf_only"])
def test_warnings_then_an_incident_while_the_server_is_away_reach_it_by_spool_replay(
    tmp_path, spike
):
    port = free_port()  # nothing listens there while the job runs
    endpoint = f"tcp://127.0.0.1:{port}"
    losses, stderr = _train(tmp_path, endpoint, "outage", *([] if spike else ["--no-spike"]))

    # Ground truth from the loop's own losses: a spike at 30 (when planted), -inf at 34.
    first_bad = next(step for step, loss in enumerate(losses) if not math.isfinite(loss))
    assert first_bad == 34
    spikes = [s for s in range(20, 34) if losses[s] > 3 * sum(losses[s - 20 : s]) / 20]
    assert spikes == ([30] if spike else [])

    # At exit the agent says what is left on disk, and how to send it.
    assert "did not reach the server" in stderr and "nand spool replay" in stderr, stderr
    kinds = _spooled_kinds(tmp_path / "spool")
    assert kinds[0] == "hello" and kinds[-1] == "bye" and "event" in kinds, kinds
    assert kinds.count("warning") == (2 if spike else 0), kinds

    server = ServerProcess(f"sqlite:///{tmp_path / 'nand.db'}", port).start()
    try:
        replayed = _replay(tmp_path / "spool", endpoint)
        assert replayed.returncode == 0, replayed.stdout + replayed.stderr
        verdict = request_json(run_url(server.http_url, "outage", "/verdict"))
    finally:
        server.stop()
    assert verdict["state"] == "diverged", verdict
    origin = verdict["origin"]
    assert (origin["step"], origin["phase"], origin["cause"]) == (34, "input", "data")
    warned = verdict["warnings"]
    if spike:
        assert warned["by_kind"] == {"loss_spike": 1, "grad_growth": 1}, warned
        assert warned["first"]["step"] == 30
    else:
        assert warned["count"] == 0
    assert verdict["messages_dropped"] == 0, verdict["dropped"]
    assert not list((tmp_path / "spool").rglob("*.spool"))  # replayed, acknowledged, deleted
