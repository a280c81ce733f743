"""What nand changes for the whole process is made once and named while it
is in place (``nand/agent/patches.py``)."""

from __future__ import annotations

import atexit

import torch

import nand
from nand.agent import patches
from tests.agent.models import mlp


def test_the_scaler_patch_is_named_while_a_watch_listens_and_gone_after_it_closes():
    opt = torch.optim.SGD(mlp().parameters(), lr=1e-2)
    with nand.watch(mlp(), opt, log_events=False):
        assert "GradScaler.step" in patches.installed()
    assert "GradScaler.step" not in patches.installed()


def test_watches_read_one_step_late_register_their_exit_flush_once_per_process():
    """Each deferred watch's read at exit runs from one ``atexit`` handler,
    however many watches there were."""
    with nand.watch(mlp(), None, read="deferred", log_events=False):
        pass  # (the first deferred watch of this process, or not: either way)
    registered = atexit._ncallbacks()
    for _ in range(3):
        with nand.watch(mlp(), None, read="deferred", log_events=False) as w:
            assert w.deferred
    assert atexit._ncallbacks() == registered
    assert "at exit: deferred reads" in patches.installed()


def test_the_pipeline_stage_is_wrapped_while_a_watch_is_open_and_restored_after():
    from torch.distributed.pipelining.stage import _PipelineStageBase

    original = _PipelineStageBase.forward_one_chunk
    with nand.watch(mlp(), None, log_events=False), nand.watch(mlp(), None, log_events=False):
        assert "pipeline stage chunks" in patches.installed()
        assert _PipelineStageBase.forward_one_chunk is not original
    assert "pipeline stage chunks" not in patches.installed()
    assert _PipelineStageBase.forward_one_chunk is original
