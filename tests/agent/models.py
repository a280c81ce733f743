"""Small models with faults that can be planted at a known step."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor, nn

from nand.events import Event

VALUES = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}


class Plant(nn.Module):
    """Identity, except when armed: then one element of its output is ``value``."""

    def __init__(self) -> None:
        super().__init__()
        self.value: float | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.value is None:
            return x
        x = x.clone()
        x.view(-1)[:1].fill_(self.value)  # (a kernel: no copy from the host)
        return x


class BadBackward(torch.autograd.Function):
    """Identity in forward; its backward writes ``value`` into the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, value: float) -> Tensor:  # type: ignore[override]
        ctx.value = value
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        grad = grad.clone()
        grad.view(-1)[:1].fill_(ctx.value)
        return grad, None


class BackwardPlant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.value: float | None = None

    def forward(self, x: Tensor) -> Tensor:
        return x if self.value is None else BadBackward.apply(x, self.value)


def mlp(plant_after: int | None = None, inplace: bool = False) -> nn.Sequential:
    """Linear-ReLU-Linear-ReLU-Linear, optionally a Plant after layer index."""
    layers: list[nn.Module] = [
        nn.Linear(8, 16),
        nn.ReLU(inplace=inplace),
        nn.Linear(16, 16),
        nn.ReLU(inplace=inplace),
        nn.Linear(16, 4),
    ]
    if plant_after is not None:
        layers.insert(plant_after + 1, Plant())
    return nn.Sequential(*layers)


@dataclasses.dataclass
class Output:
    logits: Tensor
    hidden: Tensor


class Block(nn.Module):
    """A parent whose forward has inline code between two children."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 16)
        self.inline_value: float | None = None

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.fc1(x))
        if self.inline_value is not None:
            h = h.clone()
            h[0, 0] = self.inline_value
        return self.fc2(h * 1.0)


class Net(nn.Module):
    """Nested blocks, keyword and nested inputs, a dataclass output."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(16, 4)
        self.unused = nn.Linear(3, 3)  # never called
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x: Tensor, *, extra: dict[str, Tensor] | None = None) -> Output:
        if extra is not None:
            x = x + extra["bias"][0]
        h = self.block(x)
        return Output(logits=self.frozen(self.head(h)), hidden=h)


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    before: Callable[[int, int], None] | None = None,
    accum: int = 1,
    loss_fn: Callable[[object, int], Tensor] | None = None,
    inputs: Callable[[int], tuple[tuple, dict]] | None = None,
    after_backward: Callable[[int], None] | None = None,
) -> None:
    """A plain training loop; ``before(step, micro)`` plants faults in the
    forward, ``after_backward(step)`` in the gradients (before the update)."""
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        for micro in range(accum):
            if before is not None:
                before(step, micro)
            args, kwargs = inputs(step) if inputs else ((torch.randn(4, 8, generator=gen),), {})
            out = model(*args, **kwargs)
            loss = loss_fn(out, step) if loss_fn else out.pow(2).mean()
            (loss / accum).backward()
        if after_backward is not None:
            after_backward(step)
        opt.step()
        opt.zero_grad()


def write_grad(param: Tensor, step: int, value: float) -> Callable[[int], None]:
    """An ``after_backward`` for :func:`train`: one gradient element set to
    ``value`` at ``step``, as a bad kernel or a user's clipping code would."""

    def after_backward(s: int) -> None:
        if s == step:
            assert param.grad is not None
            param.grad[0, 0] = value

    return after_backward


def where(event: Event) -> tuple:
    """What a test asserts of an event: step, micro-step, phase, module, cause."""
    return (event.step, event.micro_step, event.phase, event.module, event.cause)


def arm_at(
    module: nn.Module, step: int, value: float, micro: int = 0
) -> Callable[[int, int], None]:
    """A ``before`` for :func:`train` that arms ``module`` at one (step, micro) only."""

    def before(s: int, m: int) -> None:
        module.value = value if (s, m) == (step, micro) else None  # type: ignore[assignment]

    return before


def arm_on_batch(
    model: nn.Module, module: nn.Module, step: int, value: float
) -> Callable[[int, int], None]:
    """A ``before`` for :func:`train` that arms ``module`` for the batch of
    ``step`` (micro-step 0): a fault that batch makes, as data that overflows
    a layer does, so that a replay of the step with that batch makes it
    again, also one step late (the deferred read), when a fault armed by the
    loop (:func:`arm_at`) is gone. Hooks ``model`` (the root) for good."""
    now = [(-1, -1)]
    bad: list[Tensor] = []

    def pre(_: nn.Module, args: tuple) -> None:
        if now[0] == (step, 0) and not bad:
            bad.append(args[0])
        x = args[0]
        same = bool(bad) and x.shape == bad[0].shape and torch.equal(x, bad[0])
        module.value = value if same else None  # type: ignore[assignment]

    model.register_forward_pre_hook(pre)

    def before(s: int, m: int) -> None:
        now[0] = (s, m)

    return before
