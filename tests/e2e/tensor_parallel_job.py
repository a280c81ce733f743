"""The tensor-parallel jobs of ``test_tensor_parallel.py``: a small model whose
MLP is split over 2 ranks (``ColwiseParallel`` fc1, ``RowwiseParallel`` fc2),
faults planted with plain hooks, and the ground truth recorded with plain
hooks too, without nand: where each rank first held a non-finite value, and
whether its own part of the tensor-parallel reduction there was finite."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor, nn

WORLD, STEPS, ACCUM = 2, 5, 2
BAD_RANK, BAD_STEP, BAD_MICRO = 1, 2, 1
INF = float("inf")


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.mlp = MLP()
        self.head = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.mlp(torch.tanh(self.inp(x))))


def tensor_parallel_net() -> Net:
    """The model, the same on every rank, its MLP split over the ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (WORLD,))
    plan = {"mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
    parallelize_module(model, mesh, plan)  # type: ignore[arg-type]
    return model


def fsdp_tensor_parallel_net() -> Net:
    """The model on a 2 x 2 mesh: the MLP split over ``tp`` (ranks 0-1 and
    2-3), every parameter then sharded by FSDP2 over ``dp`` (ranks 0-2, 1-3)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = {"mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
    parallelize_module(model, mesh["tp"], plan)  # type: ignore[arg-type]
    fully_shard(model, mesh=mesh["dp"])
    return model


def local(t: Any) -> Tensor:
    """This rank's part of ``t`` (a DTensor's local tensor), detached."""
    inner = getattr(t, "_local_tensor", t)
    return inner.detach()


def finite(t: Any) -> bool:
    return bool(torch.isfinite(local(t)).all())


@dataclasses.dataclass
class Clock:
    step: int = 0
    micro: int = 0

    def at_fault(self, rank: int) -> bool:
        return (rank, self.step, self.micro) == (BAD_RANK, BAD_STEP, BAD_MICRO)


def plant(fault: str, model: Net, opt: torch.optim.Optimizer, rank: int, clock: Clock) -> None:
    """The fault, planted on rank 1 with plain hooks registered before anyone's."""
    fc1 = model.mlp.fc1

    def forward(module: nn.Module, args: Any, out: Tensor) -> Tensor | None:
        if fault == "forward" and clock.at_fault(rank):  # +inf in fc1's output
            return torch.where(torch.arange(out.numel()).view(out.shape) == 0, INF, out)
        if fault == "backward" and clock.at_fault(rank):  # +inf into its gradient
            out.register_hook(
                lambda g: torch.where(torch.arange(g.numel()).view(g.shape) == 0, INF, g)
            )
        return None

    def after_update(*_: Any) -> None:  # NaN written into rank 1's shard of fc1.weight
        if fault == "param" and rank == BAD_RANK and clock.step == BAD_STEP:
            with torch.no_grad():
                local(fc1.weight).view(-1)[0] = float("nan")

    fc1.register_forward_hook(forward)
    opt.register_step_post_hook(after_update)


class Truth:
    """Where this rank first held a non-finite value, from plain hooks:
    ``first`` = (step, micro, phase, module, own part finite). ``forward``: a
    module's output; ``backward``: the gradient a module's backward sent to
    its input (named as nand names it: by that module); ``param``: its own
    shard of a weight after the update of a step (labelled, as nand labels
    it, with that step's last micro-step)."""

    def __init__(self, model: Net, opt: torch.optim.Optimizer, clock: Clock) -> None:
        self.clock = clock
        self.first: tuple[int, int, str, str, bool] | None = None
        self.partial: dict[tuple[str, str], bool] = {}  # (module, phase): own part finite
        self.order: list[str] = []  # modules in the order of this micro-step's forward
        for name, module in model.named_modules():
            if name:
                module.register_forward_hook(self._forward(name))
            if getattr(module, "_distribute_module_applied", False):
                module.register_forward_hook(self._part(name), prepend=True)
                module.register_forward_pre_hook(self._input_part(name))
        opt.register_step_post_hook(lambda *_: self._params(model))

    def _seen(self, phase: str, module: str, own_part: bool, step: int | None = None) -> None:
        if self.first is None:
            at = self.clock.step if step is None else step
            self.first = (at, self.clock.micro, phase, module, own_part)

    def _forward(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            self.order.append(name)
            if not finite(out):
                self._seen("forward", name, self.partial.get((name, "forward"), False))
            if isinstance(out, Tensor) and out.requires_grad:
                out.register_hook(self._gradient(len(self.order) - 1))

        return hook

    def _gradient(self, index: int) -> Any:
        def hook(grad: Tensor) -> None:  # into module `index`'s output: made by the next one's
            if not finite(grad) and index + 1 < len(self.order):
                made_by = self.order[index + 1]
                self._seen("backward", made_by, self.partial.get((made_by, "backward"), False))

        return hook

    def _part(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:  # before DTensor reduces it
            if any(p.is_partial() for p in getattr(out, "placements", ())):
                self.partial[(name, "forward")] = finite(out)

        return hook

    def _input_part(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            def grad_hook(grad: Any) -> None:
                if any(p.is_partial() for p in getattr(grad, "placements", ())):
                    self.partial[(name, "backward")] = finite(grad)

            for arg in args:
                if hasattr(arg, "placements") and arg.requires_grad:
                    arg.register_hook(grad_hook)

        return hook

    def _params(self, model: Net) -> None:
        for name, p in model.named_parameters():
            if not finite(p):
                self._seen("param", name, False, self.clock.step)

    def new_micro_step(self) -> None:
        self.order = []
        self.partial = {}


def batch(step: int, micro: int) -> Tensor:
    """The same batch on every rank (tensor parallelism splits the model, not the data)."""
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + micro))
