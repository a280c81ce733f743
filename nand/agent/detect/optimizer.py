"""Optimizer step hooks: the step boundary, and grad/param/state checks.

- **pre-hook** (before ``optimizer.step`` applies anything): one
  ``_foreach_norm`` over the ``.grad`` of every parameter; then the step
  boundary runs (``Watch._on_step``): the one host read, the policy. Raising
  here (``raise``/``stop``) leaves the weights untouched. Once the boundary
  lets the update go ahead, the step is counted, and from that read and the
  hyperparameters the update is about to use it decides whether what the
  update writes must be read at the next boundary (the two "implied finite"
  items below).
- **parameters and state**, when due, get one ``_foreach_norm`` over the
  parameters and float optimizer state (Adam's ``exp_avg``/``exp_avg_sq``;
  ``step`` counters skipped). A small model's (under
  :data:`FUSE_BELOW_BYTES`) ride in the next pre-hook's launch with the
  gradients: one multi-tensor launch per step. A large model's are taken by
  a **post-hook**, registered only then, right after the update wrote them,
  while they are still in cache (on CPU ~30% cheaper than the same pass at
  the next pre-hook). The results are read with the next step's boundary and
  labelled with this step (phase ``param``/``optimizer_state`` come after
  ``grad`` in the logical order); if the post-hook did not run (a raised
  step), the next pre-hook takes them instead; ``close`` reads the last
  step's.
- **optimizer state implied finite**: for ``SGD``, ``Adam`` and ``AdamW``
  the state after an update is a convex or geometric mix of the state before
  and the gradient (``g``, ``g*g``; see :func:`state_follows`). When this
  step's window was read all finite (every gradient's 2-norm finite, so every
  ``g*g`` is too) and the state was finite before, it is finite after: only
  the parameters are checked. The state is checked again after a window with
  anything non-finite in it and after ``load_state_dict``, until a read finds
  it finite; always for float16 state and for every other optimizer.
- **parameters implied finite**: for the same optimizers (SGD without
  momentum), one update moves any parameter by a bounded amount
  (:func:`update_bound`; Adam's step is at most ``lr / sqrt((1-b2)(1-b1²/b2))``
  per element whatever the gradients, SGD's ``lr * |g|``). Once the parameters
  were read finite, a bound on their largest magnitude is carried from step to
  step on the host, with no device work; while it stays far below the dtype's
  limit they are not read. Anything else (a dirty window, a distrusted state,
  a bound grown too large, another optimizer) reads them again. A parameter
  written non-finite by code other than the optimizer is then found in the
  next forward, and reported as ``param`` (``step.analysis.param_behind``).
- **skip** drops the step by setting every ``.grad`` to ``None``: optimizers
  skip parameters without a gradient (no update, no weight decay, no step
  count). On a GPU with a fused optimizer the same could be done without a
  host read by setting ``optimizer.found_inf`` to the device-side flag, as
  ``GradScaler`` does; that path is not implemented (no GPU to test it on).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from itertools import repeat
from operator import attrgetter, is_, is_not
from typing import Any, Protocol, TypeGuard

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from nand.agent.detect.probes import ProbeBuffer, Site, local
from nand.agent.safety import Guard

#: Parameters and state smaller than this (bytes) are checked in the next
#: pre-hook's launch rather than in a launch of their own after the update.
FUSE_BELOW_BYTES = 1 << 20


def state_follows(optimizer: torch.optim.Optimizer) -> bool:
    """Whether finite gradients keep this optimizer's state finite, step by step.

    Exact types only (a subclass may compute something else). SGD's momentum
    buffer is ``m*buf + (1-d)*g`` and Adam's moments ``b1*m + (1-b1)*g`` and
    ``b2*v + (1-b2)*g*g`` (``amsgrad``: a running max of those): finite from
    finite inputs when the coefficients lie in [0, 1). Coupled weight decay
    adds ``wd*p`` to ``g`` first, which is not bounded by the gradient's norm,
    so it voids the argument; AdamW's decoupled decay touches the parameters
    only. The learning rate never enters the state.
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
        return decay == 0 or group.get("momentum", 0) == 0
    if not all(_unit(b) for b in group.get("betas", (0.9, 0.999))):
        return False
    decoupled = kind is torch.optim.AdamW or group.get("decoupled_weight_decay", False)
    return decay == 0 or bool(decoupled)


