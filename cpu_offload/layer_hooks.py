"""``offload_layers``: offload a list of modules with forward hooks, in one line."""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .context import get_cpu_offload_context
from .engine.layer_context import OffloadContext
from .engine.schedule import max_offloaded, resolve_count
from .errors import CpuOffloadError
from .hooks.autograd_hooks import checkpoint_forward_active, forward_inside_backward
from .hooks.compiled_entry import CompiledEntries, compiled_copies, refusal
from .hooks.marking import mark_not_offload
from .hooks.module_hooks import ModuleHook, call_running, layer_hook_owner
from .log import logger, warn
from .policy.checkpointing import checkpoint_forward
from .policy.handle_summary import found_layers, schedule_of
from .policy.layer_discovery import locate_layer_container, primary_tensor
from .policy.module_choices import ModuleChoices, resolve_modules
from .policy.policy import OFFLOADED, check_policy, checkpointed_modules, warn_checkpoint_hazards
from .policy.reentrant_checkpoint import watch_reentrant_checkpoints
from .report.step_report import StepReport

if TYPE_CHECKING:
    from .plan.auto_policy import AutoPolicy
    from .plan.policy_plan import PolicyPlan

__all__ = ["OffloadLayersHandle", "offload_layers"]


class _LayerCall(threading.local):
    """Per thread: the module (weakly) whose forward is inside the context."""

    module: weakref.ref[nn.Module] | None = None
    entry: nn.Module | None = None  # a compiled layer entered around its compiled call


