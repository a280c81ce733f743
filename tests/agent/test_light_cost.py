"""What the light mode costs a healthy step: the work nand adds, counted.

Timings belong to ``benchmarks/`` (a shared machine cannot hold a test to
microseconds); these tests count what the step does instead: calls from
autograd into nand's Python in backward, module hooks on the root.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch import nn

import nand
from tests.agent.models import mlp

NAND_DIR = nand.__file__.rsplit("/", 1)[0]


#: ``Tensor.backward`` as nand wraps it (``patches.listen_to_backward``): the
#: loop's own call into nand, once a backward, to check the loss (issue 42).
THE_LOSS_S_CHECK = "_backward"


def entries_into_nand(action: Callable[[], Any]) -> list[str]:
    """The nand functions entered from outside nand while ``action`` runs:
    in a backward, each is one call that autograd makes into a hook of nand's
    (after the loop's own call of ``Tensor.backward``, :data:`THE_LOSS_S_CHECK`)."""
    entered: list[str] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(NAND_DIR):
            return
        caller = frame.f_back
        if caller is None or not caller.f_code.co_filename.startswith(NAND_DIR):
            entered.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        action()
    finally:
        sys.setprofile(None)
    return entered


def test_autograd_calls_nand_once_a_light_backward_to_hold_and_check_the_output_gradient():
    """The gradient arriving at the model's output is both held for a replay
    and checked (the ``loss`` phase): one node hook does both, so the engine
    calls into Python once a backward, not once for each."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, mode="light") as watch:
        for _ in range(3):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            entered = entries_into_nand(loss.backward)
            opt.step()
            opt.zero_grad()
        assert entered[0] == THE_LOSS_S_CHECK and len(entered) == 2, entered
        # Both jobs done: the gradient is held, and the loss check is in the window.
        model(torch.randn(4, 8)).pow(2).mean().mul(float("nan")).backward()
        held = watch._rerun.held
        assert held is not None and list(held.steps[-1].grads) == [""]
        opt.step()
    assert watch.first is not None
    assert (watch.first.phase, watch.first.module, watch.first.cause) == ("loss", "", "produced")


def test_a_root_output_that_is_not_its_nodes_first_output_is_held_and_checked_by_one_tensor_hook():
    """An output that autograd's node made second (``split``) takes a tensor
    hook, not a node hook: still one call a backward, for both jobs."""

    class Halves(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).split(4, dim=1)[1]

    model = Halves()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, mode="light") as watch:
        loss = model(torch.randn(4, 8)).pow(2).mean()
        entered = entries_into_nand(loss.backward)
        assert entered[0] == THE_LOSS_S_CHECK and len(entered) == 2, entered
        opt.step()
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().mul(float("inf")).backward()
        opt.step()
    assert watch.first is not None
    assert (watch.first.phase, watch.first.module) == ("loss", "")


class CustomMLP(nn.Module):
    """An MLP as most code writes it: its own class (whose attributes a
    replay holds), layers as attributes, ``F.relu`` inline."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def nand_calls_per_step(model: nn.Module, steps: int = 20) -> float:
    """Python function calls into nand's code (every frame of nand's, not
    only the entries) per healthy light training step, after a warm-up."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8)
    calls = 0

    def step() -> None:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call" and frame.f_code.co_filename.startswith(NAND_DIR):
            calls += 1

    with nand.watch(model, opt, mode="light", log_events=False) as watch:
        for _ in range(12):  # (the early warnings' windows fill up: their usual path)
            step()
        # Objects of earlier tests in this worker (a watch of theirs, its
        # finalizers) are collected now, not inside the counted steps: a
        # collection there ran nand's code that is no part of this step.
        gc.collect()
        gc.disable()
        sys.setprofile(profile)
        try:
            for _ in range(steps):
                step()
        finally:
            sys.setprofile(None)
            gc.enable()
        assert watch.first is None and watch.step == 12 + steps
    return calls / steps


#: The most Python calls into nand a healthy light step of an MLP may make:
#: the root's two hooks (the input's probe, holding the step for a replay),
#: the output gradient's hook, and the optimizer pre-hook (the gradients'
#: norm, the one read, the early warnings, the plan for the parameters).
#: Before the cuts of issue 32's MLP round: 76 (custom module), 75 (Sequential).
#: Then 68; 72 with the per-layer history (``detect/sampling.py``): the
#: sampled module's hook and its probe, and moving the sample on at the read.
#: Then 87 (issue 42): the loss a backward starts from, checked in the read
#: (the wrapped ``Tensor.backward``, its listener, the window's losses), the
#: recording of the loss computation for a replay (the root's return, one
#: call of the recorder per torch call of the loss, each with its line) and
#: the line that called the model, held with the step (15 calls).
#: Then 89 (issue 43): the root's two hooks are each called through a small
#: wrapper that runs them outside a compiled graph (``detect/eager.py``: one
#: frame more per hook; it replaced the compile switch's check), and the
#: read asks whether the model ran compiled (``Tiers.compiled``).
MAX_NAND_CALLS_A_LIGHT_STEP = 89


def test_a_healthy_light_mlp_step_calls_into_nands_python_no_more_than_it_needs():
    """Each call is Python run between the model's kernels on every step; the
    light mode's per-step cost on a small model is mostly these (issue 32):
    a cut that comes back shows here, whatever the machine's load."""
    torch.manual_seed(0)
    for model in (CustomMLP(), mlp()):
        calls = nand_calls_per_step(model)
        assert calls <= MAX_NAND_CALLS_A_LIGHT_STEP, (type(model).__name__, calls)
