"""torch.compile after nand.watch keeps every check; wrapper prefixes are dropped."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import nand
from nand.agent.detect.names import clean_name, unwrap
from tests.agent.models import VALUES, BackwardPlant, Plant, mlp, train

# The light mode sees what reaches the root's output: a -inf that the next
# ReLU zeroes is the full mode's to find (as in eager code).
MODES_AND_VALUES = [("full", kind) for kind in VALUES] + [("light", "nan"), ("light", "+inf")]


@pytest.mark.parametrize("mode,kind", MODES_AND_VALUES)
def test_a_model_compiled_after_watch_keeps_forward_checks(mode, kind):
    torch._dynamo.reset()
    model = mlp(plant_after=2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, mode=mode) as w:
        compiled = torch.compile(model, backend="aot_eager")

        def before(step, micro):
            model[3].value = VALUES[kind] if step == 3 else None

        train(compiled, opt, 5, before=before)
    assert (w.first.step, w.first.phase, w.first.module) == (3, "forward", "3")


def compiled_backward_fault(mode: str, backend: str | None = "aot_eager") -> nand.Event:
    """Module 1's backward writes a NaN at step 2 of a compiled model
    (``backend=None``: the same model, not compiled)."""
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(8, 16), BackwardPlant(), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, mode=mode) as w:
        compiled = torch.compile(model, backend=backend) if backend else model

        def before(step, micro):
            model[1].value = float("nan") if step == 2 else None

        train(compiled, opt, 4, before=before)
    assert w.first is not None
    return w.first


def test_a_compiled_model_s_backward_fault_is_bracketed_by_its_parameters_gradients_in_full():
    # Inside a compiled graph no gradient is probed: the parameters' gradients
    # show where backward went non-finite, between module 0 (its gradients
    # non-finite) and module 3 (finite); the culprit, 1, lies between.
    first = compiled_backward_fault("full")
    assert (first.step, first.phase, first.module) == (2, "backward", "3")
    assert "made between 0, the last module" in first.message
    assert "torch.compile" in first.message


def test_a_compiled_model_s_bracket_names_both_ends_and_the_next_module_s_type_in_full():
    # The whole note, and the module named: the first after the last module
    # with non-finite parameter gradients whose own stayed finite (module 3,
    # a Linear), not a module without parameters in between.
    first = compiled_backward_fault("full")
    assert first.module_type == "Linear"
    assert (
        "made between 0, the last module in forward order whose parameters got a non-finite "
        "gradient, and 3, the first after it whose parameters' gradients stayed finite"
    ) in first.message


class Scaled(nn.Module):
    """An MLP whose output the root scales by a parameter of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.body(x) * self.scale


@pytest.mark.parametrize("make,upstream", [(mlp, "4"), (Scaled, "<root>")], ids=["mlp", "root"])
def test_a_compiled_model_whose_every_parameter_gradient_is_nan_points_at_the_loss_in_full(
    make, upstream
):
    # The loss is finite but its gradient is not (sqrt of |x - x| at 0: 0 times
    # inf): every parameter gets a NaN gradient, none stays finite after the
    # last, so the gradient came into the model non-finite from the loss. The
    # note names the last module with parameters (the root itself: "<root>").
    torch._dynamo.reset()
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def loss_fn(out, step):
        kink = (out - out.detach()).abs().sqrt().sum() if step == 2 else 0.0
        return out.pow(2).mean() + kink

    with nand.watch(model, opt, mode="full") as w:
        train(torch.compile(model, backend="aot_eager"), opt, 4, loss_fn=loss_fn)
    first = w.first
    assert first is not None and (first.step, first.phase, first.module) == (2, "loss", "")
    note = f"every parameter up to {upstream} got a non-finite gradient"
    assert note in first.message, first.message


def test_a_compiled_model_s_backward_fault_is_exact_in_the_light_mode_by_an_eager_replay():
    # The light mode holds the step from the root's hooks, which compiled
    # code calls outside its graph, and replays it under force_eager with
    # every module probed: the backward node that made the NaN is module 1's.
    # Before: module 3 (the parameters' gradients), not replayed.
    first = compiled_backward_fault("light")
    assert (first.step, first.phase, first.module, first.cause) == (2, "backward", "1", "produced")
    assert first.reproduced is True
    eager = compiled_backward_fault("light", backend=None)  # what an eager model's replay says
    assert (first.op, first.source, first.replay) == (eager.op, eager.source, eager.replay)


