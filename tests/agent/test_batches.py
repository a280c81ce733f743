"""``watch.new_batch``: where the batch does not enter through the root's
forward (Lightning's ``training_step`` calling a submodule), the batch marks
the micro-step and is checked as the input data."""

from __future__ import annotations

import torch
from torch import nn

import nand
from tests.agent.models import mlp


class Task(nn.Module):
    """A module whose training code calls its submodule, never itself."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return (self.net(x) - y).pow(2).mean()


def _run(bad: tuple[int, int] | None, accum: int = 2) -> nand.Watch:
    torch.manual_seed(0)
    task = Task()
    opt = torch.optim.SGD(task.parameters(), lr=1e-2)
    with nand.watch(task, opt) as w:
        for step in range(3):
            for micro in range(accum):
                batch = (torch.randn(4, 8), torch.randn(4, 4))
                if (step, micro) == bad:
                    batch[0][1, 2] = float("nan")
                w.new_batch(batch)
                task.training_step(batch).backward()
            opt.step()
            opt.zero_grad()
    return w


def test_a_non_finite_batch_is_input_data_at_its_micro_step():
    w = _run(bad=(1, 1))
    first = w.first
    assert (first.step, first.micro_step, first.phase, first.cause) == (1, 1, "input", "data")
    assert "batch[0]" in first.message


def test_batches_count_the_micro_steps_of_a_healthy_run():
    w = _run(bad=None, accum=3)
    assert w.first is None and w.step == 3
    assert [row.sites.count(None) for row in w.recorder.rows] == [3, 3, 3]
