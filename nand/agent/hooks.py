"""Module and tensor hooks: the hot path. Device work only, never a sync.

Per module call:

- the **forward hook** probes each float output (one ``aminmax``) and registers
  a **tensor hook** on it that probes its gradient in backward. Tensor hooks on
  forward outputs, not ``register_full_backward_hook``: they cost a fraction,
  work with ``ReLU(inplace=True)`` and see the right gradient when an in-place
  op follows (FINDINGS.md).
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
- in an exact ``nn.Sequential`` the data flow is known: a finite-preserving
  child that feeds a probed leaf gets no hook at all, the leaf does not
  examine its input, and a root ending in a probed leaf gets no forward hook
  (``modules.Chains``). For an MLP that leaves one hook per Linear, and
  one on the first Linear's bias.
- the **root** pre-hook marks a micro-step and probes the input data
  (positional and keyword, nested); the root's outputs get a "loss" tensor hook:
  the gradient arriving there comes from the loss computation. An exact
  ``nn.Sequential`` that starts with a probed leaf hands it its input as is:
  that leaf's hook does the pre-hook's work, and the root has no hook at all
  when it also ends in one. When that leaf is an ``nn.Linear``, whose output
  is non-finite whenever its input is, the input is kept rather than probed,
  and looked at only when that output was (:meth:`Hooks.input_behind`).
- when the only gradient probes left are the bias proxies of such a root's
  children, their order in backward is known, and one hook reads them all
  (``grads.read_together``).
- such a root's ``forward`` becomes a :class:`sequential.SequentialForward`:
  it calls a child whose only hook is nand's leaf hook, and then the hook,
  itself, without torch's per-call hook machinery (~6 µs a call on CPU).

Under ``torch.compile`` these hooks are inlined when they are registered before
the first compiled call; tensor hooks cause graph breaks (see ``watch.py``).

Torch keeps these hooks in the modules' ``__dict__``: ``copy.deepcopy`` (an
EMA model) and ``torch.save`` of a watched model copy them. Each is handed
to torch as a :class:`SavableHook`, which copies as a no-op. A shallow copy
shares the hook dicts themselves: each hook returns at once when called
for a module other than the one it was installed on.

The hooks run between kernels, where a Python call costs several times its
warm figure (benchmarks/README.md, round 7): the hot ones write their probe out.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from nand.agent.compiled import CompiledSlots
from nand.agent.grads import BiasProxy, GradHooks, read_together
from nand.agent.modules import CONTAINERS, Chains, ModuleInfo, proxy_bias, runs_as
from nand.agent.probes import MICRO, ProbeBuffer, Site, iter_tensors
from nand.agent.safety import Guard
from nand.agent.sequential import SequentialForward
from nand.agent.step_check import Finding

_FLOAT32, _aminmax = torch.float32, torch.aminmax

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


class HookState:
    """What the hooks share: the buffer, the last recorded output, the guard.

    ``pending`` is a masking value (a relu's output) whose gradient probe waits
    for its consumer: the first hook to see it as its input decides (see
    :meth:`Hooks._settle`).
    """

    __slots__ = (
        "before_root", "buf", "external_batches", "guard", "last", "micro", "pending", "slots",
        "window_full",
    )  # fmt: skip

    def __init__(self, buf: ProbeBuffer, guard: Guard, slots: CompiledSlots) -> None:
        self.buf = buf
        self.guard = guard
        #: Where probes go once any hook ran under torch.compile (see compiled.py).
        self.slots = slots
        self.last: Tensor | None = None
        self.pending: tuple[Tensor, GradHooks] | None = None
        self.micro = 0  # root forward calls so far (not counted under torch.compile)
        #: Without an optimizer, each root call ends the last step: its boundary.
        self.before_root: Callable[[], None] | None = None
        #: The buffer passed :data:`MAX_WINDOW` entries: read it now.
        self.window_full: Callable[[], None] | None = None
        #: Micro-steps are marked by ``Watch.new_batch``, not by root calls.
        self.external_batches = False


class Hooks:
    """Installs and removes every module hook of one watch."""

    def __init__(self, state: HookState) -> None:
        self.state = state
        self.handles: list[RemovableHandle] = []
        self._grad_hooks: dict[int, GradHooks] = {}
        self._finite_nodes = FINITE_NODES
        #: (the first child's output site, the root's input site) when the
        #: root's input is held rather than probed (see ``input_behind``).
        self._held_for: tuple[Site, Site] | None = None
        #: An exact ``nn.Sequential`` root's forward while watched (see sequential.py).
        self._sequential: SequentialForward | None = None

    def install(
        self, root: nn.Module, infos: dict[nn.Module, ModuleInfo], *, proxies: bool = True
    ) -> None:
        """Hook every module; ``proxies``: read output gradients from biases
        where that is exact (not when a wrapper all-reduces the gradients:
        the local value is what tells produced from received)."""
        if any(info.allow_neginf for info in infos.values()):
            self._finite_nodes = NEGINF_SAFE_NODES
        chains = Chains(root, infos)
        biased = self._install_proxies(root, infos, chains) if proxies else {}
        leaf_hooks: dict[nn.Module, tuple[Callable[..., None], int]] = {}
        for module, info in infos.items():
            if isinstance(module, CONTAINERS) or module in chains.unhooked:
                continue
            if module is root:
                pre = None if chains.takes_root is not None else self._root_pre(root, info)
                self._install_root(module, info, pre, with_hook=not chains.root_is_last_leaf)
            elif info.safe:
                self._hook(module.register_forward_hook, self._safe_hook(module, info))
            elif info.leaf:
                trusting = module in chains.trusting
                root_pre = None
                if module is chains.takes_root:
                    hold = _implies_its_input(module, info)
                    if hold:
                        self._held_for = (info.output_site(""), infos[root].input_site("args[0]"))
                    root_pre = self._root_pre(root, infos[root], hold)
                leaf_hook = self._leaf_hook(
                    module, info, biased.get(module), trusting, (root, root_pre)
                )
                handle = self._hook(module.register_forward_hook, leaf_hook)
                leaf_hooks[module] = (leaf_hook, handle.id)
            else:
                self._hook(module.register_forward_pre_hook, self._container_pre(module, info))
                self._hook(module.register_forward_hook, self._container_hook(module, info))
        if type(root) is nn.Sequential:
            children = root._modules.values()
            forward = SequentialForward(
                root, {m: leaf_hooks[m] for m in children if m in leaf_hooks}
            )
            if forward.hooks and forward.install():
                self._sequential = forward

    def input_behind(self, finding: Finding) -> Finding | None:
        """A forward finding at the first child's output whose input was held,
        not probed: the input data, when that was non-finite. The slow path
        (see :func:`_implies_its_input`)."""
        if self._held_for is None or finding.site is not self._held_for[0]:
            return None
        held = self.state.buf.held
        x = held[finding.micro] if finding.micro < len(held) else None
        if x is None or not x.is_floating_point() or bool(torch.isfinite(x).all()):
            return None
        site = self._held_for[1]
        site.shape, site.dtype = x.shape, x.dtype
        # With the tensor at hand the event counts its NaNs and infinities.
        return Finding(
            site, "input", site.module, site.module_type, finding.micro, 0, 0,
            math.nan, math.nan, "data", tensor=x.detach(),
        )  # fmt: skip

    def remove(self) -> None:
        if self._sequential is not None:
            self._sequential.remove()
            self._sequential = None
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _install_proxies(
        self, root: nn.Module, infos: dict[nn.Module, ModuleInfo], chains: Chains
    ) -> dict[nn.Module, BiasProxy]:
        """Bias hooks for every module whose output gradient its bias gives:
        one for all of them when they form the root's chain, else one each."""
        found: dict[nn.Module, BiasProxy] = {}
        for module, bias in proxy_bias(root, infos).items():
            site = infos[module].output_site("").backward
            assert site is not None
            found[module] = BiasProxy(site, bias)
        chain = _proxy_chain(root, infos, chains, found)
        if chain is not None:
            self.handles.append(read_together(self.state, chain))
        else:
            self.handles.extend(proxy.listen(self.state) for proxy in found.values())
        return found

    def _install_root(
        self,
        module: nn.Module,
        info: ModuleInfo,
        pre: Callable[..., None] | None,
        with_hook: bool,
    ) -> None:
        if pre is not None:
            self._hook(module.register_forward_pre_hook, pre, with_kwargs=True)
        if with_hook:
            self._hook(module.register_forward_hook, self._root_hook(module, info))

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
        self,
        owner: nn.Module,
        info: ModuleInfo,
        proxy: BiasProxy | None,
        trusting: bool,
        takes_root: tuple[nn.Module, Callable[..., None] | None],
    ) -> Callable[..., None]:
        """``trusting``: the input comes straight from an unhooked
        finite-preserving module (see ``modules.Chains``); not examined.
        ``takes_root``: (the root, its pre-hook) when this leaf does the root
        pre-hook's work first (``modules.Chains.takes_root``), saving the
        root a hooked call."""
        # The hot path: everything it uses is bound here, once. Each Python
        # call costs several times its warm figure between kernels (see
        # ``OptimizerHooks._pre``): the probe is written out, not called.
        state, guard, buf = self.state, self.state.guard, self.state.buf
        probe, pairs, sites = buf.probe, buf.pairs, buf.sites
        # is_dynamo_compiling: False in eager at the cost of a call (dynamo makes it True)
        is_compiling = torch.compiler.is_dynamo_compiling
        out_site = info.output_site("")
        assert out_site.backward is not None
        grad_hooks = self._grad_hook(out_site.backward)
        allow = info.allow_neginf
        root, root_pre = takes_root
        slots = state.slots

        def leaf_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if module is not owner:
                return  # a shallow copy's (it shares torch's hook dicts): not watched
            if root_pre is not None:
                root_pre(root, args, {})  # (guarded itself)
            if guard.off:
                return
            try:
                if is_compiling() or slots.active:  # (is_compiling first: no guard on active)
                    self._slotted(info, output)
                    return
                if state.pending is not None:
                    self._settle(info, args)
                if not trusting and args and (len(args) > 1 or args[0] is not state.last):
                    self._check_inputs(args, output, info, module)
                if isinstance(output, Tensor):
                    if allow:
                        self._probe_output(out_site, output)
                    elif output.is_floating_point() and output.numel():
                        eager = not is_compiling()  # (first: dynamo would guard on len())
                        if (
                            eager
                            and (k := len(pairs)) < buf.room
                            and output.dtype is _FLOAT32
                            and output.device == buf.device
                        ):  # ProbeBuffer.probe's slab path, written out
                            into = buf.slots[k : k + 2]
                            _aminmax(output.detach(), out=into)
                            pairs.extend(into)
                            sites.append(out_site)
                        else:
                            probe(output.detach(), out_site)
                        out_site.shape, out_site.dtype = output.shape, output.dtype
                        if not output.requires_grad:
                            pass
                        elif proxy is None or not eager or proxy.armed == state.micro:
                            grad_hooks.attach(output)  # no proxy, or not this module's first call
                        else:
                            proxy.armed = state.micro  # the bias gradient stands for this one
                    state.last = output
                else:
                    self._probe_structure(info, output)
            except Exception as exc:
                guard.failed(exc, f"forward hook of {info.name!r}")

        return leaf_hook

    def _safe_hook(self, owner: nn.Module, info: ModuleInfo) -> Callable[..., None]:
        state = self.state
        backward = info.output_site("").backward
        assert backward is not None
        grad_hooks = self._grad_hook(backward) if info.masking else None
        out_site = info.output_site("")  # not probed: its shape is for the gradient's event

        def safe_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if state.guard.off or module is not owner:  # (not a copy's: see leaf_hook)
                return
            if torch.compiler.is_dynamo_compiling() or state.slots.active:
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
                        state.pending = (output, grad_hooks)
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
            if torch.compiler.is_dynamo_compiling() or state.slots.active:
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
                if torch.compiler.is_dynamo_compiling() or state.slots.active:
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

    def _root_pre(
        self, owner: nn.Module, info: ModuleInfo, hold: bool = False
    ) -> Callable[..., None]:
        """``hold``: the first child's output is non-finite whenever a plain
        tensor input is (see :func:`_implies_its_input`): that input is kept
        for :meth:`input_behind` instead of probed."""
        state, guard, buf = self.state, self.state.guard, self.state.buf
        probe = buf.probe
        held = buf.held if hold else None
        # is_dynamo_compiling: False in eager at the cost of a call (dynamo makes it True)
        is_compiling = torch.compiler.is_dynamo_compiling
        first = info.input_site("args[0]")

        def root_pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if guard.off or module is not owner:
                return
            try:
                if is_compiling():  # slot mode, and no step boundary from compiled code
                    self._slotted_inputs(info, args, kwargs)
                    return
                if not state.external_batches:
                    self._new_micro_step()
                if state.slots.active:
                    self._slotted_inputs(info, args, kwargs)
                    return
                if not kwargs and len(args) == 1 and isinstance(args[0], Tensor):
                    x = args[0]  # the common case, without walking structures
                    if held is not None:
                        held.append(x)  # one per micro-step
                        state.last = x
                        return
                    if x.is_floating_point() and x.numel():
                        probe(x.detach(), first)
                        first.shape, first.dtype = x.shape, x.dtype
                        state.last = x
                    return
                if held is not None:
                    held.append(None)  # probed below
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
                if torch.compiler.is_dynamo_compiling() or state.slots.active:
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
        self.state.pending = (value, hooks)

    def _settle(self, consumer: ModuleInfo | None, args: tuple[Any, ...]) -> None:
        """The pending masking value reaches ``consumer`` (``None``: unknown code).

        A finite-preserving module passes it on (its output carries the same
        cut positions); a module with a benign backward needs no probe in
        between; anything else, the probe is attached.
        """
        pending = self.state.pending
        assert pending is not None
        self.state.pending = None
        value, hooks = pending
        if consumer is not None and len(args) == 1 and args[0] is self.state.last:
            if consumer.safe:
                self.state.pending = pending
                return
            if consumer.benign:
                return
        hooks.attach(value)

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


