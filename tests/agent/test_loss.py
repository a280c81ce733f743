"""The NaN in the loss: always an incident, with the op and the user's line.

Real losses people get NaN from, computed in the user's own loop as the
README's example does (``watch.loss(loss)``, then ``loss.backward()``): a
mean cross-entropy whose labels are all ignored (0/0, every gradient 0), a
hand-written binary cross-entropy on a sigmoid that rounds to 1.0, a
contrastive loss with ``acos`` of a cosine that rounds above 1, a masked mean
over no element. The ground truth is found without nand: the loss and the
gradients looked at directly, and the first op that makes a non-finite value
from finite inputs found by a plain ``TorchDispatchMode`` with its line
(``tests/first_op.py``). Each runs in the light (default) and the full mode.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import nand
from tests.first_op import FirstOp

MODES = ["light", "full"]
BAD = 2  # the step whose batch makes the loss non-finite
STEPS = 4
Loss = Callable[[Tensor, int], Tensor]


def line_of(function, text: str) -> str:
    """``path:line`` of the line of ``function`` that contains ``text``."""
    lines, start = inspect.getsourcelines(function)
    index = next(i for i, line in enumerate(lines) if text in line)
    return f"{inspect.getsourcefile(function)}:{start + index}"


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))


def batch(step: int) -> Tensor:
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(step))


# --- the losses (the line each makes its NaN on is named by nand) ------------


def cross_entropy_all_ignored(out: Tensor, step: int) -> Tensor:
    """Prompt tokens masked out (-100); at BAD truncation left no answer token."""
    labels = torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(step))
    if step == BAD:
        labels[:] = -100
    return F.cross_entropy(out, labels, ignore_index=-100)  # mean over no label: 0/0


def hand_written_bce(out: Tensor, step: int) -> Tensor:
    """A binary cross-entropy written out, on a sigmoid that rounds to exactly 1.0."""
    scale = 1000.0 if step == BAD else 1.0  # (logits grown large)
    p = torch.sigmoid(out[:, 0].abs() * scale + 1.0)
    y = torch.zeros(8)
    return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()  # log(1 - 1.0)


def contrastive_acos(out: Tensor, step: int) -> Tensor:
    """An angular loss on pairs (rows 2i, 2i+1); its cosine, not clamped, can
    round above 1 for a pair of equal embeddings (the batch repeats a row at BAD)."""
    a, b = out[0::2], out[1::2]
    cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
    return torch.acos(cos).mean()  # acos(1 + ulp): NaN


def masked_mean(out: Tensor, step: int) -> Tensor:
    """A mean over the rows a mask keeps; at BAD the mask keeps none."""
    keep = torch.ones(8, dtype=torch.bool) if step != BAD else torch.zeros(8, dtype=torch.bool)
    return out[keep].pow(2).sum() / keep.sum()  # 0 / 0


#: Each loss, its batches (a duplicated pair for the angular loss), and the
#: text of the line it makes its non-finite value on.
LOSSES: dict[str, tuple[Loss, str]] = {
    "cross-entropy": (cross_entropy_all_ignored, "return F.cross_entropy"),
    "bce": (hand_written_bce, "(1 - y) * torch.log(1 - p)"),
    "acos": (contrastive_acos, "return torch.acos"),
    "masked-mean": (masked_mean, "/ keep.sum()"),
}


def duplicated_pair(net: nn.Module) -> Tensor:
    """The angular loss's bad batch: a row repeated whose cosine with itself
    rounds above 1 (searched, without nand, among seeded rows)."""
    for seed in range(1000):
        x = batch(BAD).clone()
        x[1] = x[0] = torch.randn(6, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            out = net(x)
        a, b = out[0:1], out[1:2]
        if float((a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))) > 1.0:
            return x
    raise AssertionError("no seeded row rounds its cosine above 1")


def rate(name: str, lr: float) -> float:
    """The angular loss's bad batch is searched against the initial weights:
    its run keeps them (a learning rate of 0; the loss and backward as usual)."""
    return 0.0 if name == "acos" else lr


def inputs(name: str) -> dict[int, Tensor]:
    xs = {step: batch(step) for step in range(STEPS)}
    if name == "acos":
        xs[BAD] = duplicated_pair(model())  # (the weights before any step: BAD's)
    return xs


def truth(name: str, lr: float = 0.1) -> tuple[int, bool, tuple[str, str] | None]:
    """Without nand: the first step whose loss is non-finite, whether every
    gradient was exactly 0 then, and the first op that made it (and its line)."""
    loss_fn, _ = LOSSES[name]
    net, xs = model(), inputs(name)
    opt = torch.optim.SGD(net.parameters(), lr=rate(name, lr))
    for step in range(STEPS):
        with FirstOp(lambda filename: filename == __file__) as first:
            loss = loss_fn(net(xs[step]), step)
        loss.backward()
        if not bool(torch.isfinite(loss)):
            zero = all(bool((p.grad == 0).all()) for p in net.parameters())
            return step, zero, first.found
        opt.step()
        opt.zero_grad()
    raise AssertionError("the loss stayed finite")


def train(name: str, mode: str, lr: float = 0.1, **options) -> tuple[nand.Watch, nn.Module]:
    """The README's loop with ``watch.loss``; returns the watch and the model."""
    loss_fn, _ = LOSSES[name]
    net, xs = model(), inputs(name)
    opt = torch.optim.SGD(net.parameters(), lr=rate(name, lr))
    with nand.watch(net, opt, mode=mode, **options) as watch:
        try:
            for step in range(STEPS):
                out = net(xs[step])
                loss = watch.loss(loss_fn(out, step))
                loss.backward()
                opt.step()
                opt.zero_grad()
        except nand.NonFiniteError:
            pass
    return watch, net