class OffloadLayersHandle:
    """What :func:`offload_layers` returns.

    Attributes:
        context: the offload context entered around each layer.
        sync_fn: the sync function applied to each layer's output.
        offload_synchronizer: the synchronizer in use.
        controller: the manual controller with ``manual_synchronization=True``, else None.
        enabled: while False, the layers' forwards pass through the hooks untouched
            (nothing is offloaded, nothing checkpointed); a forward pass must not span
            a change.
        forwards_seen: the layer forwards the hooks have seen while enabled.
        auto: with ``memory_budget=``, the :class:`~cpu_offload.plan.auto_policy.AutoPolicy`
            that measures, chooses and watches the policy (else None).
        found: the layers and where (``"4 LlamaDecoderLayer at model.layers"``).
        policy, k: each layer's choice, and the ``k`` it came from (None: a policy);
            None under manual synchronization and ``memory_budget=`` (:attr:`plan`).
    """

    def __init__(self, context: OffloadContext, sync_fn: Any, controller: Any) -> None:
        self.context, self.sync_fn, self.controller = context, sync_fn, controller
        self.offload_synchronizer = context.offload_synchronizer
        self.enabled, self.forwards_seen, self.found = True, 0, ""
        self.policy: list[str] | None = None
        self.k: int | None = None
        self._hooks: list[Any] = []
        self._watchers: list[Any] = []  # gradient hooks waiting for the first forward
        self._warned_checkpoint = False
        self._call = _LayerCall()
        self.auto: AutoPolicy | None = None
        self.modules: ModuleChoices | None = None  # modules=: the choices per submodule
        self._compiled: CompiledEntries | None = None

    @property
    def plan(self) -> PolicyPlan | None:
        """With ``memory_budget=``, the policy in force (it prints as a table); None until
        the measuring step is over, and without a budget."""
        return self.auto.plan if self.auto is not None else None

    def report(self) -> StepReport:
        """The last step (NOTE [What a step is] in step_report.py), per layer: tensors saved,
        moved and kept (and why), recomputes, memory; ``print()`` it, or ``to_dict()``."""
        return self.offload_synchronizer.report(self.policy)

    def __repr__(self) -> str:
        sync = self.offload_synchronizer
        schedule = schedule_of(self.policy, self.k, self.auto, sync.keep_passes)
        return (
            f"OffloadLayersHandle({self.found}; {schedule}; "
            f"{'' if self.modules is None else f'modules={self.modules.given!r}; '}"
            f"{sync.thresholds()}; "
            f"device {sync.backend.device}{'' if self._hooks else '; removed'})"
        )

    def remove(self) -> None:
        """Remove the hooks: the modules behave as before.

        A layer forward that a ``KeyboardInterrupt`` (or another ``BaseException``)
        stopped left the context entered in this thread; it is left here too.
        """
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._stop_watching()
        if self.auto is not None:
            self.auto.remove()
        if self.modules is not None:
            self.modules.remove()
        self._leave_interrupted()

    def _leave_interrupted(self) -> None:
        """Leave the context that a forward stopped by a ``BaseException`` left entered
        (forward hooks with ``always_call`` run on ``Exception`` only)."""
        self._call.module = None
        if self.modules is not None:
            self.modules.unwind()
        if not self.context.leave_interrupted():
            raise CpuOffloadError(
                "cpu_offload: a forward of an offloaded layer was interrupted (a "
                "KeyboardInterrupt or another BaseException) and other saved-tensor hooks "
                "were entered after it and are still active, so the offload hooks under them "
                "cannot be removed. Leave those hooks' context first."
            )

    def _enter_call(self, module: nn.Module) -> None:
        """Note the module call now entering the context; first leave a context that an
        interrupted forward left entered (a call that is not running any more: NOTE
        [Interrupted layer calls])."""
        call = self._call
        if self.context.active and not call_running(call.module() if call.module else None):
            self._leave_interrupted()
        call.module = weakref.ref(module)

    def _stop_watching(self) -> None:
        for hook in self._watchers:
            hook.remove()
        self._watchers.clear()

    def _watch_for_missed_forwards(self, layers: list[nn.Module]) -> None:
        """Warn if a backward reaches the layers before a forward went through the hooks."""

        def check(param: torch.Tensor) -> None:
            if self.forwards_seen == 0 and self._watchers:
                self._stop_watching()
                if self._compiled is not None and self._compiled.attach():
                    return  # layers compiled in place since, entered from the next step
                warn(
                    "cpu_offload: a backward reached the parameters of the offloaded layers, but "
                    "no forward since offload_layers() went through its hooks, so nothing was "
                    "offloaded. The usual cause is torch.compile: a model compiled as a whole "
                    "runs its layers inside one graph, without the hooks. Compile the layers "
                    "one by one instead (block.compile(), or torch.compile(block) put back in "
                    "its list), and pass offload_layers() the model, or call it after."
                )

        for layer in layers:
            param = next((p for p in layer.parameters() if p.requires_grad), None)
            if param is not None:
                self._watchers.append(param.register_post_accumulate_grad_hook(check))

    def _warn_inside_checkpoint(self, layer: nn.Module) -> None:
        self._warned_checkpoint = True
        if getattr(layer, "gradient_checkpointing", False):
            advice = (
                "This layer checkpoints its whole call, hooks included (Hugging Face "
                "gradient checkpointing before transformers 5): upgrade transformers, or use "
                "gradient checkpointing or offload_layers for these layers, not both."
            )
        else:
            advice = (
                "Wrap the layers for checkpointing first (torchtune's "
                "set_activation_checkpointing, apply_activation_checkpointing), then call "
                "offload_layers, so that its hooks go on the checkpoint wrappers and the "
                "checkpoint's inputs are offloaded."
            )
        warn(
            f"cpu_offload: offloaded layer {type(layer).__name__} runs inside activation "
            "checkpointing (torch.utils.checkpoint): only the checkpoint's inputs are saved "
            "for backward, outside the hooks, so this layer offloads nothing. " + advice,
            UserWarning,
            stacklevel=3,
        )

    def __enter__(self) -> OffloadLayersHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def check_options(options: dict[str, Any]) -> bool:
    """Whether ``compiled_copies`` asks for graph ops (taken out); other keywords: those of
    ``get_cpu_offload_context`` not set here, and ``copy_bandwidth``; another is refused."""
    graph_ops = compiled_copies(options)
    taken = ("enabled", "num_layers", "model_layers")
    known = [n for n in inspect.signature(get_cpu_offload_context).parameters if n not in taken]
    unknown = [name for name in options if name not in known and name != "copy_bandwidth"]
    if unknown:
        raise TypeError(
            f"offload_layers() got an unexpected keyword argument {unknown[0]!r}; it takes "
            "num_offloaded_layers (k), policy=, memory_budget=, modules=, copy_bandwidth=, "
            f"compiled_copies= and these keywords of get_cpu_offload_context(): {', '.join(known)}."
        )
    return graph_ops


