"""Optimizers as frameworks hand them over: nand hooks the one that updates."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from lightning.pytorch.core.optimizer import LightningOptimizer

import nand
from nand.errors import ConfigError
from tests.agent.models import mlp, train, where


def _find_forward_fault(model, wrapped_opt, real_opt) -> nand.Event:
    with nand.watch(model, wrapped_opt) as w:

        def before(step, micro):
            model[3].value = float("nan") if step == 2 else None

        train(model, real_opt, 4, before=before)
    assert w.first is not None
    return w.first


def test_accelerate_s_prepared_optimizer_is_watched_as_the_optimizer_it_wraps():
    model = mlp(plant_after=2)
    accelerator = Accelerator(cpu=True)
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-2))
    first = _find_forward_fault(model, opt, opt)
    assert where(first) == (2, 0, "forward", "3", "produced")


def test_lightning_s_optimizer_wrapper_is_looked_through():
    model = mlp(plant_after=2)
    inner = torch.optim.SGD(model.parameters(), lr=1e-2)
    first = _find_forward_fault(model, LightningOptimizer(inner), inner)
    assert where(first) == (2, 0, "forward", "3", "produced")


def test_a_chain_of_wrappers_holding_the_optimizer_in_optimizer_is_followed():
    class Engine:  # the shape of DeepSpeed's: the real one two levels down
        def __init__(self, optimizer):
            self.optimizer = optimizer

    model = mlp(plant_after=2)
    inner = torch.optim.Adam(model.parameters(), lr=1e-3)
    first = _find_forward_fault(model, Engine(Engine(inner)), inner)
    assert where(first)[:4] == (2, 0, "forward", "3")


@pytest.mark.parametrize("given", ["adam", object(), None.__class__])
def test_anything_else_is_a_one_line_config_error_that_says_what_is_expected(given):
    with pytest.raises(ConfigError) as raised:
        nand.watch(mlp(), given)
    message = str(raised.value)
    assert "\n" not in message
    assert "expected a torch.optim.Optimizer" in message
    assert type(given).__name__ in message
