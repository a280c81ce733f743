"""Replay of a bad step (``nand.agent.rerun``): the exact op, its line, reproduced or not.

The faults here are written in this file, so the line nand names can be
checked against this file's own lines; the ground truth (which op, which
line) is found without nand, by running the same step under a plain
``TorchDispatchMode``. Real models from ``tests/integrations`` check that a
replay leaves training exactly as ``skip`` without a replay would have.
"""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch
from torch import Tensor, nn

import nand


def line_of(function, text: str) -> str:
    """``path:line`` of the line of ``function`` that contains ``text``."""
    lines, start = inspect.getsourcelines(function)
    index = next(i for i, line in enumerate(lines) if text in line)
    return f"{inspect.getsourcefile(function)}:{start + index}"


class Log(nn.Module):
    """log |x|: -inf where x is exactly 0 (a zero row of the batch through a
    Linear without bias). ``once_at``: zero its input on that call only (a
    fault that does not come back: its calls are counted by an iterator,
    which a replay does not rewind as it does a plain attribute)."""

    def __init__(self, once_at: int | None = None) -> None:
        super().__init__()
        self.calls = itertools.count(1)
        self.once_at = once_at

    def forward(self, x: Tensor) -> Tensor:
        if next(self.calls) == self.once_at:
            x = x * 0
        return torch.log(x.abs())


class Sqrt(nn.Module):
    """sqrt |x|: finite in forward; at x = 0 its backward divides by zero."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.sqrt(x.abs())


def model_with(middle: nn.Module, dropout: float = 0.0, norm: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16, bias=False), middle, nn.Linear(16, 16), nn.Tanh()]
    if norm:
        layers.insert(3, nn.BatchNorm1d(16))
    if dropout:
        layers.insert(3, nn.Dropout(dropout))
    return nn.Sequential(*layers, nn.Linear(16, 4))


def batch(step: int, zero_row_at: int | None = None) -> Tensor:
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
    if step == zero_row_at:
        x[2] = 0.0
    return x


def train(model, opt, steps: int, zero_row_at: int | None = None, accum: int = 1) -> list[float]:
    losses = []
    for step in range(steps):
        for micro in range(accum):
            x = batch(step * accum + micro, zero_row_at)
            loss = model(x).pow(2).mean() / accum
            losses.append(loss.item())
            loss.backward()
        opt.step()
        opt.zero_grad()
    return losses


def first_event_of(middle: nn.Module):
    """The first event of 4 steps of ``model_with(middle)`` whose batch at step 2
    has a zero row (under ``skip``)."""
    model = model_with(middle)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, on_nonfinite="skip") as watch:
        train(model, opt, 4, zero_row_at=2)
    return watch.first


def test_a_log_of_zero_in_forward_is_named_as_aten_log_at_this_file_s_line():
    event = first_event_of(Log())
    assert (event.step, event.phase, event.module) == (2, "forward", "1")
    assert event.op == "aten::log"
    assert event.source == line_of(Log.forward, "torch.log")
    assert event.reproduced is True
    assert "aten::log" in event.message


def test_a_backward_only_nan_is_named_as_the_backward_op_at_the_forward_line_of_this_file():
    event = first_event_of(Sqrt())
    assert (event.step, event.phase, event.module) == (2, "backward", "1")
    truth = first_op_without_nand(model_with(Sqrt()), batch(2, zero_row_at=2))
    assert truth == ("aten::div.Tensor", "SqrtBackward0")
    assert event.op == "aten::div.Tensor"
    assert event.source == line_of(Sqrt.forward, "torch.sqrt")
    assert event.reproduced is True


class WritesNan(nn.Module):
    """Fills the zero entries of its input with NaN from a Python number: a
    bug writing the value itself, not a mask's -inf on purpose."""

    def forward(self, x: Tensor) -> Tensor:
        return x.masked_fill(x == 0, float("nan"))


def test_a_nan_written_from_a_python_number_is_named_as_that_op_not_as_a_probe_of_nands():
    # Before: the full mode passed over the op (a constant, like a mask's
    # -inf), found nothing else, and said the replay did not make it again
    # (suspect the device); the light mode named its own probe, aten::aminmax.out.
    event = first_event_of(WritesNan())
    assert (event.step, event.phase, event.module) == (2, "forward", "1")
    assert event.op == "aten::masked_fill.Scalar"
    assert event.source == line_of(WritesNan.forward, "masked_fill")
    assert event.reproduced is True
    assert "written from a non-finite Python number" in event.replay