def offload_layers(
    model: nn.Module | Sequence[nn.Module],
    num_offloaded_layers: int | float | None = None,
    *,
    policy: Sequence[str] | None = None,
    memory_budget: int | str | None = None,
    modules: Mapping[str, str] | Sequence[str] | None = None,
    **options: Any,
) -> OffloadLayersHandle:
    """Offload the activations of the first ``num_offloaded_layers`` decoder layers, apply
    a per-layer ``policy``, or choose one for a ``memory_budget``.

    Each module's forward runs inside the offload context (forward pre- and post-hooks)
    and its output goes through ``sync_fn``, whether it returns a tensor, a tuple or a
    model-output object (the first tensor is the one passed on). Layers run in order,
    as in a decoder stack; a module may appear several times (shared weights), a
    layer may be skipped (LayerDrop), and a forward that starts over at the first
    layer (after an interrupted step) starts a new pass.

    The buffers of ``model`` (and of the layers) are marked not to be offloaded: RoPE
    caches and masks live anyway, and slices of them are saved in every layer.
    Parameters are never offloaded.  Call this after moving the model to its device.

    Args:
        model: a model whose decoder layers :func:`find_layers` finds (Hugging Face,
            peft, torchtune, Megatron-Core), or the layers themselves.
        num_offloaded_layers: ``k``, ``0 <= k <= L - 1``; or a fraction in ``[0, 1)``
            of the ``L`` layers, rounded down.
        policy: instead of ``k``, one choice per layer: ``"keep"``, ``"offload"``,
            ``"checkpoint"`` (non-reentrant recomputation: only the layer's inputs stay
            saved) or ``"checkpoint+offload"`` (those inputs go to the host too); the
            last layer is not offloaded.  ``python -m cpu_offload.plan --memory-budget``
            chooses one.  ``handle.remove()`` also undoes the checkpointing.
        memory_budget: instead, the device memory the saved activations of a step may
            take: bytes, a string such as ``"20GiB"``, or ``"auto"`` (the free memory
            less 10%).  The first step runs as the model does and is measured; from the
            next, the fastest policy predicted to fit is applied (``handle.plan``; one
            line printed).  See docs/planning.md; ``copy_bandwidth=`` (bytes per second,
            or a ``python -m cpu_offload.check --json`` file) skips measuring the link.
        modules: with any of the three, ``{name: "offload" | "keep"}`` (and ``"rest"``)
            or a list of names to offload: choices per submodule within each offloaded
            layer (``module_choices.py``; docs/usage.md, "Choices per submodule").
        **options: keyword arguments of :func:`get_cpu_offload_context`
            (``retain_pinned_cpu_buffers``, ``device``, ``min_offload_numel``,
            ``manual_synchronization``, ``offload_stream``); ``compiled_copies="graph_ops"``
            copies compiled layers' tensors through ops in their graphs (docs/integrations.md).

    Returns:
        A handle; ``handle.remove()`` restores the modules.

    Example:
        >>> import torch
        >>> from cpu_offload import offload_layers
        >>> layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))
        >>> handle = offload_layers(layers, 2, min_offload_numel=0)
        >>> x = torch.randn(8, 64, requires_grad=True)
        >>> for layer in layers:
        ...     x = layer(x)
        >>> x.sum().backward()
        >>> handle.offload_synchronizer.stats.tensors_offloaded
        2
        >>> handle.remove()
    """
    graph_ops = check_options(options)
    layers, where, container = locate_layer_container(model)
    manual = bool(options.get("manual_synchronization", False))
    owner = type(model).__name__
    _check_arguments(layers, owner, num_offloaded_layers, policy, memory_budget, options)
    per_layer = resolve_modules(layers, modules) if modules is not None else None
    checkpointed: list[nn.Module] = []
    chosen: list[str] = []  # with policy=
    count, auto = 0, None
    if memory_budget is not None:
        from .plan.auto_policy import modules_budget_context  # the planner, when it is asked for

        context, auto = modules_budget_context(model, layers, memory_budget, **options)
        result: tuple[Any, ...] = (context, context.sync_fn)
    elif policy is not None:
        if manual:
            raise ValueError(
                "offload_layers: policy= schedules the offloaded layers itself; it does not "
                "combine with manual_synchronization=True."
            )
        chosen = check_policy(policy, len(layers), owner)  # the last-layer rule included
        options["offloaded_layers"] = [i for i, c in enumerate(chosen) if c in OFFLOADED]
        checkpointed = checkpointed_modules(layers, chosen, owner)
        count = len(options["offloaded_layers"])
    if policy is None and memory_budget is None:
        count = resolve_count(num_offloaded_layers, len(layers))  # type: ignore[arg-type]
        if not manual and not 0 <= count <= max_offloaded(len(layers)):
            raise ValueError(
                f"offload_layers: k={num_offloaded_layers!r} but {len(layers)} layers were "
                f"found (in {owner}); k must be an int in 0..{max_offloaded(len(layers))} "
                "(the last layer is never offloaded) or a fraction in [0, 1)."
            )
    if auto is None:
        result = get_cpu_offload_context(True, count, len(layers), **options)
    owners = [model] if isinstance(model, nn.Module) else []
    mark_not_offload(*{id(b): b for m in owners + layers for b in m.buffers()}.values())
    context, sync_fn = result[0], result[1]
    handle = OffloadLayersHandle(context, sync_fn, result[2] if manual else None)
    handle.auto = auto
    synchronizer = context.offload_synchronizer
    handle.found = found_layers(layers, where, owner)
    if not manual:  # the hooks call the sync function: a reload on demand has other causes
        synchronizer.reload_advice = synchronizer.hooked_reload_advice
    if not manual and auto is None:
        handle.policy = chosen or ["offload" if i < count else "keep" for i in range(len(layers))]
        handle.k = None if policy is not None else count
    positions: dict[int, list[int]] = {}  # module id -> its positions in the list
    for position, layer in enumerate(layers):
        positions.setdefault(id(layer), []).append(position)
    enter, leave = _forward_hooks(handle, len(layers), positions, count)
    compiled = CompiledEntries(layers, container, handle._call, enter, leave, graph_ops)
    handle._compiled = compiled
    compiled.refuse = refusal(memory_budget is not None, modules is not None, bool(checkpointed))
    compiled.watch(model)  # the layers compiled already (or refused), and those compiled later
    handle._hooks.append(compiled)
    unique = list({id(layer): layer for layer in layers}.values())  # a shared module once
    pre_hook, post_hook = ModuleHook(compiled.pre_hook, handle), ModuleHook(compiled.post_hook)
    for layer in unique:
        handle._hooks.append(layer.register_forward_pre_hook(pre_hook))
        handle._hooks.append(layer.register_forward_hook(post_hook, always_call=True))
    warned: set[str] = set()  # once per handle (NOTE [Checkpoint inside the offload context])
    for m in checkpointed:
        noted = functools.partial(synchronizer.note_recompute, *positions[id(m)])
        request = checkpoint_forward(m, lambda: handle.enabled, positions[id(m)][0], warned, noted)
        handle._hooks.append(request)
    if checkpointed:
        warn_checkpoint_hazards(layers, chosen)
    if per_layer is not None:  # after the layer hooks (NOTE [Choices finer than a layer])
        handle.modules = ModuleChoices(layers, *per_layer, chosen, given=modules)
    if count > 0 or auto is not None:
        handle._watch_for_missed_forwards(unique)
        handle._hooks += watch_reentrant_checkpoints(unique, handle.context)
    if auto is not None:
        auto.attach(lambda: handle.enabled)  # after the hooks above: its pre-hook runs last
    logger.info("offload_layers: %r", handle)
    return handle