# --- 1. a non-finite loss is always an incident --------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_mean_cross_entropy_of_ignored_labels_is_a_loss_incident_though_every_gradient_is_0(mode):
    step, zero_grads, _ = truth("cross-entropy")
    assert step == BAD and zero_grads  # the case: nothing but the loss shows it
    watch, _ = train("cross-entropy", mode)
    event = watch.first
    assert event is not None
    assert (event.step, event.phase, event.module, event.micro_step) == (BAD, "loss", "", 0)
    assert event.nan == 1 and event.shape == []


@pytest.mark.parametrize("mode", MODES)
def test_a_masked_mean_over_no_element_is_a_loss_incident(mode):
    step, zero_grads, _ = truth("masked-mean")
    assert step == BAD and zero_grads
    watch, _ = train("masked-mean", mode)
    assert watch.first is not None
    assert (watch.first.step, watch.first.phase) == (BAD, "loss")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_raise_and_skip_keep_the_update_of_a_nan_loss_with_zero_gradients(mode, policy):
    """SGD with weight decay changes the weights even with zero gradients: the
    update of the bad step is what raise stops and skip drops."""
    net, xs = model(), inputs("cross-entropy")
    opt = torch.optim.SGD(net.parameters(), lr=0.1, weight_decay=0.1)
    raised = None
    with nand.watch(net, opt, mode=mode, on_nonfinite=policy) as watch:
        for step in range(STEPS):
            before = [p.detach().clone() for p in net.parameters()]
            loss = watch.loss(cross_entropy_all_ignored(net(xs[step]), step))
            loss.backward()
            try:
                opt.step()
            except nand.NonFiniteError as exc:
                raised = exc
            after = list(net.parameters())
            if step == BAD:
                assert all(torch.equal(b, a) for b, a in zip(before, after, strict=True))
                if raised is not None:
                    break
            opt.zero_grad()
    assert (raised is not None) == (policy == "raise")
    assert watch.first is not None and (watch.first.step, watch.first.phase) == (BAD, "loss")


@pytest.mark.parametrize("mode", MODES)
def test_a_loss_never_handed_to_watch_loss_is_checked_where_its_backward_starts(mode):
    net, xs = model(), inputs("cross-entropy")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with nand.watch(net, opt, mode=mode) as watch:
        for step in range(STEPS):
            cross_entropy_all_ignored(net(xs[step]), step).backward()
            opt.step()
            opt.zero_grad()
    assert watch.first is not None
    assert (watch.first.step, watch.first.phase, watch.first.module) == (BAD, "loss", "")


