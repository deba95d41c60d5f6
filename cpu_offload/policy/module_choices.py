"""Choices finer than a layer: ``offload_layers(model, ..., modules={...})``.

Within each layer that offloads its saved tensors, the tensors saved while a named
submodule's forward runs follow that submodule's own choice, ``"offload"`` or
``"keep"``; those saved anywhere else in the layer follow the ``"rest"`` choice
(``"offload"`` unless given).  A name is Megatron-Core's (``--offload-modules``:
:data:`MEGATRON_MODULES`, found in the layouts of Hugging Face Llama and Mixtral,
torchtune and Megatron-Core layers) or a submodule path relative to the layer
(``"self_attn.q_proj"``).  A list of names is Megatron's vocabulary: those offload,
the rest of the layer keeps.

NOTE [Choices finer than a layer] (in selective_checkpoint.py) is how this works: a
named submodule's forward pre-hook pushes saved-tensor hooks of its own above the
layer's, with the offload context's unpack hook: for ``"offload"`` the layer state's
own pack hook, for ``"keep"`` a :class:`KeepPack` that keeps the tensor on the device
(a handle of the layer, with the version check at unpack).  Its forward hook pops
them.  They are pushed only where the innermost hooks are an offload context's: in a
layer that is not offloaded (``"keep"``, the last layer), under a checkpoint (its
hooks are innermost, or the layer's choice checkpoints it) and in a recompute,
nothing is pushed.  Without ``modules=`` no hook is installed: the pack hook's path
is the same as before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..hooks.autograd_hooks import pop_saved_tensor_hooks, push_saved_tensor_hooks
from ..hooks.handles import offload_hooks_on_top, unpack_saved, verbatim
from ..hooks.module_hooks import ModuleHook
from .checkpointing import CheckpointedForward

__all__ = [
    "CHOICES",
    "KEEP",
    "MEGATRON_MODULES",
    "OFFLOAD",
    "REST",
    "KeepPack",
    "ModuleChoices",
    "Place",
    "choice_of",
    "resolve_modules",
]

KEEP, OFFLOAD = "keep", "offload"
CHOICES = (OFFLOAD, KEEP)
#: the key of ``modules=`` for the tensors saved outside every named submodule
REST = "rest"


@dataclass(frozen=True)
class Place:
    """Where a Megatron module name is in one layer layout.

    Attributes:
        paths: the submodules (relative to the layer) the name stands for.
        excluding: submodules inside them that are not part of it (they follow the
            choice of what surrounds the name).
        layout: whose layout this is (for messages and docs).
    """

    paths: tuple[str, ...]
    excluding: tuple[str, ...] = ()
    layout: str = ""


_HF, _TT, _MC = "Hugging Face Llama, Mixtral", "torchtune", "Megatron-Core"
_OURS = "cpu_offload.models (the planner's presets)"
_HF_PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_TT_PROJ = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.output_proj")

#: Megatron-Core's ``--offload-modules`` names, and where each is in the layouts known;
#: a name whose places are all missing from a layer does not exist in it
MEGATRON_MODULES: dict[str, tuple[Place, ...]] = {
    "attn_norm": (Place(("input_layernorm",), (), f"{_HF}; {_MC}"), Place(("sa_norm",), (), _TT)),
    "qkv_linear": (
        Place(_HF_PROJ[:3], (), _HF),
        Place(_TT_PROJ[:3], (), _TT),
        Place(("self_attention.linear_qkv",), (), _MC),
        Place(("q", "k", "v"), (), _OURS),
    ),
    "core_attn": (
        Place(("self_attn",), _HF_PROJ, _HF),
        Place(("attn",), _TT_PROJ, _TT),
        Place(("self_attention.core_attention",), (), _MC),
    ),
    "attn_proj": (
        Place(_HF_PROJ[3:], (), _HF),
        Place(_TT_PROJ[3:], (), _TT),
        Place(("self_attention.linear_proj",), (), _MC),
        Place(("out",), (), _OURS),
    ),
    "mlp_norm": (
        Place(("post_attention_layernorm",), (), _HF),
        Place(("mlp_norm",), (), _TT),
        Place(("pre_mlp_layernorm",), (), _MC),
    ),
    "expert_fc1": (Place(("mlp.experts.linear_fc1",), (), _MC),),
    "moe_act": (Place(("mlp.experts.act_fn",), (), "Hugging Face Mixtral"),),
}


def _check_modules(modules: object, api: str) -> tuple[dict[str, str], str]:
    """``modules=`` as ``({name: choice}, rest choice)``."""
    if isinstance(modules, Mapping):
        given = dict(modules)
        rest = given.pop(REST, OFFLOAD)
    elif isinstance(modules, (list, tuple, set, frozenset)):
        given, rest = {name: OFFLOAD for name in modules}, KEEP
    else:
        raise TypeError(
            f"{api}: modules= must be a dict {{name: 'offload' or 'keep'}} or a list of names "
            f"to offload (Megatron's --offload-modules), got {type(modules).__name__}."
        )
    for name, choice in [*given.items(), (REST, rest)]:
        if not isinstance(name, str) or choice not in CHOICES:
            raise ValueError(
                f"{api}: modules= maps submodule names to 'offload' or 'keep', got "
                f"{name!r}: {choice!r}."
            )
    if not given:
        raise ValueError(f"{api}: modules= names no submodule; leave it out instead.")
    return given, rest


def _find(layer: nn.Module, path: str) -> nn.Module | None:
    try:
        found = layer.get_submodule(path)
    except AttributeError:
        return None
    return found if found is not layer else None


def _place_in(layer: nn.Module, name: str) -> tuple[list[nn.Module], list[nn.Module]] | None:
    """The submodules ``name`` stands for in ``layer`` and those it excludes, or None."""
    for place in MEGATRON_MODULES.get(name, ()):
        found = [m for m in (_find(layer, path) for path in place.paths) if m is not None]
        if len(found) == len(place.paths):
            excluded = [_find(layer, path) for path in place.excluding]
            return found, [m for m in excluded if m is not None]
    found_path = _find(layer, name)  # a path (a layer may use Megatron's names itself)
    return ([found_path], []) if found_path is not None else None


def names_in(layer: nn.Module) -> list[str]:
    """What ``modules=`` can name in ``layer``: Megatron names found, then paths."""
    megatron = [name for name in MEGATRON_MODULES if _place_in(layer, name) is not None]
    return list(dict.fromkeys(megatron + [path for path, _ in layer.named_modules() if path]))


def resolve_modules(
    layers: Sequence[nn.Module], modules: object, api: str = "offload_layers"
) -> tuple[list[dict[nn.Module, str]], str]:
    """Each layer's ``{submodule: choice}`` for ``modules=``, and the rest's choice.

    Names are looked up in every layer; one found in none raises a ``ValueError``
    listing what the first layer has.  Where two names reach one submodule, the one
    given later wins; a submodule a Megatron name excludes (``core_attn`` is the
    attention without its projections) follows the rest, unless named itself.
    """
    given, rest = _check_modules(modules, api)
    per_layer: list[dict[nn.Module, str]] = []
    found_anywhere: set[str] = set()
    for layer in layers:
        excluded: dict[nn.Module, str] = {}
        choices: dict[nn.Module, str] = {}
        for name, choice in given.items():
            place = _place_in(layer, name)
            if place is None:
                continue
            found_anywhere.add(name)
            for module in place[0]:
                choices[module] = choice
            for module in place[1]:
                excluded[module] = rest
        per_layer.append(excluded | choices)
    missing = [name for name in given if name not in found_anywhere]
    if missing:
        available = names_in(layers[0])
        shown = ", ".join(available[:40]) + (", ..." if len(available) > 40 else "")
        raise ValueError(
            f"{api}: modules= names {', '.join(repr(n) for n in missing)}, which "
            f"{type(layers[0]).__name__} (the layers) does not have. It has: {shown}. Use "
            f"Megatron's names ({', '.join(MEGATRON_MODULES)}) where the layer's layout has "
            "them, or a submodule path relative to the layer."
        )
    return per_layer, rest


def choice_of(enclosing: Iterable[nn.Module], choices: Mapping[nn.Module, str], rest: str) -> str:
    """The choice of a tensor saved while ``enclosing`` (innermost last) were running."""
    for module in reversed(list(enclosing)):
        if module in choices:
            return choices[module]
    return rest


class KeepPack:
    """A pack hook that keeps every tensor on the device, counted by the layer state whose
    pack hook ``offload`` is (its ``keep_tensor``; NOTE [Choices finer than a layer])."""

    __slots__ = ("offload", "keep")

    def __init__(self, offload: Callable[[Any], Any], keep: Callable[[Any], Any]) -> None:
        self.offload = offload
        self.keep = keep

    def __call__(self, tensor: Any) -> Any:
        return self.keep(tensor) if isinstance(tensor, torch.Tensor) else verbatim(tensor)


class _Pushed(threading.local):
    """Per thread: for each named submodule call in progress, whether it pushed hooks."""

    def __init__(self) -> None:
        self.stack: list[bool] = []


def _checkpoints_now(module: nn.Module) -> bool:
    """Whether ``module``'s call checkpoints its forward (a policy's wrapper, enabled)."""
    wrapper = module.__dict__.get("forward")
    return isinstance(wrapper, CheckpointedForward) and wrapper.checkpoints_now()


class ModuleChoices:
    """The hooks that apply ``modules=`` to a handle's layers; :meth:`remove` removes them.

    Args:
        layers: the layers whose submodules are named (each once).
        per_layer: :func:`resolve_modules`'s choices, one dict per layer.
        rest: the choice of what is saved outside the named submodules.
        policy: the layers' policy, if one was given: only its ``"offload"`` layers are
            refined (a checkpointed layer's inputs follow its choice).
        given: ``modules=`` as the user gave it, for the handle's ``repr``.
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        per_layer: Sequence[dict[nn.Module, str]],
        rest: str,
        policy: Sequence[str] = (),
        given: object = None,
    ) -> None:
        self.rest, self.given = rest, given
        self._pushed = _Pushed()
        self._hooks: list[Any] = []
        done: set[int] = set()
        for position, (layer, choices) in enumerate(zip(layers, per_layer)):
            if id(layer) in done or (policy and policy[position] != OFFLOAD):
                continue
            done.add(id(layer))
            if rest == KEEP:
                self._hook(layer, KEEP, prepend_leave=True)
            for module, choice in choices.items():
                self._hook(module, choice)

    def _hook(self, module: nn.Module, choice: str, prepend_leave: bool = False) -> None:
        def enter(module: nn.Module, args: Any) -> None:
            self._pushed.stack.append(self._push(choice, module if prepend_leave else None))

        def leave(module: nn.Module, args: Any, output: Any) -> None:
            stack = self._pushed.stack
            if stack and stack.pop():
                pop_saved_tensor_hooks()

        self._hooks.append(
            module.register_forward_pre_hook(ModuleHook(torch.compiler.disable(enter)))
        )
        self._hooks.append(
            module.register_forward_hook(
                ModuleHook(torch.compiler.disable(leave)), always_call=True, prepend=prepend_leave
            )
        )

    @staticmethod
    def _push(choice: str, layer: nn.Module | None) -> bool:
        """Push the hooks of ``choice`` where the offload context's are innermost."""
        top = offload_hooks_on_top()
        if top is None:
            return False  # not offloaded, under a checkpoint, recomputing
        if layer is not None and _checkpoints_now(layer):
            return False  # the layer's choice checkpoints it: its inputs follow that
        pack = top[0]
        offload = pack.offload if type(pack) is KeepPack else pack
        keep = getattr(getattr(offload, "__self__", None), "keep_tensor", None)
        if keep is None:
            return False  # not a layer state's hooks (a whole-forward context's)
        push_saved_tensor_hooks(
            KeepPack(offload, keep) if choice == KEEP else offload, unpack_saved
        )
        return True

    def unwind(self) -> None:
        """Pop what this thread's named calls pushed and a ``BaseException`` left there
        (forward hooks run on ``Exception`` only: NOTE [Interrupted layer calls])."""
        stack = self._pushed.stack
        while stack:
            if stack.pop():
                pop_saved_tensor_hooks()

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
