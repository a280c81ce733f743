"""Silent replica divergence in a real torchrun DDP job (gloo, CPU): one rank's
weight written off by a finite amount, or by one flipped low bit, after a
known optimizer step (the ground truth, planted by ``nand.demo.faults``; nand
is not told) → the server's verdict is ``replica_mismatch``, naming that rank,
the parameter and the fingerprinted steps around the write (issue 18), also
when the write came after the last scheduled fingerprint (the one each rank
takes at close); a rank whose last update failed is not taken for a drift."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

import nand
from nand.agent.detect import hooks
from nand.demo.trainer import build_model
from nand.testing import free_port
from tests.e2e.conftest import TOKEN, embedded_test_server
from tests.e2e.jobs import TRAINER, agent_env, launch, settled_verdict, torchrun

pytestmark = pytest.mark.slow

MODULE = "2"  # the MLP's last Linear (``--model mlp``)


def run_job(server, tmp_path, run: str, every: int, *args: str, ranks: int = 3) -> dict:
    env = agent_env(server.zmq_endpoint, run, TOKEN, NAND_FINGERPRINT_STEPS=str(every))
    command = [*torchrun(ranks), *TRAINER, "--model", "mlp", *args]
    job = launch(command, env, tmp_path / f"{run}.log")
    assert job.wait() == [0], (tmp_path / f"{run}.log").read_text()[-3000:]
    return settled_verdict(server.http_url, run, ranks)


def expected_bracket(written_after_step: int, every: int) -> tuple[int, int]:
    """The fingerprint at step S holds the parameters after S updates; a write
    after the update of loop step k is first seen at the first S > k."""
    first_bad = (written_after_step // every + 1) * every
    return first_bad - every, first_bad


@pytest.mark.parametrize(
    ("kind", "rank", "step", "every"), [("drift", 1, 3, 2), ("bitflip", 2, 5, 3)]
)
def test_a_rank_whose_weights_were_written_off_is_named_between_two_fingerprints(
    nand_server, tmp_path, kind, rank, step, every
):
    fault = f"{kind}:rank={rank}:step={step}:module={MODULE}"
    verdict = run_job(nand_server, tmp_path, kind, every, "--steps", "14", "--fault", fault)
    assert verdict["state"] == "replica_mismatch", verdict["summary"]
    good, bad = expected_bracket(step, every)
    replica = verdict["replica"]
    assert (replica["ranks"], replica["last_good_step"], replica["first_bad_step"]) == (
        [rank],
        good,
        bad,
    )
    assert replica["params"] == [f"{MODULE}.weight"]
    assert verdict["origin"] is None  # everything stayed finite


def test_a_rank_whose_optimizer_state_was_written_off_is_named_before_its_weights_differ(
    nand_server, tmp_path
):
    """AdamW's exp_avg of one element changed after the update of step 4, on
    rank 2 only: fingerprinted every step, the state differs at step 5, before
    the next update carries it into the weight."""
    fault = f"state_drift:rank=2:step=4:module={MODULE}"
    verdict = run_job(nand_server, tmp_path, "state", 1, "--steps", "10", "--fault", fault)
    assert verdict["state"] == "replica_mismatch", verdict["summary"]
    replica = verdict["replica"]
    assert (replica["ranks"], replica["last_good_step"], replica["first_bad_step"]) == ([2], 4, 5)
    assert replica["params"] == [f"{MODULE}.weight:exp_avg"]


def test_drift_after_the_last_scheduled_fingerprint_is_bracketed_up_to_the_last_step(
    nand_server, tmp_path
):
    """Two ranks, 8 steps, rank 1's weight written off after step 3, one
    fingerprint per 100 steps (the default): step 0 is the only scheduled
    one. The fingerprint each rank takes when it closes (of the weights after
    its last update, step 8) differs: the run must not read ``finished`` and
    ``consistent`` with a corrupt replica."""
    fault = f"drift:rank=1:step=3:module={MODULE}"
    verdict = run_job(
        nand_server, tmp_path, "late-drift", 100, "--steps", "8", "--fault", fault, ranks=2
    )
    assert verdict["state"] == "replica_mismatch", verdict["summary"]
    replica = verdict["replica"]
    # Two replicas: both are named (nobody can tell which is right).
    assert (replica["ranks"], replica["last_good_step"], replica["first_bad_step"]) == (
        [0, 1],
        0,
        8,
    )
    assert replica["params"] == [f"{MODULE}.weight"]
    assert "between steps 0 and 8" in verdict["summary"]


def test_a_healthy_ddp_run_of_200_steps_agrees_up_to_its_last_step_without_a_warning(
    nand_server, tmp_path
):
    verdict = run_job(nand_server, tmp_path, "healthy", 10, "--steps", "200")
    assert verdict["state"] == "finished", verdict["summary"]
    assert verdict["replica"]["state"] == "consistent"
    # The last fingerprint taken at a step boundary is step 190's (the
    # boundary before the 191st update); step 200's is the one taken at close.
    assert verdict["replica"]["last_good_step"] == 200
    # Three ranks of different batches for 200 steps: no rank's gradients stood
    # out, nor did any loss or norm spike (zero false warnings).
    assert verdict["warnings"]["count"] == 0, verdict["warnings"]


#: Two jobs in one pair of processes (half the start-ups), a fault on rank 1
#: in each: run name → (what fails, fingerprint every N steps).
CLOSING = {"last-update-failed": ("update", 100), "nand-switched-off": ("nand", 5)}
CLOSING_STEPS = 8


@pytest.fixture(scope="module")
def closing_verdicts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict]]:
    with embedded_test_server(tmp_path_factory.mktemp("closing")) as server:
        mp.spawn(_closing_ranks, args=(free_port(), server.zmq_endpoint), nprocs=2, join=True)
        yield {run: settled_verdict(server.http_url, run, 2) for run in CLOSING}


def test_a_rank_that_fails_in_its_last_update_is_not_taken_for_a_drifted_replica(
    closing_verdicts,
):
    """Rank 1's last ``optimizer.step()`` raises after nand counted it and
    before the update (an error in a step pre-hook, as an out-of-memory would):
    its weights are those of step 7, rank 0's of step 8. Only a clean close
    fingerprints its last state, so no false mismatch."""
    verdict = closing_verdicts["last-update-failed"]
    assert verdict["state"] != "replica_mismatch", verdict["summary"]
    assert verdict["replica"]["state"] == "consistent"
    assert verdict["replica"]["last_good_step"] == 0


def test_a_rank_on_which_nand_switched_itself_off_is_not_taken_for_a_drifted_replica(
    closing_verdicts,
):
    """A bug inside nand (planted in rank 1's forward hooks at step 5)
    switches it off there: it counts no more steps, so its weights at close
    are not those of the step it counted last (5), which rank 0 fingerprinted."""
    verdict = closing_verdicts["nand-switched-off"]
    assert verdict["state"] != "replica_mismatch", verdict["summary"]
    assert verdict["replica"]["state"] == "consistent"
    assert verdict["replica"]["last_good_step"] == 0  # (step 5, 8: rank 0's alone)


def _closing_ranks(rank: int, port: int, endpoint: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        NAND_SERVER=endpoint,
        NAND_TOKEN=TOKEN,
        NAND_HEARTBEAT_S="0.5",
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    for run, (fails, every) in CLOSING.items():
        os.environ.update(NAND_RUN=run, NAND_FINGERPRINT_STEPS=str(every))  # (read by nand.watch)
        _closing_job(rank, fails if rank == 1 else "")
    dist.destroy_process_group()


def _closing_job(rank: int, fails: str) -> None:
    torch.manual_seed(0)
    model = DistributedDataParallel(build_model("mlp"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    clock = [0]

    def fail_update(*_: object) -> None:
        if clock[0] == CLOSING_STEPS - 1:
            raise RuntimeError("planted: the last update failed")

    nand_bug = RuntimeError("planted: a bug inside nand")
    with contextlib.ExitStack() as stack:
        stack.enter_context(contextlib.suppress(RuntimeError))
        stack.enter_context(nand.watch(model, opt, log_events=False))
        if fails == "update":
            opt.register_step_pre_hook(fail_update)  # after nand's own: the step is counted
        for step in range(CLOSING_STEPS):
            clock[0] = step
            if fails == "nand" and step == 5:  # (called by every forward hook)
                stack.enter_context(mock.patch.object(hooks, "_is_compiling", side_effect=nand_bug))
            data = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * step + rank))
            model(data).square().mean().backward()
            opt.step()
            opt.zero_grad()
