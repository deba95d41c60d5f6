"""Where a compiled layer's offload hooks run: eagerly, around its compiled call.

NOTE [Compiled layers]
    A layer compiled in place (``block.compile(fullgraph=True)``, as torchtitan's
    ``apply_compile`` does) compiles ``nn.Module._call_impl``, its forward hooks
    included; one wrapped by ``torch.compile(block)`` and put back in its list (an
    ``OptimizedModule``) compiles the block's call, hooks included, too.  Our layer
    hooks enter the offload context, which pushes saved-tensor hooks and moves
    tensors between streams: dynamo cannot put that in a graph, so inside a compiled
    call they would be a graph break (an error under ``fullgraph=True``).  Instead
    they do nothing while dynamo traces them, and the layer is entered eagerly
    around its compiled call:

    * a layer compiled in place gets an :class:`EagerEntry` as its
      ``_compiled_call_impl`` (what ``nn.Module.__call__`` calls), around the one
      ``compile()`` made;
    * an ``OptimizedModule`` that wraps a layer in the layers' container gets the
      layer's hooks as its own (they run eagerly: its call is not compiled, its
      ``forward`` is).

    The eager hooks entered around the compiled call see the compiled function's
    saved tensors when it saves them, after its forward graph ran, as they see an
    eager layer's: the graph is the one compiled without offload.  With
    ``offload_layers(..., compiled_copies="graph_ops")`` an offloaded layer's entry
    also pushes graph-module hooks above the eager ones, which AOTAutograd inlines as
    ops into the graphs it compiles (NOTE [Copies as graph ops]), except where it
    cannot (a layer in a checkpoint wrapper, see :meth:`CompiledEntries._entered_around`;
    another filtering mode; an older torch).
    :class:`CompiledEntries` finds such layers when ``offload_layers`` hooks them
    and, for layers compiled afterwards, before each forward of the model.  A whole
    model compiled at once runs its layers inside one graph: the hooks stay out of
    it (no graph break, nothing offloaded).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from ..errors import CpuOffloadError
from .autograd_hooks import pop_saved_tensor_hooks, push_saved_tensor_hooks
from .graph_ops import PACK, UNPACK, available, set_pack_hook
from .handles import offload_hooks_on_top
from .module_hooks import ModuleHook

__all__ = [
    "COMPILED_COPIES",
    "CompiledEntries",
    "EagerEntry",
    "compiled_copies",
    "refusal",
    "untraced",
]

Enter = Callable[[nn.Module, Any], None]
Leave = Callable[[nn.Module, Any, Any], None]


class EagerEntry:
    """A layer's ``_compiled_call_impl`` that enters the layer around the compiled call."""

    def __init__(self, layer: nn.Module, compiled: Any, enter: Enter, leave: Leave) -> None:
        self.layer = weakref.ref(layer)  # the layer holds this: no cycle
        self.compiled = compiled
        self.enter = enter
        self.leave = leave

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        layer = cast(nn.Module, self.layer())  # alive: it calls this
        self.enter(layer, args)
        try:
            output = self.compiled(*args, **kwargs)
        except Exception:
            self.leave(layer, args, None)  # reads sys.exc_info(), as hooks with always_call
            raise
        self.leave(layer, args, output)
        return output


#: the attributes wrappers keep their module in: torch.compile, checkpoint_wrapper
_WRAPPERS = ("_orig_mod", "_checkpoint_wrapped_module")


class _Removable:
    def __init__(self, remove: Callable[[], None]) -> None:
        self.remove = remove


