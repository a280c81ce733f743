"""Who an agent is: run id agreement, rank and world size from dist or the launcher."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from nand.agent import identity
from nand.agent.identity import resolve_identity
from nand.config import AgentConfig
from nand.testing import Receiver

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "SLURM_JOB_ID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NTASKS",
)


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)


def test_a_single_process_is_rank_0_of_1_with_one_stable_run_id():
    first, again = resolve_identity(), resolve_identity()
    assert (first.rank, first.local_rank, first.world_size) == (0, 0, 1)
    assert first.host == socket.gethostname() and first.pid == os.getpid()
    assert first.run.startswith("run-") and again.run == first.run


def test_run_id_precedence_argument_nand_run_torchelastic_slurm(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    assert resolve_identity().run == "4711"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's placeholder is not an id
    assert resolve_identity().run == "4711"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "elastic-1")
    assert resolve_identity().run == "elastic-1"
    monkeypatch.setenv("NAND_RUN", "mine")
    assert resolve_identity(AgentConfig.resolve().run).run == "mine"
    assert resolve_identity(AgentConfig.resolve(run="explicit").run).run == "explicit"


@pytest.mark.parametrize(
    ("variable", "value", "run"),
    [("TORCHELASTIC_RUN_ID", "team/exp3", "team-exp3"), ("SLURM_JOB_ID", "a\udcffb", "a-b")],
)
def test_a_launcher_id_no_run_can_have_is_made_one_the_server_accepts(
    monkeypatch, variable, value, run
):
    # torchrun --rdzv-id team/exp3; an environment variable of bytes that are not UTF-8
    monkeypatch.setenv(variable, value)
    assert resolve_identity().run == run


def test_rank_and_world_from_the_torchrun_environment(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    got = resolve_identity(run="r")
    assert (got.rank, got.local_rank, got.world_size) == (5, 1, 8)


def test_rank_and_world_from_the_slurm_environment(monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_LOCALID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_JOB_ID", "99")
    got = resolve_identity()
    assert (got.run, got.rank, got.local_rank, got.world_size) == ("99", 3, 3, 4)


def test_a_store_agreement_picks_the_first_offer_for_everyone(monkeypatch):
    import torch.distributed as dist

    store = dist.HashStore()
    monkeypatch.setattr(identity, "_default_store", lambda: store)
    monkeypatch.setattr(identity, "_agreed", {})
    first = identity._agreed_run_id()
    monkeypatch.setattr(identity, "_agreed", {})  # another rank: same store, its own offer
    assert identity._agreed_run_id() == first
    assert store.get("nand/run_id/0").decode() == first


def test_identity_serialises_to_a_plain_dict():
    got = resolve_identity(run="r").to_dict()
    assert set(got) == {"run", "rank", "local_rank", "world_size", "host", "pid"}


TWO_RANKS = """
import json, os, sys
import torch.distributed as dist
from nand.agent import identity
from nand.agent.transport.server_sink import ServerSink

natural = identity.resolve_identity()              # torchrun's TORCHELASTIC_RUN_ID
os.environ["TORCHELASTIC_RUN_ID"] = "none"         # as if torchrun gave no id
before_init = identity.resolve_identity().run      # agreed through torchrun's agent store
dist.init_process_group("gloo")
identity._agreed.clear()
after_init = identity.resolve_identity()           # agreed through the process group's store
sink = ServerSink(sys.argv[1], after_init, ack_timeout_s=0.5)
sink.hello({"natural": natural.run, "before_init": before_init})
ok = sink.flush(20)
sink.close()
dist.barrier()
dist.destroy_process_group()
sys.exit(0 if ok else 3)
"""


@pytest.mark.slow
def test_two_torchrun_ranks_agree_on_the_run_id_and_send_their_identity(tmp_path):
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    env = dict(os.environ, PYTHONPATH=str(ROOT), NAND_SPOOL_DIR=str(tmp_path / "spool"))
    with Receiver() as rx:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        cmd += [str(script), rx.endpoint]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=90)
        assert out.returncode == 0, out.stdout + out.stderr
        hellos = sorted((m["body"] for m in rx.all("hello")), key=lambda b: b["rank"])
    assert len(hellos) == 2, json.dumps(hellos)
    assert [(h["rank"], h["local_rank"], h["world_size"]) for h in hellos] == [(0, 0, 2), (1, 1, 2)]
    assert len({h["pid"] for h in hellos}) == 2
    for key in ("run", "natural", "before_init"):
        assert hellos[0][key] == hellos[1][key], key
    assert hellos[0]["natural"] != "none"
    assert hellos[0]["run"] != hellos[0]["natural"]  # agreed, not copied from the env
