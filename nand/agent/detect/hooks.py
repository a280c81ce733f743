"""Module and tensor hooks: the hot path. Device work only, never a sync.

Per module call:

- the **forward hook** probes each float output (one ``aminmax``) and registers
  a **tensor hook** on it that probes its gradient in backward. Tensor hooks on
  forward outputs, not ``register_full_backward_hook``: they cost a fraction,
  work with ``ReLU(inplace=True)`` and see the right gradient when an in-place
  op follows.
- a Linear, convolution or norm with a trained bias of its own takes no
  tensor hook: its output gradient is read from ``bias.grad`` by a hook
  registered once on the bias (``grads.BiasProxy``), except for a second call
  in a micro-step, under ``torch.compile``, and under DDP/FSDP (there the
  bias gradient is all-reduced: a real probe keeps this rank's own value).
- the output of a masking module (ReLU) gets its gradient probe only when
  what consumes it could make a non-finite gradient exactly where it cut
  (see ``modules.BENIGN_BACKWARD``): the consumer's hook decides.
- hooks fire when a module *finishes* (children before parents). A value made
  by code written inline in a parent's ``forward`` reaches the next child as an
  input that is not the output recorded last; that input is probed as the
  parent's ("inline"), so the parent is blamed, not the child. Containers check
  their inputs in a forward pre-hook, before their children run; leaves check
  them in the forward hook.
- a parent whose output is its last child's output (``Sequential``) adds no
  probe: the child already took it.
- inside an ``nn.Sequential`` the data flow is known: a finite-preserving
  child that feeds a probed leaf gets no hook at all, and the leaf does not
  examine its input (``modules.Chains``).
- the **root** pre-hook marks a micro-step and probes the input data
  (positional and keyword, nested); the root's outputs get a "loss" tensor hook:
  the gradient arriving there comes from the loss computation.

Under ``torch.compile`` these hooks are inlined when they are registered before
the first compiled call; tensor hooks cause graph breaks (see ``watch.py``).

Torch keeps these hooks in the modules' ``__dict__``: ``copy.deepcopy`` (an
EMA model) and ``torch.save`` of a watched model copy them. Each is handed
to torch as a :class:`SavableHook`, which copies as a no-op. A shallow copy
shares the hook dicts themselves: each hook returns at once when called
for a module other than the one it was installed on.

"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from nand.agent.detect.grads import BiasProxy, GradHooks
from nand.agent.detect.modules import CONTAINERS, Chains, ModuleInfo, proxy_bias
from nand.agent.detect.probes import MICRO, Site, iter_tensors
from nand.agent.detect.state import HookState

# is_dynamo_compiling: False in eager at the cost of a call (dynamo makes it True)
_is_compiling = torch.compiler.is_dynamo_compiling

#: Autograd nodes of elementwise ops that cannot make a finite value
#: non-finite, when written inline (``F.relu(self.linear1(x))``); of those, the
#: ones whose backward zeroes gradients where the input was cut.
FINITE_NODES = frozenset(
    {"ReluBackward0", "GeluBackward0", "SiluBackward0", "TanhBackward0", "SigmoidBackward0"}
)
#: Those that also keep an allowed -inf finite (gelu(-inf) and silu(-inf) are
#: -inf * 0 = NaN): used when some module may emit -inf (``allow_nonfinite``).
NEGINF_SAFE_NODES = frozenset({"ReluBackward0", "TanhBackward0", "SigmoidBackward0"})
MASKING_NODES = frozenset({"ReluBackward0"})
#: Probe entries after which a window is read at the next root call even
#: without an optimizer step (see ``HookState.window_full``).
MAX_WINDOW = 100_000


def _finite_op_of(
    x: Tensor, last: Tensor | None, nodes: frozenset[str] = FINITE_NODES
) -> str | None:
    """The node name if ``x`` is one finite-preserving op applied to ``last``.

    ``last`` was probed (or is such an op of a probed value itself), so ``x``
    is finite whenever ``last`` is: probing it again would only re-read the
    same bytes (an 8 MB activation in a transformer's feed-forward block).
    """
    node = x.grad_fn
    # ``last`` changed in place since it was probed (by inline code): not covered.
    if node is None or last is None or last.grad_fn is None or last._version:
        return None
    name = node.name()
    if name not in nodes:
        return None
    nexts = node.next_functions
    if len(nexts) != 1 or nexts[0][0] is not last.grad_fn or nexts[0][1] != last.output_nr:
        return None
    return name


#: What a hook of nand's becomes in a pickle or a deep copy (see SavableHook).
DORMANT_EVENT = "nand.hook: the model was copied or saved from a nand.watch; this hook does nothing"


class SavableHook(functools.partial):
    """A module hook as nand hands it to torch: called like the function it
    wraps (a C call, no Python frame more), and a no-op once pickled or
    deep-copied.

    Torch keeps module hooks in the module's ``__dict__``, so
    ``torch.save(model)`` and ``copy.deepcopy(model)`` take them along, and a
    closure does not pickle. The copy gets ``partial(sys.audit, ...)``
    instead: it takes any arguments and returns None (a forward hook's "leave
    the output alone"), needs only the standard library to load, and tells
    only an audit hook, if one is installed, that it was called. A parameter's
    hooks torch does not save at all.
    """

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, ...]:
        return (functools.partial, (sys.audit, DORMANT_EVENT))


class Hooks:
    """Installs and removes every module hook of one watch."""

    def __init__(self, state: HookState) -> None:
        self.state = state
        self.handles: list[RemovableHandle] = []
        self._grad_hooks: dict[int, GradHooks] = {}
        self._finite_nodes = FINITE_NODES

    def install(
        self, root: nn.Module, infos: dict[nn.Module, ModuleInfo], *, proxies: bool = True
    ) -> None:
        """Hook every module; ``proxies``: read output gradients from biases
        where that is exact (not when a wrapper all-reduces the gradients:
        the local value is what tells produced from received)."""
        if any(info.allow_neginf for info in infos.values()):
            self._finite_nodes = NEGINF_SAFE_NODES
        chains = Chains(root, infos)
        biased = self._install_proxies(root, infos) if proxies else {}
        for module, info in infos.items():
            if isinstance(module, CONTAINERS) or module in chains.unhooked:
                continue
            if module is root:
                self._hook(
                    module.register_forward_pre_hook, self._root_pre(root, info), with_kwargs=True
                )
                self._hook(module.register_forward_hook, self._root_hook(module, info))
            elif info.safe:
                self._hook(module.register_forward_hook, self._safe_hook(module, info))
            elif info.leaf:
                trusting = module in chains.trusting
                leaf_hook = self._leaf_hook(module, info, biased.get(module), trusting)
                self._hook(module.register_forward_hook, leaf_hook)
            else:
                self._hook(module.register_forward_pre_hook, self._container_pre(module, info))
                self._hook(module.register_forward_hook, self._container_hook(module, info))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _install_proxies(
        self, root: nn.Module, infos: dict[nn.Module, ModuleInfo]
    ) -> dict[nn.Module, BiasProxy]:
        """A bias hook for every module whose output gradient its bias gives."""
        found: dict[nn.Module, BiasProxy] = {}
        for module, bias in proxy_bias(root, infos).items():
            site = infos[module].output_site("").backward
            assert site is not None
            found[module] = BiasProxy(site, bias)
            self.handles.append(found[module].listen(self.state))
        return found

    def _hook(
        self, register: Callable[..., RemovableHandle], hook: Callable[..., None], **options: bool
    ) -> RemovableHandle:
        """Register a module hook of nand's: as a :class:`SavableHook` (a saved or
        copied model takes it along), its handle kept for :meth:`remove`."""
        handle = register(SavableHook(hook), **options)
        self.handles.append(handle)
        return handle

    # --- the hooks ------------------------------------------------------------

    def _leaf_hook(
        self, owner: nn.Module, info: ModuleInfo, proxy: BiasProxy | None, trusting: bool
    ) -> Callable[..., None]:
        """``trusting``: the input comes straight from an unhooked
        finite-preserving module (see ``modules.Chains``); not examined."""
        state, guard = self.state, self.state.guard
        out_site = info.output_site("")
        assert out_site.backward is not None
        grad_hooks = self._grad_hook(out_site.backward)

        def leaf_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if guard.off or module is not owner:  # (not a shallow copy's: it shares hook dicts)
                return
            try:
                if _is_compiling() or state.slots.active:  # (first: no guard on active)
                    self._slotted(info, output)
                    return
                if state.pending is not None:
                    self._settle(info, args)
                if not trusting and args and (len(args) > 1 or args[0] is not state.last):
                    self._check_inputs(args, output, info, module)
                if not isinstance(output, Tensor):
                    self._probe_structure(info, output)
                elif output.is_floating_point() and output.numel():
                    self._probe(out_site, output)
                    if output.requires_grad:
                        self._watch_gradient(output, grad_hooks, proxy)
                    state.last = output
            except Exception as exc:
                guard.failed(exc, f"forward hook of {info.name!r}")

        return leaf_hook

    def _watch_gradient(self, output: Tensor, hooks: GradHooks, proxy: BiasProxy | None) -> None:
        """Probe ``output``'s gradient in backward: through the bias proxy for
        the module's first call in a micro-step, else with a hook of its own."""
        if proxy is None or proxy.armed == self.state.micro:
            hooks.attach(output)
        else:
            proxy.armed = self.state.micro  # the bias gradient stands for this one

    def _safe_hook(self, owner: nn.Module, info: ModuleInfo) -> Callable[..., None]:
        state = self.state
        backward = info.output_site("").backward
        assert backward is not None
        grad_hooks = self._grad_hook(backward) if info.masking else None
        out_site = info.output_site("")  # not probed: its shape is for the gradient's event

        def safe_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if state.guard.off or module is not owner:  # (not a copy's: see leaf_hook)
                return
            if _is_compiling() or state.slots.active:
                return  # slot mode: finite-preserving modules are not probed, nor tracked
            try:
                if state.pending is not None:
                    self._settle(info, args)
                if args and (len(args) > 1 or args[0] is not state.last):
                    self._check_inputs(args, output, info, module)
                if isinstance(output, Tensor):
                    if grad_hooks is not None and output.requires_grad:
                        # Masking: the probe waits for the consumer. A value
                        # pending here is this module's input, cut at the same
                        # places: this output's probe supersedes it.
                        state.pending = (output, grad_hooks.attach)
                        out_site.shape, out_site.dtype = output.shape, output.dtype
                    state.last = output
            except Exception as exc:
                state.guard.failed(exc, f"forward hook of {info.name!r}")

        return safe_hook

    def _container_pre(self, owner: nn.Module, info: ModuleInfo) -> Callable[..., None]:
        state = self.state

        def container_pre(module: nn.Module, args: tuple[Any, ...]) -> None:
            if state.guard.off or not args or module is not owner:
                return
            if _is_compiling() or state.slots.active:
                return  # slot mode: no inline check (see compiled.py)
            try:
                self._check_inputs(args, None, info, module)
                if isinstance(args[0], Tensor):
                    state.last = args[0]
            except Exception as exc:
                state.guard.failed(exc, f"forward pre-hook of {info.name!r}")

        return container_pre

    def _container_hook(self, owner: nn.Module, info: ModuleInfo) -> Callable[..., None]:
        state = self.state

        def container_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if state.guard.off or module is not owner:
                return
            try:
                if _is_compiling() or state.slots.active:
                    self._slotted(info, output)
                    return
                if isinstance(output, Tensor):
                    if output is not state.last:
                        self._probe_output(info.output_site(""), output)
                        state.last = output
                else:
                    self._probe_structure(info, output)
            except Exception as exc:
                state.guard.failed(exc, f"forward hook of {info.name!r}")

        return container_hook

    def _root_pre(self, owner: nn.Module, info: ModuleInfo) -> Callable[..., None]:
        state, guard = self.state, self.state.guard

        def root_pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if guard.off or module is not owner:
                return
            try:
                if _is_compiling():  # slot mode, and no step boundary from compiled code
                    self._slotted_inputs(info, args, kwargs)
                    return
                if not state.external_batches:
                    self._new_micro_step()
                if state.slots.active:
                    self._slotted_inputs(info, args, kwargs)
                    return
                if not kwargs and len(args) == 1 and isinstance(args[0], Tensor):
                    self._probe_input(info, "args[0]", args[0])  # most models: no walk
                    return
                for path, t in iter_tensors((args, kwargs)):
                    self._probe_input(info, _input_slot(path), t)
            except Exception as exc:
                guard.failed(exc, "forward pre-hook of the root module")

        return root_pre

    def _root_hook(self, owner: nn.Module, info: ModuleInfo) -> Callable[..., None]:
        state = self.state

        def root_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if state.guard.off or module is not owner:
                return
            try:
                if _is_compiling() or state.slots.active:
                    self._slotted(info, output)
                    return
                if state.pending is not None:  # consumed by the loss: unknown code
                    self._settle(None, ())
                if output is state.last:  # Sequential-like: the last child's output
                    state.last = None
                    return
                for slot, t in iter_tensors(output):
                    if not t.is_floating_point() or not t.numel():
                        continue
                    # Shared with the last child: that child's gradient hook is
                    # the first to fire in backward; the analysis knows it
                    # sees the loss gradient there. Otherwise, a hook of its own.
                    if t is not state.last:
                        self._probe(info.output_site(slot), t)
                        if t.requires_grad:
                            self._grad_hook(info.loss_site(slot)).attach(t)
                state.last = None
            except Exception as exc:
                state.guard.failed(exc, "forward hook of the root module")

        return root_hook

    # --- slot mode (a hook ran under torch.compile: see compiled.py) ------------

    def _slotted(self, info: ModuleInfo, output: Any) -> None:
        """Probe every float tensor of ``output`` into its slot (forward only)."""
        for name, t in iter_tensors(output):
            self.state.slots.record(t, info, False, name)

    def _slotted_inputs(self, info: ModuleInfo, args: Any, kwargs: Any) -> None:
        for path, t in iter_tensors((args, kwargs)):
            self.state.slots.record(t, info, True, _input_slot(path))

    # --- micro-steps -----------------------------------------------------------

    def _new_micro_step(self) -> None:
        """A root call (or a batch, see :meth:`new_batch`) starts a micro-step:
        the step before ends first when there is no optimizer."""
        state = self.state
        if state.before_root is not None:
            state.before_root()
        elif len(state.buf.sites) > MAX_WINDOW and state.window_full is not None:
            state.window_full()
        if not state.slots.active:  # (slots fold a window's micro-steps)
            state.buf.sites.append(MICRO)
        state.last = state.pending = None
        state.micro += 1

    def new_batch(self, root: ModuleInfo, batch: Any) -> None:
        """A batch arrives where the root's forward is not what takes it
        (Lightning's ``training_step``): it starts the micro-step and is
        checked as the input data. From then on root calls mark nothing."""
        state = self.state
        if state.guard.off:
            return
        try:
            state.external_batches = True
            self._new_micro_step()
            for path, t in iter_tensors(batch):
                name = "batch" + (path if path.startswith("[") or not path else "." + path)
                if state.slots.active:
                    state.slots.record(t, root, True, name)
                else:
                    self._probe_input(root, name, t)
        except Exception as exc:
            state.guard.failed(exc, "the batch check")

    # --- helpers (called from the hooks) ---------------------------------------

    def _check_inputs(
        self, args: tuple[Any, ...], output: Any, info: ModuleInfo, module: nn.Module
    ) -> None:
        """Probe inputs that are not the last recorded output, as the parent's.

        Only values that require grad: those derive from the model's
        activations. A tensor that does not (an attention mask full of -inf
        on purpose, built inline from constants or from the data) is not a
        candidate for "the parent's code made it non-finite". So under
        ``no_grad`` inline code is not told apart from the next child.

        A module with forward pre-hooks of its own (other than nand's) may
        have had its inputs changed by them: those belong to the module's
        call, so the value is the module's, not its parent's.

        A value that is one relu/gelu/silu/tanh/sigmoid of the last recorded
        output cannot be non-finite unless that output was: no forward probe
        (relu keeps its gradient probe unless its consumer's backward is
        benign, see :data:`MASKING_NODES` and :meth:`_settle`).
        """
        last = self.state.last
        owner: ModuleInfo | None = None
        for x in args:
            if (
                isinstance(x, Tensor)
                and x is not last
                and x is not output
                and x.requires_grad
                and x.is_floating_point()
                and x.numel()
            ):
                if owner is None:
                    nands = 0 if info.leaf else 1  # containers carry nand's pre-hook
                    own = len(module._forward_pre_hooks) > nands
                    owner = info if own or info.parent is None else info.parent
                node = _finite_op_of(x, last, self._finite_nodes)
                if node is None:
                    self._probe_output(owner.inline_site(), x)
                elif node in MASKING_NODES:
                    # Its backward can hide a NaN the next module made (see
                    # modules.MASKING): the gradient is probed, unless this
                    # module, its consumer, has a benign backward.
                    site = owner.inline_site().backward
                    assert site is not None
                    if info.benign:
                        pass  # nothing it does in backward lines up with the cut
                    elif info.leaf and not info.safe:
                        self._grad_hook(site).attach(x)  # this leaf consumes it
                    else:  # a container or finite-preserving module passes it on
                        self._defer(x, self._grad_hook(site))

    def _defer(self, value: Tensor, hooks: GradHooks) -> None:
        """Hold a masking value's gradient probe until its consumer is known."""
        if self.state.pending is not None:
            self._settle(None, ())
        self.state.pending = (value, hooks.attach)

    def _settle(self, consumer: ModuleInfo | None, args: tuple[Any, ...]) -> None:
        """The pending masking value reaches ``consumer`` (``None``: unknown code).

        A finite-preserving module passes it on (its output carries the same
        cut positions); a module with a benign backward needs no probe in
        between; anything else, the probe is attached.
        """
        pending = self.state.pending
        assert pending is not None
        self.state.pending = None
        value, attach = pending
        if consumer is not None and len(args) == 1 and args[0] is self.state.last:
            if consumer.safe:
                self.state.pending = pending
                return
            if consumer.benign:
                return
        attach(value)

    def _probe_structure(self, info: ModuleInfo, output: Any) -> None:
        last = None
        for slot, t in iter_tensors(output):
            if t.is_floating_point() and t.numel():
                if last is None:
                    last = t
                if info.leaf or t is not self.state.last:
                    self._probe_output(info.output_site(slot), t)
        if last is not None:
            self.state.last = last

    def _probe_output(self, site: Site, t: Tensor) -> None:
        if t.is_floating_point() and t.numel():
            self._probe(site, t)
            if t.requires_grad and site.backward is not None:
                self._grad_hook(site.backward).attach(t)

    def _probe(self, site: Site, t: Tensor) -> None:
        buf = self.state.buf
        # An allow-listed module may emit -inf on purpose: only its max is watched.
        (buf.probe_max if site.allow_neginf else buf.probe)(t.detach(), site)
        site.shape, site.dtype = t.shape, t.dtype

    def _probe_input(self, info: ModuleInfo, slot: str, t: Tensor) -> None:
        if not t.is_floating_point() or not t.numel():
            return
        self._probe(info.input_site(slot), t)
        if self.state.last is None:
            self.state.last = t

    def _grad_hook(self, site: Site) -> GradHooks:
        """The gradient hooks for ``site``: cached, one pair per site."""
        hooks = self._grad_hooks.get(id(site))
        if hooks is None:
            hooks = GradHooks(self.state, site)
            self._grad_hooks[id(site)] = hooks
        return hooks


def _input_slot(path: str) -> str:
    """The name of a root input slot: ``args[0]``, ``.input_ids``, ``.batch.x``...

    ``path`` comes from :func:`iter_tensors` over ``(args, kwargs)``: ``[0][i]...``
    for positional arguments, ``[1].name...`` for keyword ones.
    """
    return path[3:] if path.startswith("[1].") else "args" + path[3:]
