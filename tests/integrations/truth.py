"""Ground truth without nand: where a run's first non-finite value really appeared.

Plain torch hooks only, with a host read per check (a test may be slow, it
must be right), so that nand's answer is held to something it did not make:

- **input**: the root module's inputs (positional and keyword, nested) — `data`;
  so are those of a module entered while no module of the model runs (a
  framework's ``training_step`` calling ``self.net``, a loop calling a
  model's parts), named by that module;
- **forward**: the first module whose output is non-finite, in the order the
  hooks fire (children before parents). A value made by inline code of a
  parent shows up first as the input of its next child, or as the parent's
  output: either way the parent, the innermost module running, is blamed;
- **loss**: a gradient made non-finite by autograd nodes created outside the
  model (the loss computation), while the forward was finite;
- **backward**: the first autograd node, in execution order, whose incoming
  gradients are finite and whose outgoing gradient is not, blamed on the
  innermost module whose forward created that node. This is exact where a
  tensor hook on outputs is only a guess: when a value feeds several
  modules (q, k and v projections), its gradient arrives summed, and the
  last output gradient seen before it need not belong to the culprit;
- **grad**: a parameter's ``.grad`` after it was accumulated, and again
  before the update (code may write into it in between);
- **param**: parameters after ``optimizer.step()``, in ``named_parameters`` order.

Steps are training iterations: the loop calls :meth:`Truth.end_step` once per
iteration, whether the optimizer stepped or a GradScaler skipped the update.
In a skipped iteration, gradient findings (loss, backward, grad) are the
overflow the scaler handles on purpose, not faults, and are dropped.

>>> import torch
>>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
>>> with Truth(model) as truth:
...     model(torch.tensor([[1.0, float("nan")]])).sum().backward()
...     truth.end_step()
>>> truth.first
Finding(step=0, micro_step=0, phase='input', module='', cause='data')
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.autograd.graph import Node

PHASES = ("input", "forward", "loss", "backward", "grad", "param", "optimizer_state")
GRADIENT_PHASES = ("loss", "backward", "grad")


class Finding(NamedTuple):
    """Where, in the same terms as a ``nand.Event``: compare it to ``where(event)``."""

    step: int
    micro_step: int
    phase: str
    module: str
    cause: str


def tensors(value: Any) -> Iterator[Tensor]:
    """Every tensor in a nested structure (tuple, list, dict, ModelOutput, dataclass)."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors(item)
    elif isinstance(value, dict):  # ModelOutput is an OrderedDict
        for item in value.values():
            yield from tensors(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from tensors(getattr(value, field.name))


def non_finite(value: Any) -> bool:
    """Whether any floating-point tensor in ``value`` holds a NaN or an infinity."""
    return any(
        t.is_floating_point() and t.numel() and not bool(torch.isfinite(t.detach()).all())
        for t in tensors(value)
    )


class Truth:
    """Records findings of one model (and optimizer) until :meth:`close`."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.findings: list[Finding] = []
        self.step = 0  # iterations ended (end_step calls)
        self.skipped: list[int] = []  # iterations whose update a GradScaler skipped
        #: Per iteration, the parameters whose ``.grad`` was non-finite before the update.
        self.bad_grads: dict[int, set[str]] = {}
        self.micro = -1  # root forward calls in this iteration, minus one
        self._model = model
        self._names = {m: name for name, m in model.named_modules()}
        self._params = list(model.named_parameters())
        self._stack: list[tuple[nn.Module, int]] = []  # running modules, node counter at entry
        self._owner: dict[Node, str] = {}
        self._seen_forward = False  # a forward finding in this micro-step already
        self._seen_gradient = False
        self._stepped = optimizer is None  # without one, no update is ever skipped
        self._optimizer = optimizer
        self._counter = torch.ones((), requires_grad=True)
        self._handles = [h for m in model.modules() for h in self._hook_module(m)]
        self._handles += [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, name))
            for name, p in self._params
            if p.requires_grad
        ]
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._before_update))
            self._handles.append(optimizer.register_step_post_hook(self._on_optimizer_step))

    @property
    def first(self) -> Finding | None:
        """The first finding in nand's order: (step, micro-step, phase)."""
        if not self.findings:
            return None
        return min(self.findings, key=lambda f: (f.step, f.micro_step, PHASES.index(f.phase)))

    def end_step(self) -> None:
        """One training iteration is over (the update applied or skipped)."""
        if not self._stepped:  # a GradScaler skipped it: its overflow is no fault
            self.skipped.append(self.step)
            self.findings = [
                f for f in self.findings if f.step != self.step or f.phase not in GRADIENT_PHASES
            ]
        self.step += 1
        self.micro = -1
        self._stepped = self._optimizer is None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._owner.clear()

    def __enter__(self) -> Truth:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- forward ------------------------------------------------------------

    def _hook_module(self, module: nn.Module) -> list[Any]:
        pre = module.register_forward_pre_hook(self._on_enter, with_kwargs=True)
        post = module.register_forward_hook(self._on_exit)
        return [pre, post]

    def _on_enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if module is self._model:
            self._new_micro_step()
        if not self._seen_forward and non_finite((args, kwargs)):
            if module is self._model:
                self._record("input", "", "data")
            elif self._stack:  # made inline by the module running now
                self._record("forward", self._names[self._stack[-1][0]], "produced")
            elif torch._C._current_graph_task_id() == -1:  # (not a recompute in backward)
                self._record("input", self._names[module], "data")  # entered from outside
            self._seen_forward = True
        self._stack.append((module, self._next_node_number()))

    def _on_exit(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not self._stack or self._stack[-1][0] is not module:
            return  # entered before this Truth was made
        _, start = self._stack.pop()
        name = self._names[module]
        if not self._seen_forward and non_finite(output):
            self._record("forward", name, "produced")
            self._seen_forward = True
        for t in tensors(output):
            if t.grad_fn is not None:
                self._own(t.grad_fn, start, name)
                if module is self._model and t.is_floating_point():
                    t.register_hook(self._on_output_grad)  # goes with the tensor

    def _new_micro_step(self) -> None:
        self.micro += 1
        self._stack.clear()
        self._owner.clear()
        self._seen_forward = self._seen_gradient = False

    # --- backward -----------------------------------------------------------

    def _next_node_number(self) -> int:
        """The sequence number autograd gives the next node (-1 without grad mode)."""
        node = (self._counter * 1).grad_fn
        return -1 if node is None else node._sequence_nr() + 1

    def _own(self, root: Node, start: int, name: str) -> None:
        """Claim for ``name`` the nodes created since ``start`` that no child claimed."""
        if start < 0:
            return
        todo, seen = [root], set()
        while todo:
            node = todo.pop()
            if node in seen or node._sequence_nr() < start or not node.next_functions:
                continue  # made before this module ran, or a leaf's AccumulateGrad
            seen.add(node)
            if node not in self._owner:
                self._owner[node] = name
                node.register_hook(functools.partial(self._on_node, name))
            todo.extend(n for n, _ in node.next_functions if n is not None)

    def _on_output_grad(self, grad: Tensor) -> None:
        # Runs before any node of the model's own: what arrives here was made
        # by the code between the model's output and backward() — the loss.
        if not self._seen_gradient and non_finite(grad):
            self._seen_gradient = True
            self._record("loss", "", "produced")

    def _on_node(self, name: str, grad_inputs: tuple, grad_outputs: tuple) -> None:
        if self._seen_gradient or non_finite(grad_outputs) or not non_finite(grad_inputs):
            return
        self._seen_gradient = True
        self._record("backward", name, "produced")

    def _on_grad(self, name: str, param: Tensor) -> None:
        if not self._seen_gradient and non_finite(param.grad):
            # Every node's gradient was finite: something wrote into .grad.
            self._seen_gradient = True
            self._record("grad", name, "produced")

    # --- around the update -----------------------------------------------------

    def _before_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # Code between backward() and step() may write into .grad (clipping
        # with a NaN norm, a hand-written all-reduce); a closure's backward
        # runs later and is seen by the accumulation hooks instead.
        for name, p in self._params:
            if non_finite(p.grad):
                self.bad_grads.setdefault(self.step, set()).add(name)
                if not self._seen_gradient:
                    self._on_grad(name, p)

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._stepped = True
        for name, p in self._params:
            if non_finite(p):
                self._record("param", name, "produced")
                return

    def _record(self, phase: str, module: str, cause: str) -> None:
        self.findings.append(Finding(self.step, max(self.micro, 0), phase, module, cause))