@pytest.mark.nand_mode("full")  # (the light mode's: test_light_tier.py)
def test_a_fault_that_fires_once_is_not_reproduced_and_the_device_is_suspected():
    model = model_with(Log(once_at=3))  # the third call: step 2
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, on_nonfinite="skip") as watch:
        train(model, opt, 4)
    event = watch.first
    assert (event.step, event.phase, event.module) == (2, "forward", "1")
    assert event.reproduced is False
    assert event.op == ""
    assert "suspect the device" in event.message


class Counted(nn.Module):
    """log |x|, its input zeroed at call ``at`` of the run: the module counts
    its calls in a plain attribute, which the step's forward left changed."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.calls, self.at = 0, at

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return torch.log((x * 0 if self.calls == self.at else x).abs())


def test_a_replay_runs_with_the_plain_attributes_its_call_started_with_and_leaves_those_of_now():
    model = model_with(Counted(at=3))  # the third call: step 2
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, on_nonfinite="skip") as watch:
        train(model, opt, 4)
    event = watch.first
    assert (event.step, event.phase, event.module, event.cause) == (2, "forward", "1", "produced")
    assert (event.op, event.reproduced) == ("aten::log", True)
    assert model[1].calls == 4  # the training loop's calls: the replay's is not kept


def test_gradient_accumulation_replays_the_micro_step_that_went_bad():
    model = model_with(Log())
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, on_nonfinite="skip") as watch:
        train(model, opt, 3, zero_row_at=4, accum=3)  # step 1, micro-step 1
    event = watch.first
    assert (event.step, event.micro_step, event.phase) == (1, 1, "forward")
    assert (event.op, event.reproduced) == ("aten::log", True)
    assert "micro-step 1" in event.replay


def first_op_without_nand(model: nn.Module, x: Tensor) -> tuple[str, str]:
    """Ground truth: the first aten op that outputs a non-finite value from
    finite inputs in ``model``'s forward and backward, and the autograd node
    running it ("" in forward); a plain dispatch mode, no nand."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    def finite(value) -> bool:
        return all(
            bool(torch.isfinite(t).all())
            for t in tree_leaves(value)
            if isinstance(t, Tensor) and t.is_floating_point()
        )

    found: list[tuple[str, str]] = []

    class First(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not found and finite((args, kwargs)) and not finite(out):
                node = torch._C._current_autograd_node()
                name = f"{func._schema.name}.{func._overloadname}".removesuffix(".default")
                found.append((name, type(node).__name__ if node else ""))
            return out

    with First():
        model(x).pow(2).mean().backward()
    return found[0]


# --- real models: a replay leaves training as ``skip`` alone would -----------


def twin_runs(case_name: str, fault, monkeypatch: pytest.MonkeyPatch, steps: int, mode=None):
    """The same faulty run with ``skip``, with replay and without (NAND_REPLAYS=0)."""
    from tests.integrations.loops import FP32, with_nand

    replayed = with_nand(case_name, mode or FP32, fault, steps, on_nonfinite="skip")
    monkeypatch.setenv("NAND_REPLAYS", "0")
    plain = with_nand(case_name, mode or FP32, fault, steps, on_nonfinite="skip")
    return replayed, plain


def assert_same_training(a, b) -> None:
    from tests.integrations.check import same_losses

    assert same_losses(a.losses, b.losses)
    states = zip(a.model.state_dict().items(), b.model.state_dict().values(), strict=True)
    for (name, p), q in states:
        assert torch.equal(p, q), name
    for s, t in zip(a.optimizer.state.values(), b.optimizer.state.values(), strict=True):
        assert all(torch.equal(s[k], t[k]) for k in s)


def test_gpt2_with_dropout_trains_on_after_a_replay_bit_identically_to_skip(monkeypatch):
    from tests.integrations.faults import Fault
    from tests.integrations.loops import ACCUMULATION

    # Bad data in micro-step 0 of 3: replayed after micro-steps 1 and 2 drew
    # their masks, so the RNG the replay leaves is not the step's unless put back.
    fault = Fault("input", 1, "inputs_embeds", micro=0)
    replayed, plain = twin_runs("gpt2", fault, monkeypatch, 3, ACCUMULATION)
    assert replayed.model.config.resid_pdrop > 0  # dropout draws from the RNG
    event = replayed.watch.first
    assert (event.step, event.micro_step, event.phase) == (1, 0, "input")
    assert event.reproduced is True and "forward of micro-step 0" in event.replay
    assert plain.watch.first.reproduced is None and plain.watch.first.replay == ""
    assert_same_training(replayed, plain)


def test_resnet_batchnorm_buffers_after_a_replay_are_those_of_skip(monkeypatch):
    from tests.integrations.faults import Fault

    # A backward fault: the running statistics stay finite, so a change shows.
    fault = Fault("backward", 1, "resnet.encoder.stages.1.layers.1.layer.0.convolution")
    replayed, plain = twin_runs("resnet18", fault, monkeypatch, 3)
    assert any(isinstance(m, nn.BatchNorm2d) for m in replayed.model.modules())
    event = replayed.watch.first
    assert (event.step, event.phase, event.reproduced) == (1, "backward", True)
    assert "forward and backward" in event.replay
    assert_same_training(replayed, plain)  # running means and variances included


def test_the_op_the_line_and_reproduced_reach_the_jsonl_file_the_rest_api_and_the_verdict(
    tmp_path,
):
    import json

    import httpx

    from nand.server import embedded
    from nand.server.settings import Settings

    url = f"sqlite:///{tmp_path / 'replay.db'}"
    server = embedded.start(url, settings=Settings(db_url=url))
    try:
        model = model_with(Log())
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        events_file = tmp_path / "events.jsonl"
        with nand.watch(
            model,
            opt,
            on_nonfinite="skip",
            server=server.zmq_endpoint,
            run="replayed",
            events_file=str(events_file),
        ):
            train(model, opt, 3, zero_row_at=1)
        line = line_of(Log.forward, "torch.log")
        records = [json.loads(text) for text in events_file.read_text().splitlines()]
        (written,) = [r["event"] for r in records if r["type"] == "event"]
        replay_fields = ("op", "source", "reproduced")
        assert [written[k] for k in replay_fields] == ["aten::log", line, True]
        api = f"{server.http_url}/api/runs/replayed"
        (event,) = httpx.get(f"{api}/events").json()["items"]
        assert [event[k] for k in replay_fields] == ["aten::log", line, True]
        assert event["replay"] == "replayed the forward of micro-step 0"
        verdict = httpx.get(f"{api}/verdict").json()
        assert verdict["origin"]["op"] == "aten::log"
        assert f"made by aten::log at {line}" in verdict["summary"]
    finally:
        server.stop()


# --- DDP: each rank replays alone --------------------------------------------


def _ddp_rank(rank: int, port: int, results: dict, fsdp: bool = False) -> None:
    import datetime
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6: FSDP2 under its first, private name
        from torch.distributed._composable.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NAND_RUN="ddp-replay")
    # A replay that waited on a collective would time out here instead of hanging.
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    inner = model_with(Log() if fsdp else Sqrt())
    if fsdp:  # each Linear its own shard unit: resharded after its forward
        for layer in inner:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
    model = fully_shard(inner) if fsdp else DistributedDataParallel(inner)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, on_nonfinite="skip", log_events=False) as watch:
        for step in range(4):
            x = batch(10 * rank + step, zero_row_at=12)  # rank 1, step 2 only
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    first = watch.first
    results[rank] = (
        (first.step, first.phase, first.cause, first.op, first.reproduced, first.replay),
        [p.detach().clone() for p in inner.parameters()] if not fsdp else [],
    )
    dist.destroy_process_group()