def _proxy_chain(
    root: nn.Module,
    infos: dict[nn.Module, ModuleInfo],
    chains: Chains,
    proxies: dict[nn.Module, BiasProxy],
) -> list[BiasProxy] | None:
    """The root's bias proxies in call order, when nothing else probes backward.

    So when the root is an exact ``nn.Sequential`` ending in a probed leaf (no
    loss hook of its own) and every module that gets a hook is one of its
    children, registered once, whose gradient its bias gives: an MLP, a plain
    CNN. Then no other probe can fire in backward between theirs, and their
    order there is the reverse of the children's (``grads.read_together``).
    One device: the engine's per-device threads would not keep that order.
    """
    if not chains.root_is_last_leaf:  # (an exact Sequential)
        return None
    children = list(root._modules.values())
    for module in infos:
        if module is root or isinstance(module, CONTAINERS) or module in chains.unhooked:
            continue  # no hook
        if module not in proxies or module not in children or not chains.once(module):
            return None
    chain = [proxies[module] for module in children if module in proxies]
    if len(chain) < 2 or len({proxy.bias.device for proxy in chain}) != 1:
        return None
    return chain


def _implies_its_input(module: nn.Module, info: ModuleInfo) -> bool:
    """Whether ``module``'s probed output is non-finite whenever its input is,
    so that probing the input too would read the same news twice.

    An exact ``nn.Linear`` with outputs: each output of a row sums the whole
    input row times the weights, and NaN or an infinity times anything (0
    included) is non-finite, as is any sum with it (inf - inf is NaN). Not
    when only its max is watched (allow-listed: a -inf input could come out
    as -inf alone).
    """
    return (
        type(module) is nn.Linear
        and runs_as(module, (nn.Linear,))
        and module.out_features > 0
        and not info.allow_neginf
    )