def _check_arguments(
    layers: list[nn.Module],
    owner: str,
    num_offloaded_layers: int | float | None,
    policy: Sequence[str] | None,
    memory_budget: int | str | None,
    options: dict[str, Any],
) -> None:
    """``offload_layers``' arguments that cannot go together, or choose nothing."""
    given = [x for x in (num_offloaded_layers, policy, memory_budget) if x is not None]
    if len(given) != 1:
        raise TypeError(
            "offload_layers: pass either num_offloaded_layers (k) or policy=[...] or "
            f"memory_budget=..., {'not both' if given else 'got neither'}."
        )
    if not layers:
        raise ValueError(
            f"offload_layers: {owner} holds no layers, so there is nothing to offload; pass "
            "the model's decoder layers (a non-empty list or ModuleList)."
        )
    for index, layer in enumerate(layers):
        earlier = layer_hook_owner(layer)
        if earlier is not None:
            raise RuntimeError(
                f"offload_layers: layer {index} ({type(layer).__name__}) is already hooked by "
                f"an earlier offload_layers call, {earlier!r}; a second set of hooks would "
                "leave that handle moving nothing. Call handle.remove() on the earlier "
                "handle first, or keep using it."
            )
    if "offloaded_layers" in options:
        chooser = "policy=[...]" if policy is not None else f"k={num_offloaded_layers!r}"
        chooser = "memory_budget=..." if memory_budget is not None else chooser
        raise TypeError(
            f"offload_layers: offloaded_layers= and {chooser} both choose the layers to "
            "offload; pass one: policy=[...] with 'offload' (or 'checkpoint+offload') at "
            "the layers to offload, and 'keep' elsewhere."
        )
    if "copy_bandwidth" in options and memory_budget is None:
        raise TypeError(
            "offload_layers: copy_bandwidth= is the link the memory_budget= plan assumes; "
            "pass it with memory_budget=..., or leave it out."
        )


