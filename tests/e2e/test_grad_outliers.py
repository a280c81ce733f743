"""A DDP rank whose own gradients stand out (issue 18): four real processes
(gloo, CPU) train transformers' BERT as a regressor
(``BertForSequenceClassification`` with one label), and at a known step rank
2's batch holds targets scaled by 1000 (its shard of the data in other
units). After the all-reduce every rank holds the same gradients; only each
rank's own, before it, tell which one was fed the odd batch.

The ground truth comes from the same job run without nand (first, in the
same processes): a plain DDP communication hook records each rank's own
gradient norm before the all-reduce, and the test checks there that the
planted step on rank 2 is the only place where one rank's norm is 100 times
every other's (elsewhere the ranks' norms differ by up to 5 times: batches of
four samples). Then the job runs under nand, reporting to a real server,
whose verdict must carry one ``grad_outlier`` warning, naming that rank and
step, and no other.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from nand.testing import free_port
from tests.e2e.conftest import TOKEN
from tests.e2e.jobs import settled_verdict
from tests.integrations.zoo import BATCH, HEADS, HIDDEN, LAYERS, SEQ, VOCAB

pytestmark = pytest.mark.slow

WORLD, STEPS = 4, 14
ODD_RANK, ODD_STEP = 2, 9  # (the loop's step index, which is nand's step)


def _bert_regressor() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        num_hidden_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        intermediate_size=2 * HIDDEN,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        num_labels=1,  # one float label: transformers trains it with MSE
    )
    return BertForSequenceClassification(config)


def _batch(rank: int, step: int, scaled: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randn(BATCH, generator=gen)
    return {"input_ids": ids, "labels": labels * 1000 if scaled else labels}


class _NormRecorder:
    """Ground truth: DDP's default all-reduce, after noting the bucket's norm."""

    def __init__(self) -> None:
        self.squares = 0.0

    def hook(self, group, bucket):  # (unannotated: DDP checks real annotations' types)
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        self.squares += float(bucket.buffer().double().pow(2).sum())
        return default_hooks.allreduce_hook(group, bucket)

    def take(self) -> float:
        norm, self.squares = self.squares**0.5, 0.0
        return norm


def _rank_main(rank: int, port: int, endpoint: str, results: dict) -> None:
    """The job twice in the same processes (half the start-ups): first the
    ground truth without nand, then the same training under nand."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    results[rank] = _job(rank, watched=False)
    os.environ.update(
        NAND_SERVER=endpoint, NAND_RUN="outlier", NAND_TOKEN=TOKEN, NAND_HEARTBEAT_S="0.5"
    )
    _job(rank, watched=True)
    dist.destroy_process_group()


def _job(rank: int, watched: bool) -> list[float]:
    """One training run from the same seed; without nand, each step's own
    gradient norm before the all-reduce (the ground truth)."""
    torch.manual_seed(0)
    model = DistributedDataParallel(_bert_regressor())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    recorder = None if watched else _NormRecorder()
    if recorder is not None:
        model.register_comm_hook(None, recorder.hook)
    return _train(model, opt, rank, recorder, watched)


def _train(model: nn.Module, opt: Any, rank: int, recorder: Any, watched: bool) -> list[float]:
    import nand

    norms = []
    watching = nand.watch(model, opt, log_events=False) if watched else contextlib.nullcontext()
    with watching:
        for step in range(STEPS):
            batch = _batch(rank, step, scaled=(rank, step) == (ODD_RANK, ODD_STEP))
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
            if recorder is not None:
                norms.append(recorder.take())
    return norms


def _run(endpoint: str) -> dict[int, list[float]]:
    """The ground truth's norms by rank; the watched run reports to ``endpoint``."""
    results = mp.Manager().dict()
    mp.spawn(_rank_main, args=(free_port(), endpoint, results), nprocs=WORLD, join=True)
    return dict(results)


def _lone_standouts(norms: dict[int, list[float]], factor: float) -> list[tuple[int, int]]:
    """``(rank, step)`` where one rank's norm is ``factor`` times every other's."""
    found = []
    for step in range(STEPS):
        at_step = sorted((norms[rank][step], rank) for rank in range(WORLD))
        (top, rank), (second, _) = at_step[-1], at_step[-2]
        if top > factor * second:
            found.append((rank, step))
    return found


def test_the_rank_fed_a_batch_scaled_by_1000_is_named_at_its_step(nand_server):
    truth = _run(nand_server.zmq_endpoint)
    assert _lone_standouts(truth, 100.0) == [(ODD_RANK, ODD_STEP)]
    healthy = [s for s in range(STEPS) if s != ODD_STEP]
    for step in healthy:  # the other steps: batches of 4 differ, but not by 10x
        at_step = [truth[rank][step] for rank in range(WORLD)]
        assert max(at_step) < 10 * min(at_step), (step, at_step)

    verdict = settled_verdict(nand_server.http_url, "outlier", WORLD)
    outliers = [w for w in _warnings(nand_server.http_url) if w["kind"] == "grad_outlier"]
    assert [(w["rank"], w["step"]) for w in outliers] == [(ODD_RANK, ODD_STEP)], outliers
    odd = outliers[0]
    expected = truth[ODD_RANK][ODD_STEP]  # nand's norm is float32-accumulated
    assert odd["value"] == pytest.approx(expected, rel=1e-3)
    assert odd["message"].startswith(f"own gradient norm at step {ODD_STEP}, before")
    assert verdict["state"] == "finished"  # a warning, never an incident
    assert verdict["warnings"]["by_kind"]["grad_outlier"] == 1


def _warnings(base: str) -> list[dict[str, Any]]:
    from nand.client import request_json, run_url

    return request_json(run_url(base, "outlier", "/warnings"))