def test_a_nan_loss_in_the_second_micro_step_of_an_accumulated_step_is_named_there():
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with nand.watch(net, opt) as watch:
        for step in range(2):
            for micro in range(2):
                bad = BAD if (step, micro) == (1, 1) else 0
                (cross_entropy_all_ignored(net(batch(2 * step + micro)), bad) / 2).backward()
            opt.step()
            opt.zero_grad()
    assert watch.first is not None
    assert (watch.first.step, watch.first.micro_step, watch.first.phase) == (1, 1, "loss")


# --- 2. the op, the user's line, reproduced ------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(LOSSES))
def test_the_loss_s_op_and_line_are_those_a_plain_dispatch_mode_finds_and_it_reproduces(name, mode):
    step, _, first = truth(name)
    assert first is not None
    loss_fn, text = LOSSES[name]
    assert first[1] == line_of(loss_fn, text)  # (the truth is on the line the loss says)
    watch, _ = train(name, mode)
    event = watch.first
    assert event is not None
    assert (event.step, event.phase, event.module) == (step, "loss", "")
    assert (event.op, event.source, event.reproduced) == (*first, True)
    assert f"made by {event.op} at {event.source}" in event.message


# --- 3. one rule for the line: all-torch models too ----------------------------


def all_torch_run(mode: str | None) -> tuple[nand.Watch | None, list[tuple[int, str]]]:
    """An all-torch MLP whose batch at BAD holds values near float32's limit
    (features left unnormalised): its first Linear overflows. Without a mode,
    plain forward hooks note the first module whose output is non-finite (the truth)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    seen: list[tuple[int, str]] = []
    names = {m: n for n, m in net.named_modules()}
    step = 0
    if mode is None:

        def hook(module, args, output):
            if not seen and not bool(torch.isfinite(output).all()):
                seen.append((step, names[module]))

        for m in net:
            m.register_forward_hook(hook)
    watch = nand.watch(net, opt, mode=mode) if mode is not None else None
    for step in range(STEPS):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
        x = x.clamp(-1, 1) * 3e38 if step == BAD else x  # (finite: below 3.4e38)
        out = net(x)  # the user's line that calls the model
        F.mse_loss(out, torch.zeros(16, 1)).backward()
        opt.step()
        opt.zero_grad()
    if watch is not None:
        watch.close()
    return watch, seen


@pytest.mark.parametrize("mode", MODES)
def test_an_all_torch_model_s_line_is_where_the_user_called_it_not_torch_s(mode):
    _, seen = all_torch_run(None)
    assert seen == [(BAD, "0")]
    watch, _ = all_torch_run(mode)
    assert watch is not None and watch.first is not None
    event = watch.first
    assert (event.step, event.phase, event.module) == (BAD, "forward", "0")
    assert event.source == line_of(all_torch_run, "out = net(x)")
    assert event.op == "aten::addmm" and event.reproduced is True
    assert "torch/nn" not in event.message


# --- 4. the message and the replay text agree ----------------------------------


class MaskedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores, -1) @ self.v(x)


class Attending(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.out = MaskedAttention(), nn.Linear(8, 2)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.out(self.attn(x, mask))


@pytest.mark.parametrize("mode", MODES)
def test_a_fully_masked_attention_row_is_said_one_way_by_the_message_and_the_replay(mode):
    torch.manual_seed(0)
    net = Attending()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    masks = [torch.ones(2, 5, 5, dtype=torch.bool) for _ in range(2)]
    masks[1][0, 2, :] = False  # a row that attends to nothing
    x = torch.randn(2, 5, 8)
    with torch.no_grad():  # the truth, without nand: the softmax of the masked row is NaN
        assert not bool(torch.isfinite(torch.softmax(torch.full((5,), -torch.inf), -1)).any())
    with nand.watch(net, opt, mode=mode) as watch:
        for mask in masks:
            net(x, mask).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    event = watch.first
    assert event is not None and (event.phase, event.module, event.cause) == (
        "forward",
        "attn",
        "produced",
    )
    assert "produced here from finite inputs" in event.message
    assert "from outside" not in event.replay and "from outside" not in event.message
    written = line_of(MaskedAttention.forward, "masked_fill")
    assert f"through an infinity the code wrote (aten::masked_fill.Scalar at {written})" in (
        event.replay
    )
    assert event.op == "aten::_softmax"