def _two_ranks(fsdp: bool = False) -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_ddp_rank, args=(port, results, fsdp), nprocs=2, join=True)
    return dict(results)


@pytest.mark.slow
def test_ddp_the_rank_that_made_the_nan_replays_alone_and_the_replicas_stay_equal():
    results = _two_ranks()
    (made, params1), (got, params0) = results[1], results[0]
    assert made[:5] == (2, "backward", "produced", "aten::div.Tensor", True)
    assert got[:5] == (2, "grad", "received", "", None)
    assert got[5].startswith("not replayed: received through a collective")
    assert all(torch.equal(a, b) for a, b in zip(params0, params1, strict=True))


def test_a_float16_overflow_under_autocast_is_replayed_under_the_same_autocast():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nand.watch(model, opt, on_nonfinite="skip") as watch:
        for step in range(3):
            x = batch(step) * (1e5 if step == 1 else 1.0)  # past float16's 65504, not float32's
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            out.float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    event = watch.first
    assert (event.step, event.phase, event.module, event.dtype) == (1, "forward", "0", "float16")
    assert event.reproduced is True  # in float32 the replay would be finite
    # autocast's cast of the input to float16 is what overflowed, in torch's Linear:
    # the line is the user's that called the model (torch's own are passed over)
    assert event.op == "aten::_to_copy"
    assert event.source == line_of(
        test_a_float16_overflow_under_autocast_is_replayed_under_the_same_autocast, "model(x)"
    )


