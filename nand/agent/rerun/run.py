"""One replay: the held micro-step's forward and backward run again.

The root module is called with the held inputs (or a framework's step
with the held batch, see ``held``), under the autocast state
and RNG states the micro-step had, with anomaly mode recording each backward
node's forward line (``check_nan=False``: nothing raises), inside an
:class:`~nand.agent.rerun.opwatch.OpWatch` (which names the module of each
backward node, :mod:`~nand.agent.rerun.owners`). The backward starts from the
gradients that arrived at the outputs (see ``held``) and is a
``torch.autograd.grad`` over the parameters: ``.grad`` stays as it was, and
neither DDP's all-reduce nor any post-accumulate hook runs (those fire when
a gradient accumulates into ``.grad``), so a rank replays alone.

An output whose gradient flowed on into another seeded output (a model that
returns both ``logits`` and the ``loss`` made of them) is not seeded: its
gradient already came through that output, and would be counted twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import Node

from nand.agent.detect.eager import eager_stance
from nand.agent.detect.probes import iter_tensors
from nand.agent.rerun.held import HeldStep
from nand.agent.rerun.opwatch import OpRecord, OpWatch
from nand.agent.rerun.owners import NodeOwners
from nand.agent.rerun.state import Saved


@dataclasses.dataclass
class Replayed:
    records: list[OpRecord]
    inputs_finite: bool
    backward: bool  # the backward was replayed too


def replay(
    root: nn.Module,
    held: HeldStep,
    names: dict[nn.Module, str],
    device: torch.device,
    backward: bool,
    then: Callable[[Any, OpWatch], None] | None = None,
) -> Replayed:
    """Run ``held`` again; everything it changed is put back before returning.
    ``then(output, watch)``: run after the forward, under the same watch (a loss)."""
    owners = NodeOwners(root, names)
    watch = OpWatch(names, owners)
    saved = Saved(root, device)
    try:
        saved.start(held)
        with ExitStack() as stack:
            stack.enter_context(watch)
            stack.enter_context(eager_stance())  # (a compiled model: eagerly, probes seen)
            stack.enter_context(torch.enable_grad())
            for kind, dtype in held.autocast.items():
                stack.enter_context(torch.autocast(kind, dtype=dtype))
            with torch.autograd.set_detect_anomaly(True, check_nan=False):
                watch.user_call = held.line
                output = (held.step or root)(*held.args, **held.kwargs)
                if then is not None:
                    then(output, watch)
        grads = held.grads if held.step is None else _ones(output)
        seeds = _seeds(output, grads) if backward else []
        params = [p for p in root.parameters() if p.requires_grad]
        if seeds and params:
            with watch:
                _backward(seeds, params)
    finally:
        owners.remove()
        saved.restore()
    inputs = [t for _, t in iter_tensors((held.args, held.kwargs)) if t.is_floating_point()]
    finite = all(bool(torch.isfinite(t).all()) for t in inputs)
    return Replayed(watch.records, finite, bool(seeds and params))


def _backward(seeds: list[tuple[Tensor, Tensor]], params: list[nn.Parameter]) -> None:
    outputs = [out for out, _ in seeds]
    grads = [grad for _, grad in seeds]
    torch.autograd.grad(outputs, params, grads, allow_unused=True)


def _ones(loss: object) -> dict[str, Tensor]:
    """A framework's step returns the loss its backward started from."""
    return {"": torch.ones_like(loss)} if isinstance(loss, Tensor) else {}


def _seeds(output: object, grads: dict[str, Tensor]) -> list[tuple[Tensor, Tensor]]:
    """(replayed output, held gradient) pairs that start the backward."""
    pairs = [
        (t, grads[path])
        for path, t in iter_tensors(output)
        if path in grads and t.requires_grad and t.grad_fn is not None
    ]
    terminal = []
    for i, (t, grad) in enumerate(pairs):
        others = [other.grad_fn for j, (other, _) in enumerate(pairs) if j != i]
        if not _reaches(others, t.grad_fn):
            terminal.append((t, grad))
    return terminal


def _reaches(starts: list[Node | None], target: Node | None) -> bool:
    """Whether ``target`` lies on the graph behind any of ``starts``."""
    seen: set[Node] = set()
    todo = [node for node in starts if node is not None]
    while todo:
        node = todo.pop()
        if node is target:
            return True
        if node in seen:
            continue
        seen.add(node)
        todo.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return False
