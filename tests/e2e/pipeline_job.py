"""A real pipeline-parallel job for ``test_pipeline_parallel``: 2 gloo processes,
``torch.distributed.pipelining`` stages cut by hand from one user model (the
way torchtitan does: a copy of the model with the other stages' layers
deleted, so each stage keeps the user's qualified names), GPipe or 1F1B.

Each rank runs several short runs one after the other (one spawn for all:
the processes cost more than the runs). A run is a fault, a schedule and
either plain hooks (:class:`GroundTruth`, no nand) or ``nand.watch`` against
the test's server; what it saw goes into ``results[(run, rank)]``.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

import nand

N_MICRO, BATCH, STEPS, FAULT_STEP = 4, 8, 3, 1
#: Micro-batch 2's data, scaled: the gated blocks square it, and stage 1's first
#: block overflows float32 (stage 0's outputs stay finite, ~1e21).
OVERFLOW_SCALE, OVERFLOW_MB = 1e6, 2
#: Micro-batch 1's data, scaled: stage 0's last block feeds its activation
#: values above 44, where its backward (exp(2x) / (exp(2x) + 1)**2) is inf / inf.
BACKWARD_SCALE, BACKWARD_MB = 100.0, 1


class _UnsafeTanhFn(torch.autograd.Function):
    """tanh with a numerically unsafe hand-written backward (a classic)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return torch.tanh(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        e = torch.exp(2 * x)
        return grad * 4 * e / (e + 1) ** 2


class UnsafeTanh(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return _UnsafeTanhFn.apply(x)


class Block(nn.Module):
    """A bilinear gate: a(x) * b(x), then an optional activation."""

    def __init__(self, act: nn.Module | None = None) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.act = act

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x) * self.b(x)
        return self.act(h) if self.act is not None else h


class Net(nn.Module):
    """The user's model; a stage deletes what is not its own (``None``)."""

    def __init__(self, unsafe: bool) -> None:
        super().__init__()
        self.embed: nn.Module | None = nn.Linear(8, 16)
        acts = [None, UnsafeTanh() if unsafe else None, None, None]
        self.layers = nn.ModuleDict({str(i): Block(act) for i, act in enumerate(acts)})
        self.head: nn.Module | None = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        return self.head(x) if self.head is not None else x


def stage_of(model: Net, stage: int) -> Net:
    """Stage 0: ``embed``, ``layers.0``, ``layers.1``; stage 1: ``layers.2``,
    ``layers.3``, ``head``: the user's names, as a manual split keeps them."""
    part = copy.deepcopy(model)
    for key in [k for k in part.layers if (int(k) < 2) != (stage == 0)]:
        del part.layers[key]
    if stage == 0:
        part.head = None
    else:
        part.embed = None
    return part


#: Schedules that run stages ``rank`` and ``rank + 2`` of four on each rank
#: (the zero-bubble one splits each backward into an input and a weight pass).
TWO_STAGES_PER_RANK = {
    "interleaved": "ScheduleInterleaved1F1B",
    "zero-bubble": "ScheduleInterleavedZeroBubble",
}


@dataclass(frozen=True)
class Run:
    name: str
    schedule: str  # "gpipe" | "1f1b" | one of TWO_STAGES_PER_RANK
    fault: str  # "none" | "overflow" (row 3) | "backward" (row 4)
    nand: bool = True
    policy: str = "warn"
    traced: bool = False  # split by torch's tracer (``pipeline()``), not by hand


def batches(fault: str) -> list[tuple[Tensor, Tensor]]:
    """The same data on both stages (the last one takes the targets)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for step in range(STEPS):
        x, y = torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)
        rows = BATCH // N_MICRO
        if step == FAULT_STEP and fault == "overflow":
            x[OVERFLOW_MB * rows : (OVERFLOW_MB + 1) * rows] *= OVERFLOW_SCALE
        if step == FAULT_STEP and fault == "backward":
            x[BACKWARD_MB * rows : (BACKWARD_MB + 1) * rows] *= BACKWARD_SCALE
        out.append((x, y))
    return out


class GroundTruth:
    """Where this rank first saw a non-finite value, from plain hooks (no nand):
    (step, micro-batch, phase, module, made here). A stage runs its forwards
    in micro-batch order, so the count of a module's calls in the step is the
    micro-batch; a backward is known by the call whose output it flows into
    (tensor hooks: a full backward hook makes views the zero-bubble schedule
    cannot detach). A module made a gradient non-finite when the gradient at
    its output was finite and the one at its input is not. Only the stage's
    chunks count: its first step also runs the module on made-up tensors."""

    def __init__(self, root: nn.Module) -> None:
        self.step = 0
        self.active = False
        self.first: tuple[int, int, str, str, bool] | None = None
        self._calls: dict[str, int] = {}
        self._out_finite: dict[tuple[int, str], bool] = {}  # (micro-batch, module)
        root.register_forward_pre_hook(self._inputs)
        for name, module in root.named_modules():
            module.register_forward_hook(self._forward(name))

    def follow(self, stage: Any) -> None:
        """Look only while ``stage`` runs a micro-batch (forward, backward,
        the weight pass of a split backward)."""
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(stage, name, self._looking(getattr(stage, name)))

    def _looking(self, method: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            self.active = True
            try:
                return method(*args, **kwargs)
            finally:
                self.active = False

        return run

    def new_step(self, step: int) -> None:
        self.step, self._calls, self._out_finite = step, {}, {}

    def _see(self, mb: int, phase: str, module: str, made_here: bool) -> None:
        if self.first is None and self.active:
            self.first = (self.step, mb, phase, module, made_here)

    def _inputs(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self.active and not _finite(args):
            self._see(self._calls.get("", 0), "forward", "", False)  # (sent to this stage)

    def _forward(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if not self.active:
                return
            mb = self._calls.get(name, 0)
            self._calls[name] = mb + 1
            if not _finite(output):
                self._see(mb, "forward", name, _finite(args))
            if isinstance(output, Tensor) and output.requires_grad:
                output.register_hook(self._output_grad(mb, name))
            for arg in args:
                if isinstance(arg, Tensor) and arg.requires_grad:
                    arg.register_hook(self._input_grad(mb, name))

        return hook

    def _output_grad(self, mb: int, name: str) -> Any:
        def hook(grad: Tensor) -> None:
            self._out_finite[mb, name] = _finite(grad)
            if name == "" and not _finite(grad):
                self._see(mb, "backward", "", False)  # sent back to this stage

        return hook

    def _input_grad(self, mb: int, name: str) -> Any:
        def hook(grad: Tensor) -> None:
            if self._out_finite.get((mb, name), False) and not _finite(grad):
                self._see(mb, "backward", name, True)

        return hook


def _finite(value: Any) -> bool:
    if isinstance(value, Tensor):
        return not value.is_floating_point() or bool(torch.isfinite(value).all())
    if isinstance(value, tuple | list):
        return all(_finite(v) for v in value)
    return True


def build(rank: int, run: Run) -> tuple[list[nn.Module], list[Any], Any]:
    """The stage modules this rank runs, their stages and the schedule:
    one stage per rank, or two (stages ``rank`` and ``rank + 2`` of four, one
    layer each) under the interleaved schedules."""
    from torch.distributed import pipelining as pp

    torch.manual_seed(0)
    model = Net(unsafe=run.fault == "backward")
    cpu = torch.device("cpu")
    if run.schedule in TWO_STAGES_PER_RANK:
        mine = (rank, rank + 2)
        parts = [_one_layer(model, i) for i in mine]
        stages = [pp.PipelineStage(part, i, 4, cpu) for part, i in zip(parts, mine, strict=True)]
        kind = getattr(pp, TWO_STAGES_PER_RANK[run.schedule])
        return parts, stages, kind(stages, N_MICRO, nn.functional.mse_loss)
    if run.traced:  # (a GraphModule per stage, the user's qualified names kept)
        split = {"layers.2": pp.SplitPoint.BEGINNING}
        pipe = pp.pipeline(model, mb_args=(torch.zeros(BATCH // N_MICRO, 8),), split_spec=split)
        part, stage = pipe.get_stage_module(rank), pipe.build_stage(rank, cpu)
    else:
        part = stage_of(model, rank)
        stage = pp.PipelineStage(part, rank, 2, cpu)
    kind = pp.ScheduleGPipe if run.schedule == "gpipe" else pp.Schedule1F1B
    return [part], [stage], kind(stage, n_microbatches=N_MICRO, loss_fn=nn.functional.mse_loss)


def _one_layer(model: Net, stage: int) -> Net:
    """Stage ``stage`` of four: ``layers.<stage>`` (the first with ``embed``,
    the last with ``head``)."""
    part = copy.deepcopy(model)
    for key in [k for k in part.layers if int(k) != stage]:
        del part.layers[key]
    part.embed = part.embed if stage == 0 else None
    part.head = part.head if stage == 3 else None
    return part


def run_once(rank: int, run: Run, endpoint: str, run_id: str) -> dict[str, Any]:
    parts, stages, schedule = build(rank, run)
    opts = [torch.optim.SGD(part.parameters(), lr=0.05) for part in parts]
    truths = [GroundTruth(part) for part in parts] if not run.nand else []
    for truth, stage in zip(truths, stages, strict=False):
        truth.follow(stage)
    options = {"server": endpoint, "run": run_id, "on_nonfinite": run.policy}
    watched = zip(parts, opts, strict=True) if run.nand else ()
    watches = [nand.watch(part, opt, log_events=False, **options) for part, opt in watched]
    params = [p for part in parts for p in part.parameters()]
    losses: list[list[float]] = []
    updated: list[bool] = []  # per step: did the optimizer change this rank's weights
    outcome = "finished"
    try:
        for step, (x, y) in enumerate(batches(run.fault)):
            for truth in truths:
                truth.new_step(step)
            for opt in opts:
                opt.zero_grad()
            if rank == 0:
                schedule.step(x)
            else:
                mb_losses: list[Tensor] = []
                schedule.step(target=y, losses=mb_losses)
                losses.append([loss.detach().item() for loss in mb_losses])
            before = [p.detach().clone() for p in params]
            try:
                for opt in opts:
                    opt.step()
            finally:
                pairs = zip(before, params, strict=True)
                updated.append(any(not torch.equal(b, a) for b, a in pairs))
    except nand.NonFiniteError as exc:
        outcome = f"NonFiniteError@{exc.event.step}"
    except nand.StopRequested as exc:
        outcome = f"StopRequested@{exc.step}"
    finally:
        for watch in watches:
            watch.close()
    return {
        "truth": [truth.first for truth in truths],  # (per stage this rank runs)
        "first": [_event(watch.first) for watch in watches],
        "losses": losses,
        "updated": updated,
        "outcome": outcome,
        "finite_weights": all(bool(torch.isfinite(p).all()) for p in params),
    }


def _event(event: Any) -> dict[str, Any] | None:
    if event is None:
        return None
    keys = ("step", "micro_step", "phase", "module", "cause", "via")
    return {key: getattr(event, key, None) for key in keys}


def rank_main(
    rank: int, port: int, endpoint: str, prefix: str, runs: list[Run], results: Any
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for run in runs:
            results[(run.name, rank)] = run_once(rank, run, endpoint, f"{prefix}-{run.name}")
            dist.barrier()
    finally:
        dist.destroy_process_group()