#: Slack on Adam's step bound: it holds in exact arithmetic, and ``m / sqrt(v)``
#: is computed in the state's dtype (a few ulps off; float16 ~1e-3).
ROUNDING = 1.1


@dataclasses.dataclass(frozen=True, slots=True)
class UpdateTerms:
    """:func:`update_bound` of one group with its learning rate left out.

    After one update, ``max|p| <= |1 + lr*grow| * max|p| before + lr * (fixed +
    per_grad * grad_max)``: linear in ``lr``, so a schedule that changes it
    every step needs no new derivation.
    """

    grow: float  # SGD: +weight decay; decoupled decay: -weight decay
    fixed: float = 0.0  # Adam: the per-element step bound per unit of lr
    per_grad: float = 0.0  # SGD: the step is lr * |g|

    def bound(self, lr: float, grad_max: float) -> tuple[float, float]:
        by_grad = self.per_grad * grad_max if self.per_grad else 0.0  # (0 * inf is NaN)
        return abs(1.0 + lr * self.grow), lr * (self.fixed + by_grad)


def update_bound(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], grad_max: float
) -> tuple[float, float] | None:
    """``(factor, shift)``: after one update, max|p| <= factor * max|p| before + shift.

    In exact arithmetic; the caller adds the rounding of the final write.
    ``grad_max`` bounds every gradient element (the largest gradient 2-norm of
    the window). ``None``: no bound for this group (the parameters are read).
    The derivation is :func:`update_terms`'.
    """
    terms = update_terms(optimizer, group)
    lr = group.get("lr")
    if terms is None or not _plain_number(lr):
        return None
    return terms.bound(float(lr), grad_max)


def update_terms(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> UpdateTerms | None:
    """The bound of one update, per unit of learning rate (``None``: no bound).

    - SGD without momentum: ``p - lr * (g + wd * p)``.
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
        if group.get("momentum", 0) != 0:
            return None
        return UpdateTerms(grow=decay, per_grad=1.0)
    if kind in (torch.optim.Adam, torch.optim.AdamW):
        b1, b2 = group.get("betas", (0.9, 0.999))
        if not (_unit(b1) and _unit(b2)) or b1 * b1 >= b2:
            return None
        fixed = ROUNDING / math.sqrt((1.0 - b2) * (1.0 - b1 * b1 / b2))
        decoupled = kind is torch.optim.AdamW or group.get("decoupled_weight_decay", False)
        return UpdateTerms(grow=-decay if decoupled else 0.0, fixed=fixed)
    return None


#: What :func:`state_follows` and :func:`update_terms` read of a group (not ``lr``).
RULE_KEYS = ("weight_decay", "momentum", "dampening", "betas", "decoupled_weight_decay")


class GroupRules:
    """:func:`state_follows` and :func:`update_terms` of one optimizer, derived
    again only when a hyperparameter they read changes; the learning rate,
    which a schedule changes every step, is applied per step (by
    :meth:`OptimizerHooks._plan`, with :meth:`UpdateTerms.bound`'s formula).

    Changes are seen by identity (one C-level pass a step): a value that is
    replaced, even by an equal one, is derived again; a value that could change
    in place (a list, a tensor) makes the rules derived at every step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.follows = False
        self.terms: list[UpdateTerms | None] = []
        #: The values the rules were derived from, and whether one of them
        #: could change in place (both read by OptimizerHooks._plan's test).
        self.seen: list[Any] = []
        self.mutable = True  # nothing derived yet

    def update(self) -> None:
        groups = self.optimizer.param_groups
        if len(groups) == 1:  # the common case, without a nested loop
            seen = list(map(groups[0].get, RULE_KEYS))
        else:
            seen = [value for group in groups for value in map(group.get, RULE_KEYS)]
        if self.mutable or len(seen) != len(self.seen) or any(map(is_not, seen, self.seen)):
            self.seen = seen
            self.mutable = not all(map(_immutable, seen))
            self.follows = state_follows(self.optimizer)
            self.terms = [update_terms(self.optimizer, group) for group in groups]


def _immutable(value: Any) -> bool:
    """Whether a hyperparameter's value is pinned by its identity."""
    if isinstance(value, tuple):
        return all(map(_immutable, value))
    return value is None or type(value) in (bool, int, float, str)


def _plain_number(value: Any) -> TypeGuard[int | float]:
    """A non-negative Python number (a tensor lr would need a host read)."""
    return isinstance(value, (int, float)) and 0.0 <= value < math.inf


def _unit(value: Any, top: float = 1.0 - 1e-12) -> bool:
    """A plain number in [0, top] (a tensor hyperparameter is not proven)."""
    return isinstance(value, (int, float)) and 0.0 <= value <= top


_GRAD = attrgetter("grad")


def _closure_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], Any] | None:
    """The closure passed to ``optimizer.step`` (``args[0]`` is the optimizer)."""
    closure = kwargs["closure"] if "closure" in kwargs else (args[1] if len(args) > 1 else None)
    return closure if callable(closure) else None