class CompiledEntries:
    """The layers' forward hooks, and each compiled layer entered eagerly around its
    compiled call (NOTE [Compiled layers]).

    Args:
        layers: the layers in order (a module at several positions once per position).
        container: the module that holds them, where ``OptimizedModule`` wrappers are
            looked for; None for a plain list.
        call: per thread, ``entry``: the layer entered around its compiled call now.
        enter, leave: what the layer's forward pre- and post-hook do.
        graph_ops: the copies of offloaded compiled layers as ops inside their graphs
            (``compiled_copies="graph_ops"``, NOTE [Copies as graph ops]); else the
            eager hooks around the compiled call.
    """

    def __init__(
        self,
        layers: list[nn.Module],
        container: nn.Module | None,
        call: Any,
        enter: Enter,
        leave: Leave,
        graph_ops: bool = False,
    ) -> None:
        self.graph_ops = graph_ops
        # Weakly: the layers' hooks hold this, and a model dropped with its handle
        # (without remove()) goes by reference counting.
        self.layers = {id(layer): weakref.ref(layer) for layer in layers}
        self._next = {id(a): weakref.ref(b) for a, b in zip(layers, layers[1:])}
        self._container = None if container is None else weakref.ref(container)
        self.call = call
        self._enter = enter
        self._leave = leave
        self.removers: list[Any] = []
        self._wrapped: set[int] = set()  # ids of the OptimizedModules hooked
        #: ids of the layers that are themselves ``torch.compile`` wrappers (their hooks
        #: run eagerly around the compiled call) of no checkpoint wrapper (see
        #: :meth:`_entered_around`): their graphs take the graph ops
        self._optimized = {
            id(layer)
            for layer in layers
            if "_orig_mod" in layer._modules
            and "_checkpoint_wrapped_module" not in cast(nn.Module, layer._orig_mod)._modules
        }
        #: what compiled layers cannot run with (:func:`refusal`), raised when one is found
        self.refuse: str | None = None

    @property
    def container(self) -> nn.Module | None:
        return None if self._container is None else self._container()

    def pre_hook(self, module: nn.Module, args: Any) -> None:
        """The layers' forward pre-hook: nothing while dynamo traces it, nor inside an
        entry around the compiled call."""
        if not torch.compiler.is_compiling() and self.call.entry is not module:
            if id(module) in self._optimized:
                self._entered_compiled(module, args, None)
            else:
                self.entered(module, args, None)

    def post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.compiler.is_compiling() and self.call.entry is not module:
            if id(module) in self._optimized:
                _pop_graph_ops()
            self._leave(module, args, output)

    def entered(self, module: nn.Module, args: Any, entry: nn.Module | None) -> None:
        """Enter ``module``'s forward (from an entry around its compiled call: ``entry``);
        the next layer, if compiled in place since, gets its entry before its call."""
        self.call.entry = entry
        self._enter(module, args)
        next_ref = self._next.get(id(module))
        following = None if next_ref is None else next_ref()
        if following is not None:
            compiled = following._compiled_call_impl
            if compiled is not None and type(compiled) is not EagerEntry:
                self._wrap_in_place(following, compiled)

    def left(self, module: nn.Module, args: Any, output: Any) -> None:
        self.call.entry = None
        _pop_graph_ops()
        self._leave(module, args, output)

    def _entered_compiled(
        self, layer: nn.Module, args: Any, entry: nn.Module | None = None
    ) -> None:
        """Enter a compiled layer (from an entry around its compiled call: ``entry``);
        when it is offloaded, the graphs compiled for it take its saved tensors through
        the graph ops (NOTE [Copies as graph ops]) to the pack hook it pushed."""
        self.entered(layer, args, entry)
        top = offload_hooks_on_top()
        if top is not None and self.graph_ops and available():
            push_saved_tensor_hooks(PACK, UNPACK)
            set_pack_hook(top[0])

    def watch(self, model: Any) -> None:
        """Attach now, and before each forward of ``model`` (a model, not the list)."""
        self.attach()
        if isinstance(model, nn.Module) and model is not self.container:

            def attach(*_: Any) -> None:
                if not torch.compiler.is_compiling():
                    self.attach()

            self.removers.append(model.register_forward_pre_hook(ModuleHook(attach)))

    def attach(self) -> int:
        """Give the layers compiled since the last call their entries; how many.

        Raises:
            CpuOffloadError: a layer is compiled, and an option refuses it (:attr:`refuse`).
        """
        if self._optimized:  # the layers are torch.compile(block) wrappers themselves
            self._check_allowed()
        found = 0
        for ref in self.layers.values():
            layer = ref()
            if layer is None:
                continue
            compiled = layer._compiled_call_impl
            if compiled is not None and type(compiled) is not EagerEntry:
                self._wrap_in_place(layer, compiled)
                found += 1
        container = self.container
        if container is not None:
            for module in container._modules.values():
                inner = self._wrapped_layer(module)
                if module is None or inner is None:
                    continue
                compiled = module._compiled_call_impl
                if hasattr(module, "_orig_mod"):  # torch.compile(...)'s OptimizedModule
                    if id(module) not in self._wrapped:
                        ops = "_checkpoint_wrapped_module" not in inner._modules
                        self._hook_wrapper(module, inner, ops and module._orig_mod is inner)
                        found += 1
                elif compiled is not None and type(compiled) is not EagerEntry:
                    self._wrap_in_place(module, compiled, inner)
                    found += 1
        return found

    def _wrapped_layer(self, module: nn.Module | None) -> nn.Module | None:
        """The layer that ``module``, in the layers' place in their container, wraps
        (``torch.compile``, a checkpoint wrapper, both), or None."""
        if module is None or id(module) in self.layers:
            return None  # a layer itself
        for _ in range(4):
            module = next(
                (m for a in _WRAPPERS if (m := getattr(module, a, None)) is not None), None
            )
            if module is None or id(module) in self.layers:
                break
        ref = None if module is None else self.layers.get(id(module))
        return None if ref is None else ref()

    def _wrap_in_place(
        self, module: nn.Module, compiled: Any, layer: nn.Module | None = None
    ) -> None:
        """``module`` (``layer`` or a wrapper of it) compiled in place gets an entry."""
        self._check_allowed()
        wrapper = layer is not None or "_checkpoint_wrapped_module" in module._modules
        enter = self._entered_around if wrapper else self._entered_in_place
        entry = EagerEntry(layer or module, compiled, enter, self.left)
        module._compiled_call_impl = entry

        def unwrap() -> None:
            if module._compiled_call_impl is entry:
                module._compiled_call_impl = compiled

        self.removers.append(_Removable(unwrap))

    def _entered_in_place(self, layer: nn.Module, args: Any) -> None:
        self._entered_compiled(layer, args, layer)

    def _entered_around(self, layer: nn.Module, args: Any) -> None:
        """Enter a layer whose wrapper (a checkpoint wrapper) is compiled: with the eager
        hooks around the call (torch 2.13's AOTAutograd fails to inline hooks into the
        graphs of torchtitan's checkpoint-wrapped blocks: "could not find saved tensor
        ... in bw_g_inputs")."""
        self.entered(layer, args, layer)

    def _check_allowed(self) -> None:
        if self.refuse is not None:
            raise CpuOffloadError(self.refuse)

    def _hook_wrapper(self, wrapper: nn.Module, layer: nn.Module, ops: bool) -> None:
        """Hook ``wrapper``, which compiles ``layer`` (directly: ``ops``, else through a
        checkpoint wrapper, see :meth:`_entered_around`)."""
        self._check_allowed()
        self._wrapped.add(id(wrapper))
        enter = self._entered_in_place if ops else self._entered_around

        def pre(module: nn.Module, args: Any) -> None:
            enter(layer, args)

        def post(module: nn.Module, args: Any, output: Any) -> None:
            self.left(layer, args, output)

        self.removers.append(wrapper.register_forward_pre_hook(ModuleHook(pre)))
        self.removers.append(wrapper.register_forward_hook(ModuleHook(post), always_call=True))

    def remove(self) -> None:
        """Put the compiled calls back, unhook the wrappers, and let go of the layers
        (the handle that holds this is held by them no more)."""
        for remover in self.removers:
            remover.remove()
        self.removers.clear()
        self._wrapped.clear()
        self.layers.clear()
        self._next.clear()
        self._container = None


