"""What finite gradients imply about one optimizer update: pure rules.

Two questions, answered from the optimizer's type and hyperparameters alone
(no tensor is read), so the optimizer hooks can skip reading what an update
provably kept finite:

- :func:`state_follows`: is the state after an update finite whenever the
  gradients and the state before it were?
- :func:`update_terms` / :func:`bound_after_update`: how far can one update
  move any parameter? While that bound stays far below the dtype's limit the
  parameters cannot have become non-finite by the optimizer's hand.

Only exact ``SGD``, ``Adam`` and ``AdamW`` are reasoned about (a subclass may
compute something else); every other optimizer is read every step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from operator import is_not
from typing import Any, TypeGuard

import torch


def state_follows(optimizer: torch.optim.Optimizer) -> bool:
    """Whether finite gradients keep this optimizer's state finite, step by step.

    SGD's momentum buffer is ``m*buf + (1-d)*g`` and Adam's moments ``b1*m +
    (1-b1)*g`` and ``b2*v + (1-b2)*g*g`` (``amsgrad``: a running max of those):
    finite from finite inputs when the coefficients lie in [0, 1). Coupled
    weight decay adds ``wd*p`` to ``g`` first, which is not bounded by the
    gradient's norm, so it voids the argument; AdamW's decoupled decay touches
    the parameters only. The learning rate never enters the state.
    """
    kind = type(optimizer)
    if kind not in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        return False
    return all(_group_follows(kind, group) for group in optimizer.param_groups)


def _group_follows(kind: type, group: dict[str, Any]) -> bool:
    decay = group.get("weight_decay", 0)
    if kind is torch.optim.SGD:
        if not (_unit(group.get("momentum", 0)) and _unit(group.get("dampening", 0), 1.0)):
            return False
        return bool(decay == 0 or group.get("momentum", 0) == 0)
    if not all(_unit(b) for b in group.get("betas", (0.9, 0.999))):
        return False
    decoupled = kind is torch.optim.AdamW or group.get("decoupled_weight_decay", False)
    return decay == 0 or bool(decoupled)


#: Slack on Adam's step bound: it holds in exact arithmetic, and ``m / sqrt(v)``
#: is computed in the state's dtype (a few ulps off; float16 ~1e-3).
ROUNDING = 1.1


@dataclasses.dataclass(frozen=True, slots=True)
class UpdateTerms:
    """How far one update of a group can move its parameters, per unit of lr.

    After one update, ``max|p| <= |1 + lr*grow| * max|p| before + lr * (fixed +
    per_grad * grad_max)``, in exact arithmetic, where ``grad_max`` bounds
    every gradient element: linear in ``lr``, so a schedule that changes it
    every step needs no new derivation.
    """

    grow: float  # SGD: +weight decay; decoupled decay: -weight decay
    fixed: float = 0.0  # Adam: the per-element step bound per unit of lr
    per_grad: float = 0.0  # SGD: the step is lr * |g|
    #: SGD with momentum: the step is (at most) the gradient plus the
    #: momentum buffer, whose bound is carried from step to step
    #: (:func:`buffer_after_update`).
    momentum: float = 0.0

    def bound(self, lr: float, grad_max: float, buffer_max: float = 0.0) -> tuple[float, float]:
        """``(factor, shift)``: max|p| after <= factor * max|p| before + shift."""
        step_max = grad_max + buffer_max if self.momentum else grad_max
        by_grad = self.per_grad * step_max if self.per_grad else 0.0  # (0 * inf is NaN)
        return abs(1.0 + lr * self.grow), lr * (self.fixed + by_grad)


def update_terms(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> UpdateTerms | None:
    """The bound of one update, per unit of learning rate (``None``: no bound).

    - SGD without momentum: ``p - lr * (g + wd * p)``.
    - SGD with momentum ``m`` (dampening ``d``, Nesterov or not): the buffer
      is ``b = m*b + (1-d)*g'`` (``g'`` on the first step) with ``g' = g +
      wd*p``, and the step ``b``, or ``g' + m*b`` (Nesterov): at most ``|g'| +
      |b|`` per element, with ``|b|`` bounded by :func:`buffer_after_update`.
    - Adam/AdamW: with ``m`` and ``v`` built from the same gradients (the
      state is trusted, see :func:`state_follows`), Cauchy-Schwarz over the
      two geometric sums gives ``|m| <= (1-b1) sqrt(v / ((1-b2)(1-b1²/b2)))``;
      bias correction multiplies by at most ``1/(1-b1)`` and ``eps`` only
      shrinks the step, so it is at most ``lr / sqrt((1-b2)(1-b1²/b2))`` per
      element (73 lr for the default betas), whatever the gradients (coupled
      weight decay included, it is part of ``g``); decoupled decay scales the
      parameters by ``1 - lr * wd`` first.
    """
    if not _plain_number(group.get("weight_decay", 0)):
        return None
    decay = float(group.get("weight_decay", 0))
    kind = type(optimizer)
    if kind is torch.optim.SGD:
        momentum = group.get("momentum", 0)
        if momentum != 0 and not (_unit(momentum) and _unit(group.get("dampening", 0), 1.0)):
            return None
        return UpdateTerms(grow=decay, per_grad=1.0, momentum=float(momentum))
    if kind in (torch.optim.Adam, torch.optim.AdamW):
        b1, b2 = group.get("betas", (0.9, 0.999))
        if not (_unit(b1) and _unit(b2)) or b1 * b1 >= b2:
            return None
        fixed = ROUNDING / math.sqrt((1.0 - b2) * (1.0 - b1 * b1 / b2))
        decoupled = kind is torch.optim.AdamW or group.get("decoupled_weight_decay", False)
        return UpdateTerms(grow=-decay if decoupled else 0.0, fixed=fixed)
    return None


def bound_after_update(
    bound_before: float,
    terms: Sequence[UpdateTerms | None],
    groups: Sequence[dict[str, Any]],
    grad_max: float,
    buffer_max: float = 0.0,
) -> float | None:
    """The largest max|p| any group can reach in this update (exact arithmetic).

    ``bound_before`` bounds every parameter before it, ``terms`` are the
    groups' :func:`update_terms`, ``grad_max`` bounds every gradient element
    and ``buffer_max`` every momentum buffer's after it
    (:func:`buffer_after_update`). ``None`` when a group has no bound or a
    learning rate that is not a plain number (a tensor lr would need a host read).
    """
    bound = 0.0
    for group_terms, group in zip(terms, groups, strict=True):
        lr = group["lr"]
        if group_terms is None or not _plain_number(lr):
            return None
        factor, shift = group_terms.bound(float(lr), grad_max, buffer_max)
        bound = max(bound, bound_before * factor + shift)
    return bound


def buffer_after_update(
    buffer_before: float,
    param_before: float | None,
    terms: Sequence[UpdateTerms | None],
    grad_max: float,
) -> float | None:
    """A bound on every momentum buffer's max|x| after this update (SGD).

    ``m*b + (1-d)*(g + wd*p)``, or ``g + wd*p`` on a buffer's first step, is at
    most ``m*|b| + |g| + wd*|p|``. The bound never shrinks, so it also holds
    after an update that was skipped (the buffer then kept its value). ``None``
    when weight decay needs the parameters' bound and there is none.

    >>> buffer_after_update(0.0, None, [UpdateTerms(grow=0.0, per_grad=1.0, momentum=0.9)], 2.0)
    2.0
    """
    bound = buffer_before
    for group_terms in terms:
        if group_terms is None or not group_terms.momentum:
            continue
        decay = group_terms.grow
        if decay and param_before is None:
            return None
        by_decay = decay * param_before if decay and param_before is not None else 0.0
        bound = max(bound, group_terms.momentum * buffer_before + grad_max + by_decay)
    return bound


#: What :func:`state_follows` and :func:`update_terms` read of a group (not ``lr``).
RULE_KEYS = ("weight_decay", "momentum", "dampening", "betas", "decoupled_weight_decay")


class GroupRules:
    """:func:`state_follows` and :func:`update_terms` of one optimizer, derived
    again only when a hyperparameter they read changes; the learning rate,
    which a schedule changes every step, is applied per step
    (:func:`bound_after_update`).

    Changes are seen by identity (one C-level pass a step): a value that is
    replaced, even by an equal one, is derived again; a value that could change
    in place (a list, a tensor) makes the rules derived at every step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.follows = False
        self.terms: list[UpdateTerms | None] = []
        #: The values the rules were derived from, and whether one of them
        #: could change in place.
        self._seen: list[Any] = []
        self._mutable = True  # nothing derived yet

    def update(self) -> None:
        """Derive the rules again if a hyperparameter they read has changed."""
        groups = self.optimizer.param_groups
        if len(groups) == 1:  # (most optimizers: one C loop)
            seen = list(map(groups[0].get, RULE_KEYS))
        else:
            seen = [value for group in groups for value in map(group.get, RULE_KEYS)]
        if self._mutable or len(seen) != len(self._seen) or any(map(is_not, seen, self._seen)):
            self._seen = seen
            self._mutable = not all(map(_immutable, seen))
            self.follows = state_follows(self.optimizer)
            self.terms = [update_terms(self.optimizer, group) for group in groups]


def _immutable(value: Any) -> bool:
    """Whether a hyperparameter's value is pinned by its identity."""
    if isinstance(value, tuple):
        return all(map(_immutable, value))
    return value is None or type(value) in (bool, int, float, str)


def _plain_number(value: Any) -> TypeGuard[int | float]:
    """A non-negative finite Python number (a tensor would need a host read)."""
    return isinstance(value, (int, float)) and 0.0 <= value < math.inf


def _unit(value: Any, top: float = 1.0 - 1e-12) -> bool:
    """A plain number in [0, top] (a tensor hyperparameter is not proven)."""
    return isinstance(value, (int, float)) and 0.0 <= value <= top