def _usable(t: Any) -> bool:
    return isinstance(t, Tensor) and t.is_floating_point() and not t.is_sparse and t.numel() > 0


class ReadWindow(Protocol):
    """What the last step boundary read (``boundary.Boundary``)."""

    clean: bool  # nothing non-finite, suspects included
    read_norms: list[float]  # the multi-tensor norms, in launch order
    read_spans: dict[str, tuple[int, int]]  # (start, count) of "grad" and "param" among them


class OptimizerHooks:
    """Hooks one optimizer; ``boundary`` is called from the pre-hook."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        buf: ProbeBuffer,
        guard: Guard,
        names: dict[Any, tuple[str, str]],
        boundary: Callable[[], None],
        window: ReadWindow,
        evaluated: Callable[[int], None],
    ) -> None:
        self.optimizer = optimizer
        self.buf = buf
        self.guard = guard
        self.names = names  # param -> (qualified name, owning module type)
        self.boundary = boundary  # counts the step when the update goes ahead
        #: A closure evaluated again within one step (LBFGS): its window is checked.
        self.evaluated = evaluated
        self.window = window
        self.stepped = False  # set by the pre-hook; AMP reads and clears it
        self.stepped_once = False  # params/state are checked from the 2nd boundary on
        self._queued = False  # params/state of the last step are already in the buffer
        self._params_seen = (-1, -1)  # (groups, parameters) the cached lists were made from
        self._params_version = 0  # bumped when they are remade
        self._params: list[Tensor] = []
        self._grad_sites: list[Site] = []  # one per parameter, in order
        #: Every gradient can go straight into one ``_foreach_norm``: no DTensor
        #: (its local shard is read instead) and none sparse (no kernel) so far.
        self._grads_plain = True
        self._collected = (-1, -1)  # (params version, states) the lists were collected at
        self._state: tuple[list[Tensor], list[Site]] = ([], [])
        self._params_only: tuple[list[Tensor], list[Site]] = ([], [])
        self._plain = True  # no DTensor among params/state: no local() per step
        self._fuse = True  # params and state small: checked with the next grads
        self._state_half = False  # float16 state: g*g can overflow it
        #: The state is finite as far as the proof goes (see state_follows);
        #: a state that was there before nand is not known to be.
        self._rules = GroupRules(optimizer)
        self.state_trusted = state_follows(optimizer) and not optimizer.state
        self._state_due = False  # the last step's state is checked (read next boundary)
        #: An upper bound on every parameter's max|x| (None: not known, read them).
        self._bound: float | None = None
        self._params_due = True  # the last step's parameters are checked
        self._limit = 0.0  # bounds from here on are too close to the dtype's limit
        self._rounding = 1.0  # 1 + 4 eps of the coarsest parameter dtype
        self._by_module: dict[str, list[Tensor]] | None = None
        self._sites: dict[tuple[int, str, str], Site] = {}
        self.handles: list[RemovableHandle] = [
            optimizer.register_step_pre_hook(self._pre),
            optimizer.register_load_state_dict_post_hook(self._loaded),
        ]
        self._post_hooked = False  # the post-hook is there only for large models

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def params(self) -> list[Tensor]:
        """The optimizer's parameters (cached until the param groups change)."""
        groups = self.optimizer.param_groups
        n = len(groups)  # one group is the common case: no generator per step
        count = len(groups[0]["params"]) if n == 1 else sum(len(g["params"]) for g in groups)
        if n != self._params_seen[0] or count != self._params_seen[1]:
            self._params_seen = (n, count)
            self._params_version += 1
            self._params = [p for g in groups for p in g["params"]]
            self._grad_sites = [self._site(p, "grad", "") for p in self._params]
            self._grads_plain = not any(hasattr(p, "to_local") for p in self._params)
        return self._params

    def drop_grads(self) -> None:
        """Skip this step: no gradient, no update (see module docstring)."""
        for p in self.params():
            p.grad = None

    def _pre(self, optimizer: Any, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        """The optimizer's step pre-hook, before anything is applied.

        Without a closure the gradients are ready: the step boundary runs now.
        With one (``step(closure)``: Lightning's automatic optimization, LBFGS)
        the forward and backward run inside ``step``, after this hook, so the
        closure is replaced by one that runs the boundary as soon as it
        returns: still before the update, with this step's window complete.
        """
        if self.guard.off:
            return None
        closure = _closure_of(args, kwargs)
        if closure is None:
            self._at_boundary()
            return None
        closure = self._then_boundary(closure)
        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure}
        return (args[0], closure, *args[2:]), kwargs

    def _then_boundary(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure``, followed by the step boundary after its first call.

        An optimizer may call it again within the same step (LBFGS's line
        search evaluates the model several times): each later evaluation's
        window is checked as it returns, as micro-steps of the same step.
        """
        calls = 0

        def closure_then_boundary() -> Any:
            nonlocal calls
            loss = closure()
            calls += 1
            if self.guard.off:
                return loss
            if calls == 1:
                self._at_boundary()
            else:
                self.evaluated(calls - 1)
            return loss

        return closure_then_boundary

    def _at_boundary(self) -> None:
        """The step boundary, before the update: the norm launch, the
        boundary's read and policy, the plan for the next step.

        This runs once a step, in code the step's kernels have pushed out of
        the caches, where a Python call costs several times its warm figure
        (figures in benchmarks/README.md). So the
        healthy path is written as few calls: the launch's common case is
        written out here (:meth:`add_norms` takes the rest), then the
        boundary and :meth:`_plan`.
        """
        self.stepped = True
        state_read = self._state_due  # this window holds the state (see add_norms)
        try:
            groups = self.optimizer.param_groups
            grads = list(map(_GRAD, self._params))  # (C loops: no bytecode per parameter)
            norms = None
            if (
                not (self._params_due or self._state_due or self._queued)
                and self._grads_plain
                and grads
                and len(groups) == 1
                and self._params_seen == (1, len(groups[0]["params"]))
                and not any(map(is_, grads, repeat(None)))
            ):  # the gradients alone, every one plain: ProbeBuffer.add_norms, written out
                try:
                    norms = torch._foreach_norm(grads)
                except (NotImplementedError, RuntimeError):
                    norms = None  # a sparse gradient: add_norms finds it, filters from then on
            if norms is not None:
                buf = self.buf
                buf.spans["grad"] = (len(buf.norms), len(grads))
                if norms[0].dtype is torch.float64:
                    buf.spilled = True  # (the float32 slab would round them)
                buf.norms += norms
                buf.norm_sites += self._grad_sites
            else:
                self.add_norms(with_params=self.stepped_once)
        except Exception as exc:
            self.guard.failed(exc, "optimizer pre-step hook")
            return
        # If the boundary raises, the next boundary reads params and state.
        self._params_due = self._state_due = True
        self.boundary()  # guarded itself; may raise NonFiniteError / StopRequested
        if self.guard.off:
            return  # switched off by its own error
        self.stepped_once = True  # the update goes ahead
        try:
            self._plan(state_read)
        except Exception as exc:
            self.guard.failed(exc, "optimizer pre-step hook")

    def _plan(self, state_read: bool) -> None:
        """After this step's read, before its update: must the next boundary
        read what this update writes? Everything the answer depends on is known
        here (this window's norms, the hyperparameters this update uses), and
        deciding now spares the post-hook a second visit to cold code.

        Whether the parameters are implied finite is :func:`update_bound`'s
        question, from the norms read just before the update (``clean``: all
        finite): the gradients, and the parameters before it when they were
        read. Written out in one method (see :meth:`_pre`).
        """
        if (self._params_version, len(self.optimizer.state)) != self._collected:
            self._refresh()  # the parameter groups or the state's keys changed
        rules, groups = self._rules, self.optimizer.param_groups
        # The hyperparameters may have changed: GroupRules.update's own test,
        # written out for one group (see _pre).
        if (
            len(groups) != 1
            or rules.mutable
            or len(rules.seen) != len(RULE_KEYS)
            or any(map(is_not, map(groups[0].get, RULE_KEYS), rules.seen))
        ):
            rules.update()
        window = self.window
        clean = window.clean
        # The state this update writes is finite by state_follows when the
        # window (this step's gradients, and the state itself when read) was.
        if self._state_half or not clean or not rules.follows:
            self.state_trusted = False  # checked at every step until proven again
        elif state_read:
            self.state_trusted = True  # read finite, and finite gradients go in
        self._state_due = not self.state_trusted
        norms, spans = window.read_norms, window.read_spans
        if "param" in spans:  # read: a bound from what they were
            start, n = spans["param"]
            read = norms[start : start + n]
            self._bound = max(read, default=0.0) if math.isfinite(sum(read)) else None
        bound = None
        if self._bound is not None and clean and self.state_trusted:
            start, n = spans.get("grad", (0, 0))
            grad_max = max(norms[start : start + n]) if n else 0.0
            # UpdateTerms.bound of each group, its largest: max|p| after this
            # update, in exact arithmetic (written out, see _pre).
            bound = 0.0
            for terms, group in zip(rules.terms, groups, strict=True):
                lr = group["lr"]
                if terms is None or not isinstance(lr, (int, float)) or not 0.0 <= lr < math.inf:
                    bound = None  # (a tensor lr would need a host read)
                    break
                by_grad = terms.per_grad * grad_max if terms.per_grad else 0.0  # (0 * inf is NaN)
                grown = self._bound * abs(1.0 + lr * terms.grow) + lr * (terms.fixed + by_grad)
                if grown > bound:
                    bound = grown
        # Writing p - step rounds once more: a relative ulp or two of the dtype.
        if bound is not None and bound * self._rounding < self._limit:
            self._bound = bound * self._rounding
        else:
            self._bound = None  # not known: the next boundary reads them
        self._params_due = self._bound is None

    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Large models: the parameters and state, right after the update wrote
        them, while still in cache (the same multi-tensor pass costs less than
        at the next step)."""
        if self.guard.off:
            return
        try:
            self._refresh()  # the state's tensors exist from the first update on
            if self._fuse:
                return  # (now small): the next pre-hook takes them with the gradients
            self._add_params_and_state()
            self._queued = True
        except Exception as exc:
            self.guard.failed(exc, "optimizer post-step hook")

    def _hook_post(self) -> None:
        """Register the post-hook once the parameters and state are found large.

        Never removed before ``remove``: this may run while the optimizer
        iterates its post-hooks (from :meth:`_post`)."""
        if not self._post_hooked:
            self._post_hooked = True
            self.handles.append(self.optimizer.register_step_post_hook(self._post))

    def _loaded(self, optimizer: Any) -> None:
        # New state tensors, not checked yet; what the buffer holds is the old.
        self.state_trusted = self._state_due = False
        self._collected = (-1, -1)

    def params_of(self, module: str) -> list[Tensor]:
        """The watched parameters owned directly by ``module`` (its qualified name)."""
        if self._by_module is None:
            self._by_module = {}
            for p in self.params():
                name = self.names.get(p, ("", ""))[0]
                self._by_module.setdefault(name.rpartition(".")[0], []).append(p)
        return [p for p in self._by_module.get(module, []) if _usable(p)]

    def param_site(self, p: Tensor) -> Site:
        """Where a finding about parameter ``p`` itself is reported."""
        return self._site(p, "param", "")

    def add_norms(self, with_params: bool, force: bool = False) -> None:
        """Grads, and (``with_params``) params and state when due: one foreach launch.

        ``force``: the parameters even if implied finite (the last look at
        ``close``). The common case (the gradients alone, all plain) is
        written out in :meth:`_pre`.
        """
        params = self.params()
        grads = list(map(_GRAD, params))  # (C loops: no bytecode per parameter)
        if self._grads_plain and not any(map(is_, grads, repeat(None))):
            sites = self._grad_sites  # every parameter has a plain gradient: the common case
        else:
            grads, sites = self._usable_grads(params)
        buf = self.buf
        buf.spans["grad"] = (len(buf.norms), len(grads))
        if with_params and not self._queued:
            self._params_due |= force
            if self._params_due or self._state_due:
                self._refresh()
                sites = list(sites)  # not the cached list
                self._take_params_and_state(grads, sites)
        self._queued = False
        try:
            buf.add_norms(grads, sites)
        except (NotImplementedError, RuntimeError):
            if not self._grads_plain:
                raise
            self._grads_plain = False  # a sparse gradient: filter them from now on
            self.add_norms(with_params, force)

    def _usable_grads(self, params: list[Tensor]) -> tuple[list[Tensor], list[Site]]:
        """The dense float gradients (local shards), for the slow path."""
        tensors: list[Tensor] = []
        sites: list[Site] = []
        for p, site in zip(params, self._grad_sites, strict=True):
            g = p.grad
            if g is not None and not g.is_sparse and g.is_floating_point():
                tensors.append(g if type(g) is Tensor else local(g))
                sites.append(site)
        return tensors, sites

    def _add_params_and_state(self) -> None:
        tensors: list[Tensor] = []
        sites: list[Site] = []
        self._take_params_and_state(tensors, sites)
        self.buf.add_norms(tensors, sites)

    def _take_params_and_state(self, tensors: list[Tensor], sites: list[Site]) -> None:
        """Append the parameters and the state, each unless implied finite.

        Parameters are detached: the optimizer's hooks run outside its
        ``no_grad``, and a parameter's norm would otherwise record a graph node.
        """
        if self._params_due:
            params, param_sites = self._params_only
            self.buf.spans["param"] = (len(self.buf.norms) + len(tensors), len(params))
            tensors += [(t if self._plain else local(t)).detach() for t in params]
            sites += param_sites
        if self._state_due:
            state, state_sites = self._state
            tensors += state if self._plain else [local(t) for t in state]
            sites += state_sites

    def _refresh(self) -> None:
        """Rebuild the cached lists when the parameters or the state's keys change."""
        version, states = self._params_version, len(self.optimizer.state)
        if version != self._collected[0] or states != self._collected[1]:
            self._collected = (version, states)
            self._collect()

    def _collect(self) -> None:
        tensors, sites = [], []
        for p in self.params():
            if _usable(p):
                tensors.append(p)
                sites.append(self._site(p, "param", ""))
        self._params_only = (tensors[:], sites[:])
        self._bound, self._by_module = None, None  # new parameters: read them first
        dtypes = {t.dtype for t in tensors}
        self._limit = min((torch.finfo(d).max for d in dtypes), default=0.0) / 1024
        self._rounding = 1.0 + 4 * max((torch.finfo(d).eps for d in dtypes), default=0.0)
        for p in self.params():
            for name, value in self.optimizer.state.get(p, {}).items():
                if name != "step" and _usable(value):
                    tensors.append(value)
                    site = self._site(p, "optimizer_state", str(name))
                    site.param = value
                    sites.append(site)
        n = len(self._params_only[0])
        self._state = (tensors[n:], sites[n:])
        self._plain = not any(hasattr(t, "to_local") for t in tensors)  # no DTensor
        self._fuse = sum(t.numel() * t.element_size() for t in tensors) < FUSE_BELOW_BYTES
        if not self._fuse:
            self._hook_post()
        # Before the first update there is no state yet: it will take the
        # parameters' dtypes (what SGD, Adam and AdamW create).
        made_like = self._state[0] or self._params_only[0]
        self._state_half = any(t.dtype == torch.float16 for t in made_like)

    def _site(self, p: Tensor, phase: str, key: str) -> Site:
        site = self._sites.get((id(p), phase, key))
        if site is None:
            name, owner_type = self.names.get(p, (f"param{len(self._sites)}", ""))
            module = f"{name}:{key}" if key else name
            site = Site(phase, module, owner_type, -1, key, "norm", param=p, state_key=key)
            self._sites[(id(p), phase, key)] = site
        return site