def _pop_graph_ops() -> None:
    """Pop the graph ops' hooks if :meth:`CompiledEntries._entered_compiled` pushed them."""
    if set_pack_hook(None):
        pop_saved_tensor_hooks()


#: what ``offload_layers(compiled_copies=...)`` accepts (NOTE [Copies as graph ops])
COMPILED_COPIES = ("hooks", "graph_ops")


def compiled_copies(options: dict[str, Any]) -> bool:
    """Take ``compiled_copies`` out of ``offload_layers``' options: whether offloaded
    compiled layers hand their saved tensors over through ops inside their graphs.

    Raises:
        ValueError: a value other than ``"hooks"`` (the default) or ``"graph_ops"``.
    """
    value = options.pop("compiled_copies", "hooks")
    if value not in COMPILED_COPIES:
        raise ValueError(
            f"offload_layers: compiled_copies must be 'hooks' (the default: layers compiled "
            f"one by one hand their saved tensors to hooks around the compiled call) or "
            f"'graph_ops' (through ops inside the compiled graphs); got {value!r}."
        )
    return bool(value == "graph_ops")


def refusal(memory_budget: bool, modules: bool, checkpoints: bool) -> str | None:
    """What compiled layers cannot run with: the options whose own hooks run inside the
    layer's call (on its submodules, or around its forward), which dynamo would trace."""
    given = [
        name
        for name, on in (
            ("memory_budget=", memory_budget),
            ("modules=", modules),
            ('policy= with "checkpoint" choices', checkpoints),
        )
        if on
    ]
    if not given:
        return None
    return (
        f"offload_layers: {' and '.join(given)} cannot go with layers compiled one by one "
        "(block.compile() or torch.compile(block)): their hooks run inside the layer's "
        "compiled call, where dynamo cannot trace them (an error under fullgraph=True). "
        'With compiled layers pass k, or policy= of "offload" and "keep"; or leave the '
        "layers uncompiled."
    )


def untraced(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` (a module hook of a skipped module, NOTE [Hooks around compiled code]) that
    does nothing while dynamo traces it: a block compiled with its hooks
    (``block.compile(fullgraph=True)``) gets no graph break from it, and its layer is
    entered around its compiled call instead."""

    def call(*args: Any) -> Any:
        if not torch.compiler.is_compiling():
            return hook(*args)
        return None

    return call