def test_under_gradient_checkpointing_the_backward_fault_is_named_not_the_recomputed_mask():
    """GPT-2's attention writes -inf into its mask on purpose; a checkpointed
    forward does so again inside the backward. The op named is the fault's."""
    from tests.integrations.faults import Fault, poison
    from tests.integrations.loops import CHECKPOINTING, with_nand

    fault = Fault("backward", 1, "transformer.h.1.mlp.c_proj")
    event = with_nand("gpt2", CHECKPOINTING, fault, 3).watch.first
    assert (event.step, event.phase, event.module) == (1, "backward", fault.where)
    assert (event.op, event.reproduced) == ("aten::copy_", True)
    assert event.source == line_of(poison, "extra.view(-1)[0] = value")


@pytest.mark.parametrize("kind", ["forward", "backward"])
@pytest.mark.parametrize("case_name", ["gpt2", "bert", "llama", "vit", "resnet18"])
def test_every_real_model_names_the_planted_write_and_reproduces_it(case_name, kind):
    from tests.integrations.faults import Fault, poison
    from tests.integrations.loops import FP32, with_nand
    from tests.integrations.zoo import case

    fault = Fault(kind, 1, case(case_name).sites[kind])
    event = with_nand(case_name, FP32, fault, 3).watch.first
    assert (event.step, event.phase) == (1, kind)
    # The fault writes its value into a tensor of zeros: no op made it from
    # finite values, and the line that wrote it is named.
    assert (event.op, event.reproduced) == ("aten::copy_", True)
    assert event.source == line_of(poison, "extra.view(-1)[0] = value")


class Streamed(nn.Module):
    """Reads a side input from an iterator in its forward: a second call in
    the same step finds the iterator spent (a replay cannot be exact here)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8, bias=False)
        self.log = Log()
        self.extra: object = iter(())

    def forward(self, x: Tensor) -> Tensor:
        return self.log(self.linear(x) * next(self.extra))


@pytest.mark.nand_mode("full")  # (the light mode's: test_light_tier.py)
def test_a_replay_that_raises_says_so_in_the_event_and_training_goes_on():
    model = Streamed()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, on_nonfinite="skip") as watch:
        for step in range(3):
            model.extra = iter([0.0 if step == 1 else 1.0])  # one value per step
            model(batch(step)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    event = watch.first
    assert (event.step, event.phase, event.module) == (1, "forward", "log")
    assert event.reproduced is None and event.op == ""
    assert event.replay.startswith("replay raised StopIteration")
    assert "replay raised StopIteration" in event.message
    assert watch.step == 3 and all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.slow
def test_fsdp_is_not_replayed_and_says_why_instead_of_waiting_for_an_all_gather():
    results = _two_ranks(fsdp=True)
    made = results[1][0]
    assert made[:3] == (2, "forward", "produced") and made[4] is None
    assert made[5].startswith("not replayed: FSDP shards the parameters")


def test_past_sixteen_micro_steps_the_batches_are_not_held_and_the_event_says_so():
    model = model_with(Log())
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nand.watch(model, opt, on_nonfinite="skip") as watch:
        train(model, opt, 2, zero_row_at=20 + 18, accum=20)  # step 1, micro-step 18
    event = watch.first
    assert (event.step, event.micro_step, event.phase) == (1, 18, "forward")
    assert event.reproduced is None and "after 16 calls" in event.replay
