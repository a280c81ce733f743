"""Module and tensor hooks: the hot path. Device work only, never a sync.

Per module call:

- the **forward hook** probes each float output (one ``aminmax``) and registers
  a **tensor hook** on it that probes its gradient in backward (not a
  ``register_full_backward_hook``: a fraction of its cost, and right with
  ``ReLU(inplace=True)`` or another in-place op after it).
- a Linear, convolution or norm with a trained bias of its own takes no
  tensor hook: its output gradient is read from ``bias.grad`` by a hook
  registered once on the bias (``grads.BiasProxy``), except for a second call
  in a micro-step, under ``torch.compile``, a pipeline and DDP/FSDP (there the
  bias gradient is all-reduced: a real probe keeps this rank's own value).
- inputs that are not the output recorded last, nor probed already, were made
  by inline code in the parent's ``forward`` (``inline.InlineCheck``);
  containers check them in a pre-hook, leaves in the forward hook. A parent
  whose output is its last child's adds no probe; in an ``nn.Sequential`` a
  finite-preserving child feeding a probed leaf is not hooked (``modules.Chains``).
- the **root** pre-hook marks a micro-step and probes the input data
  (positional and keyword, nested); the root's outputs get a "loss" tensor
  hook: the gradient arriving there comes from the loss computation. A
  module called with no watched forward running is an **entry point**: its
  inputs are probed as data too (``entry.py``; the root and containers keep the
  count). The root's two hooks also hold what a replay needs (``rerun/held.py``).

Under ``torch.compile`` every probe goes to a fixed slot (``compiled.py``);
in the light mode the root's hooks run outside the graph (``eager.py``). Torch
keeps module hooks in the modules' ``__dict__``, so ``copy.deepcopy`` and
``torch.save`` take them along: each is handed to torch as a :class:`SavableHook`,
which copies as a no-op, and returns at once when called for a module other
than its own (a shallow copy shares the hook dicts).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from nand.agent.detect import eager
from nand.agent.detect.eager import OutsideGraph
from nand.agent.detect.entry import outside_backward, probe_inputs
from nand.agent.detect.grads import BiasProxy, GradHooks, loss_probe
from nand.agent.detect.inline import NEGINF_SAFE_NODES, PROBED, InlineCheck
from nand.agent.detect.modules import CONTAINERS, Chains, ModuleInfo, proxy_bias
from nand.agent.detect.probes import MICRO, Site, iter_tensors, tensors_of
from nand.agent.detect.savable import SavableHook
from nand.agent.detect.state import HookState

# is_dynamo_compiling: False in eager at the cost of a call (dynamo makes it True)
_is_compiling = torch.compiler.is_dynamo_compiling

#: Probe entries after which a window is read at the next root call even
#: without an optimizer step (see ``HookState.window_full``).
MAX_WINDOW = 100_000


class Hooks:
    """Installs and removes every module hook of one watch."""

    def __init__(self, state: HookState) -> None:
        self.state = state
        self.handles: list[RemovableHandle] = []
        #: The root's hooks, where compiled code calls them outside its graph.
        self.outside: tuple[OutsideGraph, OutsideGraph] | None = None
        self._grad_hooks: dict[int, GradHooks] = {}
        self._inline = InlineCheck(state, self._probe_output, self._grad_hook)

    def install(
        self,
        root: nn.Module,
        infos: dict[nn.Module, ModuleInfo],
        *,
        proxies: bool = True,
        modules: bool = True,
        outside_graph: bool = False,
    ) -> None:
        """Hook the root, and every other module unless ``modules`` is False
        (the light mode: see ``tiers.py``); ``outside_graph``: the root's
        hooks run outside compiled graphs (``eager.py``)."""
        info = infos[root]
        pre, post = self._root_pre(root, info), self._root_hook(root, info)
        if outside_graph:  # (compiled code calls them as plain Python: eager.py)
            pre, post = self.outside = eager.outside_graph(pre, post)
        self._hook(root.register_forward_pre_hook, pre, with_kwargs=True)
        self._hook(root.register_forward_hook, post, always_call=True)
        if modules:
            self.install_modules(root, infos, proxies=proxies)

    def install_modules(
        self, root: nn.Module, infos: dict[nn.Module, ModuleInfo], *, proxies: bool = True
    ) -> None:
        """Hook every module but the root; ``proxies``: read output gradients
        from biases where that is exact (not when a wrapper all-reduces the
        gradients: the local value is what tells produced from received)."""
        if any(info.allow_neginf for info in infos.values()):
            self._inline.finite_nodes = NEGINF_SAFE_NODES
        chains = Chains(root, infos)
        biased = self._install_proxies(root, infos) if proxies else {}
        for module, info in infos.items():
            if module is root or isinstance(module, CONTAINERS) or module in chains.unhooked:
                continue
            if info.safe:
                self._hook(module.register_forward_hook, self._safe_hook(module, info))
            elif info.leaf:
                trusting = module in chains.trusting
                leaf_hook = self._leaf_hook(module, info, biased.get(module), trusting)
                self._hook(module.register_forward_hook, leaf_hook)
            else:
                pre = self._container_pre(module, info)
                self._hook(module.register_forward_pre_hook, pre, with_kwargs=True)
                post = self._container_hook(module, info)  # (always: the depth count)
                self._hook(module.register_forward_hook, post, always_call=True)

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
                    self.state.slots.record_outputs(info, output)
                    return
                if state.pending is not None:
                    self._inline.settle(info, args)
                if not state.depth and outside_backward():  # an entry point (entry.py)
                    probe_inputs(self._probe_input, info, args, None)
                elif not trusting and args and (len(args) > 1 or args[0] is not state.last):
                    self._inline.check_inputs(args, output, info, module)
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
        if proxy is None or proxy.armed == self.state.micro or self.state.pipelined:
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
                    self._inline.settle(info, args)
                if not state.depth and outside_backward():  # an entry point (entry.py)
                    probe_inputs(self._probe_input, info, args, None)
                elif args and (len(args) > 1 or args[0] is not state.last):
                    self._inline.check_inputs(args, output, info, module)
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

        def container_pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if state.guard.off or module is not owner or _is_compiling():
                return
            state.depth += 1  # (down in container_hook; in slot mode too)
            if state.slots.active:
                return  # slot mode: no inline check (see compiled.py)
            try:
                if state.depth == 1 and outside_backward():  # an entry point (entry.py)
                    probe_inputs(self._probe_input, info, args, kwargs)
                elif args:
                    self._inline.check_inputs(args, None, info, module)
                if args and isinstance(args[0], Tensor):
                    state.last = args[0]
            except Exception as exc:
                state.guard.failed(exc, f"forward pre-hook of {info.name!r}")

        return container_pre

    def _container_hook(self, owner: nn.Module, info: ModuleInfo) -> Callable[..., None]:
        state = self.state

        def container_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if state.guard.off or module is not owner:
                return
            if state.depth and not _is_compiling():
                state.depth -= 1
            try:
                if _is_compiling() or state.slots.active:
                    self.state.slots.record_outputs(info, output)
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
                    self.state.slots.record_inputs(info, args, kwargs)
                    return
                state.depth = 1  # the model is running: no entry point inside it
                if not state.external_batches:
                    self._new_micro_step()
                if state.slots.active:
                    self.state.slots.record_inputs(info, args, kwargs)
                else:
                    probe_inputs(self._probe_input, info, args, kwargs)
            except Exception as exc:
                guard.failed(exc, "forward pre-hook of the root module")
            if state.held is not None:  # what a replay needs (rerun/held.py; guarded itself)
                state.held.hold_inputs(args, kwargs)

        return root_pre

    def _root_hook(self, owner: nn.Module, info: ModuleInfo) -> Callable[..., None]:
        state, loss_probes = self.state, functools.partial(loss_probe, self, info)

        def root_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if state.guard.off or module is not owner:
                return
            taken: Collection[int] = ()  # outputs whose loss probe the held step's hook calls
            if not _is_compiling():
                state.depth = 0  # (always called, an exception in forward too)
                if state.held is not None:  # (rerun/held.py; guarded itself)
                    taken = state.held.hold_gradients(output, loss_probes)
            try:
                if _is_compiling() or state.slots.active:
                    self.state.slots.record_outputs(info, output)
                    return
                if state.pending is not None:  # consumed by the loss: unknown code
                    self._inline.settle(None, ())
                if output is state.last:  # Sequential-like: the last child's output
                    state.last = None
                    return
                for slot, t in tensors_of(output):
                    if not t.is_floating_point() or not t.numel():
                        continue
                    # Shared with the last child: that child's gradient hook is
                    # the first to fire in backward; the analysis knows it
                    # sees the loss gradient there. Otherwise, a hook of its own.
                    if t is not state.last:
                        self._probe(info.output_site(slot), t)
                        if t.requires_grad and id(t) not in taken:
                            self._grad_hook(info.loss_site(slot)).attach(t)
                state.last = None
            except Exception as exc:
                state.guard.failed(exc, "forward hook of the root module")

        return root_hook

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

    def new_batch(self, root: ModuleInfo, batch: Any, step: Callable[[Any], Any] | None) -> None:
        """A batch arrives where the root's forward is not what takes it
        (Lightning's ``training_step``): it starts the micro-step and is
        checked as the input data. From then on root calls mark nothing."""
        state = self.state
        if state.guard.off:
            return
        try:
            state.external_batches = True
            state.depth = 0  # a batch starts outside every forward
            self._new_micro_step()
            for path, t in iter_tensors(batch):
                name = "batch" + (path if path.startswith("[") or not path else "." + path)
                if state.slots.active:
                    state.slots.record(t, root, True, name)
                else:
                    self._probe_input(root, name, t)
        except Exception as exc:
            state.guard.failed(exc, "the batch check")
        if state.held is not None:  # (rerun/held.py; guarded itself)
            state.held.hold_batch(batch, step)

    # --- helpers (called from the hooks) ---------------------------------------

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
        self.state.buf.probe(t, site)
        site.shape, site.dtype = t.shape, t.dtype
        setattr(t, PROBED, t._version)  # (not probed again as an input: inline.py)

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
            hooks = self._grad_hooks[id(site)] = GradHooks(self.state, site)
        return hooks
