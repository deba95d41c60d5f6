"""Another offloader beside ours on the same layer: which one moves what.

NOTE [Two offloaders on one layer]
    Saved-tensor hooks nest: the innermost pair packs what is saved.  An offloaded layer
    inside torch's ``save_on_cpu`` pushes our hooks inside its: we move what the layer
    saves, and ``save_on_cpu`` what is saved outside the offloaded layers.  transformers'
    ``activation_checkpointing_enable(offload=True)`` runs the layer's checkpoint inside
    a ``save_on_cpu`` of its own, inside our hooks: the checkpoint's inputs, all the
    layer saves, go through it, and we move nothing.  Either way the result is exact;
    :func:`other_offloader` finds which case a layer is in, for one warning that says so.
"""

from __future__ import annotations

from typing import Any

from ..hooks.autograd_hooks import top_pack_hook

__all__ = ["other_offloader", "other_offloader_warning"]


def _is_save_on_cpu(function: Any) -> bool:
    return getattr(function, "__module__", None) == "torch.autograd.graph" and (
        "save_on_cpu" in getattr(function, "__qualname__", "")
    )


def other_offloader(module: Any) -> str | None:
    """``"outside"``: torch's ``save_on_cpu`` is active around ``module``'s forward (call it
    before our hooks are pushed); ``"inside"``: the module checkpoints its forward with
    transformers' ``offload=True``; else None."""
    if _is_save_on_cpu(top_pack_hook()):
        return "outside"
    function = getattr(module, "_gradient_checkpointing_func", None)
    if function is None or not getattr(module, "gradient_checkpointing", False):
        return None
    code = getattr(getattr(function, "func", function), "__code__", None)
    return "inside" if code is not None and "save_on_cpu" in code.co_names else None


def other_offloader_warning(where: str, module: Any) -> str:
    """The warning for a layer :func:`other_offloader` placed ``where``."""
    name = type(module).__name__
    if where == "outside":
        return (
            f"cpu_offload: offloaded layer {name} runs inside torch.autograd.graph."
            "save_on_cpu: cpu_offload moves what the offloaded layers save (its hooks are "
            "the innermost), and save_on_cpu moves everything else saved inside it (the "
            "layers that are kept, the embedding, the head). Leave save_on_cpu out to keep "
            "those on the device."
        )
    return (
        f"cpu_offload: layer {name} checkpoints its forward with transformers' "
        "activation_checkpointing_enable(offload=True), whose save_on_cpu takes the "
        "checkpoint's inputs (all the layer saves) inside cpu_offload's hooks: "
        "save_on_cpu moves them, at once, and cpu_offload moves nothing for this layer. "
        "Use activation_checkpointing_enable() without offload=True, and offload_layers "
        "moves the checkpoint's inputs on its schedule; or offload=True alone."
    )
