"""``torch.save(model)`` of a watched model: it saves, loads without nand's
state, runs, and the watch goes on.

Torch keeps module hooks in the module's ``__dict__``, so pickling a model
pickles them; nand's become a no-op of the standard library there
(``hooks.SavableHook``). A parameter's hooks torch does not save.
"""

from __future__ import annotations

import copy
import functools
import io
import sys

import pytest
import torch
from torch import nn

import nand
from nand.agent.detect.savable import DORMANT_EVENT
from tests.agent.models import Net, arm_at, mlp, train, where


def saved_and_loaded(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def all_hooks(model: nn.Module) -> list:
    return [
        hook
        for m in model.modules()
        for hooks in (m._forward_hooks, m._forward_pre_hooks)
        for hook in hooks.values()
    ]


def dormant(hook: object) -> bool:
    return (
        type(hook) is functools.partial and hook.func is sys.audit and hook.args == (DORMANT_EVENT,)
    )


def plain_inputs(step: int) -> tuple[tuple, dict]:
    return (torch.randn(4, 8, generator=torch.Generator().manual_seed(step)),), {}


def first_tensor(out: object) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out  # type: ignore[return-value]


def net_inputs(step: int) -> tuple[tuple, dict]:
    gen = torch.Generator().manual_seed(step)
    return (torch.randn(4, 8, generator=gen),), {
        "extra": {"bias": torch.randn(1, 8, generator=gen)}
    }


@pytest.mark.parametrize("make", [lambda: mlp(plant_after=2), Net], ids=["sequential", "net"])
def test_a_watched_model_saves_and_its_copy_loads_and_runs(make):
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    inputs = net_inputs if isinstance(model, Net) else plain_inputs
    with nand.watch(model, opt, log_events=False) as w:
        train(model, opt, 2, inputs=inputs, loss_fn=lambda out, step: first_tensor(out).sum())
        loaded = saved_and_loaded(model)
    hooks = all_hooks(loaded)
    assert hooks and all(dormant(hook) for hook in hooks)  # nothing of the watch
    args, kwargs = inputs(5)
    with torch.no_grad():
        assert torch.equal(
            first_tensor(loaded(*args, **kwargs)), first_tensor(model(*args, **kwargs))
        )
    assert w.first is None


def test_the_watch_goes_on_after_a_save():
    model = mlp(plant_after=2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, log_events=False) as w:
        train(model, opt, 2)
        saved_and_loaded(model)
        train(model, opt, 3, before=arm_at(model[3], step=1, value=float("nan")))
    assert w.first is not None and where(w.first)[:4] == (3, 0, "forward", "3")


def test_a_deep_copy_holds_no_hook_of_the_watch():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt):
        twin = copy.deepcopy(model)
    hooks = all_hooks(twin)
    assert hooks and all(dormant(hook) for hook in hooks)
