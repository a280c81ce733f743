"""Module and parameter names as the user wrote them, without wrapper prefixes.

``DistributedDataParallel`` adds ``module.``, ``torch.compile`` adds
``_orig_mod.``, FSDP (v1) adds ``_fsdp_wrapped_module.`` and activation
checkpointing ``_checkpoint_wrapped_module.``. A user who wrote ``fc1`` wants
to read ``fc1`` in a report, whatever wrapped the model.
"""

from __future__ import annotations

import torch
from torch import nn

from nand.errors import ConfigError

#: Path components that wrappers insert; dropped from every reported name.
WRAPPER_PARTS = frozenset(
    {"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"}
)

#: Attribute holding the wrapped model, per wrapper class name.
_INNER_ATTR = {
    "DistributedDataParallel": "module",
    "DataParallel": "module",
    "FullyShardedDataParallel": "_fsdp_wrapped_module",
    "OptimizedModule": "_orig_mod",
}


def clean_name(name: str) -> str:
    """``module._orig_mod.fc1.weight`` → ``fc1.weight``.

    Only the wrapper parts are dropped; a user's own submodule called
    ``module`` inside a plain model keeps its name (see :func:`unwrap`).
    """
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


def unwrap(model: nn.Module) -> tuple[nn.Module, bool]:
    """The innermost user model under DDP / DataParallel / FSDP / compile wrappers.

    Returns the model and whether anything was unwrapped (then names are
    cleaned of wrapper parts; otherwise they are reported verbatim).
    """
    wrapped = False
    while type(model).__name__ in _INNER_ATTR:
        inner = getattr(model, _INNER_ATTR[type(model).__name__], None)
        if not isinstance(inner, nn.Module):
            break
        model, wrapped = inner, True
    return model, wrapped


def module_names(model: nn.Module, wrapped: bool) -> dict[nn.Module, str]:
    """Every submodule (each once, even if shared) with its reported name."""
    names: dict[nn.Module, str] = {}
    for name, module in model.named_modules():
        names.setdefault(module, clean_name(name) if wrapped else name)
    return names


def param_names(model: nn.Module, wrapped: bool) -> dict[nn.Parameter, str]:
    """Every parameter (shared ones once) with its reported qualified name."""
    return {p: clean_name(n) if wrapped else n for n, p in model.named_parameters()}


def param_owners(
    model: nn.Module, owners: dict[nn.Module, tuple[str, str]], wrapped: bool
) -> dict[nn.Parameter, tuple[str, str]]:
    """Every parameter with ``(qualified name, type of the module that owns it)``.

    ``owners`` maps the watched modules to their ``(name, type)``; a parameter
    of a module not watched gets its name and an empty type.
    """
    named: dict[nn.Parameter, tuple[str, str]] = {}
    for module, (name, type_name) in owners.items():
        for pname, p in module.named_parameters(recurse=False):
            named.setdefault(p, (f"{name}.{pname}" if name else pname, type_name))
    for p, qualified in param_names(model, wrapped).items():
        named.setdefault(p, (qualified, ""))
    return named


#: Attributes in which optimizer wrappers keep the optimizer they wrap:
#: accelerate's ``AcceleratedOptimizer`` and DeepSpeed's engines (``optimizer``),
#: Lightning's ``LightningOptimizer`` (``_optimizer``).
_INNER_OPTIMIZER_ATTRS = ("optimizer", "_optimizer")


def unwrap_optimizer(optimizer: object) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` that does the updates, under any wrappers.

    A wrapper's ``step`` ends in its inner optimizer's ``step``, whose hooks
    torch runs; the wrapper's own hooks may never run (``AcceleratedOptimizer``
    subclasses ``Optimizer`` without initialising it, so it has none). So the
    innermost optimizer that torch can hook is the one nand hooks.

    >>> inner = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    >>> class Wrapper:
    ...     def __init__(self, optimizer): self._optimizer = optimizer
    >>> unwrap_optimizer(Wrapper(inner)) is inner
    True
    >>> unwrap_optimizer("sgd")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    nand.errors.ConfigError: optimizer=str: expected a torch.optim.Optimizer, or a wrapper ...
    """
    current, seen = optimizer, set()
    while id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, torch.optim.Optimizer) and hasattr(
            current, "_optimizer_step_pre_hooks"
        ):
            return current
        inner = next(
            (getattr(current, a) for a in _INNER_OPTIMIZER_ATTRS if hasattr(current, a)), None
        )
        if inner is None:
            break
        current = inner
    raise ConfigError(
        f"optimizer={type(optimizer).__name__}: expected a torch.optim.Optimizer, "
        "or a wrapper holding one in .optimizer or ._optimizer"
    )