@pytest.mark.parametrize("whole", [True, False], ids=["model", "one-layer"])
def test_a_compiled_model_is_not_recompiled_every_step(whole):
    # The hooks read a per-micro-step counter only outside dynamo: read in a
    # traced hook, dynamo would guard on its value and recompile every step.
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt) as w:
        if whole:
            run = torch.compile(model, backend=counter)
        else:  # a layer compiled on its own: its hooks traced, the root's not
            model[2] = torch.compile(model[2], backend=counter)
            run = model
        train(run, opt, 3)
        warm = counter.frame_count
        train(run, opt, 5)
    assert warm > 0 and counter.frame_count == warm
    assert w.first is None


def test_a_watched_compiled_model_reports_names_without_orig_mod():
    torch._dynamo.reset()
    model = mlp(plant_after=0)
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(compiled, opt) as w:
        model[1].value = float("inf")
        train(compiled, opt, 1)
    assert w.first.module == "1" and w.first.module_type == "Plant"


def test_wrapper_prefixes_are_stripped_from_names():
    assert clean_name("module._orig_mod.encoder.layers.0.fc1") == "encoder.layers.0.fc1"
    assert clean_name("_fsdp_wrapped_module.fc._checkpoint_wrapped_module.w") == "fc.w"

    class DistributedDataParallel(nn.Module):  # the shape of DDP: the model in .module
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, x):
            return self.module(x)

    inner = nn.Sequential(nn.Linear(8, 4), Plant())
    root, wrapped = unwrap(DistributedDataParallel(inner))
    assert root is inner and wrapped
    opt = torch.optim.SGD(inner.parameters(), lr=1e-2)
    ddp = DistributedDataParallel(inner)
    with nand.watch(ddp, opt) as w:
        inner[1].value = float("nan")
        train(ddp, opt, 1)
    assert w.first.module == "1"


def test_fsdp2_sharded_modules_are_reported_by_their_own_type(monkeypatch):
    """fully_shard swaps each module's class for FSDP<Type>: reports say <Type>."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29400 + os.getpid() % 500))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
        assert type(model[2]).__name__ == "FSDPLinear"  # (what torch does)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        with nand.watch(model, opt, log_events=False) as w:
            train(model, opt, 1)
            with torch.no_grad():
                model[2].weight.fill_(float("nan"))  # the local shard: the whole weight here
            train(model, opt, 2)
        assert w.first is not None and w.first.module_type == "Linear"
        assert w.first.module.startswith("2")
    finally:
        dist.destroy_process_group()


def test_events_go_to_a_jsonl_file_without_nan_literals(tmp_path):
    path = tmp_path / "events-{rank}.jsonl"
    model = mlp(plant_after=0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, events_file=str(path), on_nonfinite="skip"):
        model[1].value = float("nan")
        train(model, opt, 2)
    lines = [json.loads(line) for line in (tmp_path / "events-0.jsonl").read_text().splitlines()]
    assert [line["type"] for line in lines] == ["hello", "event", "bye"]
    event = lines[1]["event"]
    assert (event["step"], event["phase"], event["module"]) == (0, "forward", "1")
    assert event["min"] is None and lines[1]["flight"]["steps"] == [0]


def test_gradient_accumulation_under_compile_adds_no_recompile_per_micro_step():
    # A hook that appended to a Python list made dynamo guard on its length,
    # which differs at every micro-step: a recompile each (see compiled.py).
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt) as w:
        compiled = torch.compile(model, backend=counter)
        train(compiled, opt, 2, accum=4)
        warm = counter.frame_count
        train(compiled, opt, 3, accum=4)
    assert counter.frame_count == warm
    assert w.first is None and not w._guard.off


def test_a_fault_found_under_compile_says_what_was_checked():
    torch._dynamo.reset()
    model = mlp(plant_after=2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, mode="full") as w:  # (the full mode's slots)
        compiled = torch.compile(model, backend="aot_eager")

        def before(step, micro):
            model[3].value = float("-inf") if (step, micro) == (1, 2) else None

        train(compiled, opt, 3, before=before, accum=3)
    assert (w.first.step, w.first.phase, w.first.module) == (1, "forward", "3")
    assert w.first.micro_step == 0  # folded: the slots hold one figure per window
    assert "under torch.compile" in w.first.message
    assert "shape not recorded" in w.first.message
