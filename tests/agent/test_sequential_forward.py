"""An exact ``nn.Sequential`` root calls its nand-hooked children itself.

``sequential.SequentialForward`` skips ``Module.__call__``'s hook machinery
for a child whose only hook is nand's. It must change nothing a user can
see: the same findings, every other hook run, children added later called,
a deep copy plain, nothing left behind by ``close``.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import nand
from nand.agent.sequential import SequentialForward
from tests.agent.models import BackwardPlant, arm_at, mlp, train, where


def plain_hook_everywhere():
    """A no-op global forward hook: every module call takes torch's slow path,
    so the children are called as nn.Sequential.forward calls them."""
    return nn.modules.module.register_module_forward_hook(lambda *args: None)


@pytest.mark.parametrize("value", ["nan", "-inf"])
@pytest.mark.parametrize("plant", ["forward", "backward"])
def test_findings_are_the_same_with_and_without_the_fast_calls(plant, value):
    found = {}
    for fast in (True, False):
        torch.manual_seed(0)
        model = mlp(plant_after=2)
        if plant == "backward":
            model[3] = BackwardPlant()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        handle = None if fast else plain_hook_everywhere()
        try:
            with nand.watch(model, opt, log_events=False) as w:
                assert isinstance(model.__dict__["forward"], SequentialForward)
                train(model, opt, 4, before=arm_at(model[3], step=2, value=float(value)))
                first = w.first
                assert first is not None
                found[fast] = (where(first), first.shape, first.nan, first.neginf)
        finally:
            if handle is not None:
                handle.remove()
    assert found[True] == found[False]
    assert found[True][0][:3] == (2, 0, plant)


def test_the_hooked_linears_skip_module_call_unless_another_hook_is_there(monkeypatch):
    through_call: list[str] = []
    module_call = nn.Module.__call__

    def counting_call(self, *args, **kwargs):
        through_call.append(type(self).__name__)
        return module_call(self, *args, **kwargs)

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt) as w:
        monkeypatch.setattr(nn.Linear, "__call__", counting_call)
        monkeypatch.setattr(nn.ReLU, "__call__", counting_call)
        train(model, opt, 2)
        assert through_call == ["ReLU", "ReLU"] * 2  # the Linears carry nand's hook only
        through_call.clear()
        seen = []
        model[2].register_forward_hook(lambda *args: seen.append("2"))
        train(model, opt, 1)
        assert through_call == ["ReLU", "Linear", "ReLU"] and seen == ["2"]
        assert len(w.flight_window().steps) == 3
    assert "forward" not in model.__dict__


def test_a_users_hook_added_after_watch_runs_with_nands():
    model = mlp(plant_after=2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    seen: list[torch.Size] = []
    with nand.watch(model, opt, log_events=False) as w:
        model[2].register_forward_hook(lambda m, args, out: seen.append(out.shape))
        train(model, opt, 3, before=arm_at(model[3], step=1, value=float("nan")))
    assert seen == [torch.Size([4, 16])] * 3
    assert w.first is not None and where(w.first)[:4] == (1, 0, "forward", "3")


def test_children_replaced_or_appended_after_watch_are_called():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, log_events=False) as w:
        train(model, opt, 1)
        model[4] = nn.Linear(16, 6)  # not hooked by nand, called all the same
        model.append(nn.Tanh())
        x = torch.randn(4, 8)
        out = model(x)
        with torch.no_grad():
            expected = torch.tanh(model[4](model[3](model[2](model[1](model[0](x))))))
        assert out.shape == (4, 6) and torch.equal(out, expected)
    assert w.first is None


def test_children_called_without_the_root_are_still_checked():
    """``checkpoint_sequential``, a pipeline stage, a loop over the model:
    nand's hooks stay on the children."""
    model = mlp(plant_after=2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    with nand.watch(model, opt, log_events=False) as w:
        arm = arm_at(model[3], step=1, value=float("inf"))
        for step in range(3):
            arm(step, 0)
            h = torch.randn(4, 8)
            for child in model:
                h = child(h)
            h.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert w.first is not None and where(w.first)[:4] == (1, 0, "forward", "3")


def test_deep_copies_and_pickles_get_a_plain_forward():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(4, 8)
    with nand.watch(model, opt):
        train(model, opt, 1)
        expected = model(x)
        copies = [copy.deepcopy(model), pickle.loads(pickle.dumps(model))]
    for other in copies:
        assert not isinstance(other.__dict__.get("forward"), SequentialForward)
        assert torch.equal(other(x), expected)


def test_close_restores_the_forward_and_a_shallow_copy_goes_plain():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    w = nand.watch(model, opt)
    shallow = copy.copy(model)  # shares the children and the forward object
    w.close()
    assert "forward" not in model.__dict__
    assert shallow.__dict__["forward"].hooks == {}  # nothing of the watch kept alive
    calls: list[str] = []
    for name, child in model.named_children():
        child.register_forward_pre_hook(lambda *args, name=name: calls.append(name))
    shallow(torch.randn(4, 8))
    assert calls == ["0", "1", "2", "3", "4"]  # each child through Module.__call__


def test_a_forward_set_by_someone_else_is_left_alone():
    model = mlp()
    own = model.forward
    model.forward = lambda x: own(x) * 2  # type: ignore[method-assign]
    wrapper = model.forward
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, log_events=False) as w:
        assert model.forward is wrapper
        train(model, opt, 2)
    assert model.forward is wrapper and w.first is None


def test_torch_fx_still_sees_the_children_as_module_calls():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt):
        graph = torch.fx.symbolic_trace(model).graph
    assert [node.target for node in graph.nodes if node.op == "call_module"] == list("01234")