def _forward_hooks(
    handle: OffloadLayersHandle, num_layers: int, positions: dict[int, list[int]], count: int
) -> tuple[Any, Any]:
    """What the forward pre- and post-hook of every layer do: enter the layer in the context (a
    skipped layer, or a forward started over, said so), leave it and pass its output's
    first tensor through ``sync_fn``."""
    context, sync_fn = handle.context, handle.sync_fn
    synchronizer = handle.offload_synchronizer

    def enter(module: nn.Module, args: Any) -> None:
        if not handle.enabled:
            return
        handle.forwards_seen += 1
        if handle._watchers:
            handle._stop_watching()
        if (
            count > 0
            and not handle._warned_checkpoint  # once per handle; nothing to check after
            and torch.is_grad_enabled()
            and checkpoint_forward_active()
            and not forward_inside_backward()
            and synchronizer.layer_is_offloaded(positions[id(module)][0])
        ):
            handle._warn_inside_checkpoint(module)
        current = synchronizer.current_pass
        expected = current.layers_forwarded if current is not None else 0
        if expected >= num_layers:
            expected = 0
        mine = positions[id(module)]
        handle._enter_call(module)
        if expected in mine:
            context.enter_layer()
        elif mine[0] > expected:
            # Layers before this one did not run (LayerDrop, a skipped block).
            context.enter_layer(skipped=mine[0] - expected)
        else:
            # An earlier layer runs again: the forward in progress was left behind.
            context.enter_layer(skipped=mine[0], new_pass=True)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if not context.active:
            return
        handle._call.module = None
        exc_type, exc, traceback = sys.exc_info()
        if exc_type is not None:  # forward raised; always_call hooks run in its except
            context.__exit__(exc_type, exc, traceback)
            return
        context.__exit__(None, None, None)
        primary = primary_tensor(output)
        if primary is not None:
            sync_fn(primary)

    return enter, leave
