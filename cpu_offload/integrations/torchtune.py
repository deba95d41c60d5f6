"""torchtune: a drop-in for ``training.get_act_offloading_ctx_manager``.

torchtune's recipes build an activation-offloading context once and enter it around
each forward::

    self.activations_handling_ctx = training.get_act_offloading_ctx_manager(
        model, enable_activation_offloading)
    ...
    with self.activations_handling_ctx:
        logits = self._model(**batch)

:func:`get_act_offloading_ctx_manager` here has the same call and returns a context with
the same use, which offloads the first ``k`` decoder layers (``model.layers``) through
:func:`~cpu_offload.offload_layers` instead of every saved tensor.  Call it where the
recipe does: after ``set_activation_checkpointing`` (so that the hooks go on the
checkpoint wrappers) and after ``compile_model``.  TRL's function of the same name
(``use_pin_memory``, ``use_streams``, ``min_offload_size``, ``max_fwd_stash_size``,
``warn_if_no_head`` as keywords) is served by the same call.

:class:`OffloadActivations` is torchtune's (and TRL's) class of that name, for a whole
forward with no layer list: ``with OffloadActivations(): loss = model(batch)``.  It needs
neither torchtune nor TRL installed.

Example:
    >>> import torch
    >>> from cpu_offload.integrations.torchtune import get_act_offloading_ctx_manager
    >>> model = torch.nn.Module()
    >>> model.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))
    >>> ctx = get_act_offloading_ctx_manager(model, True, num_offloaded_layers=2)
    >>> x = torch.randn(8, 64, requires_grad=True)
    >>> with ctx:
    ...     for layer in model.layers:
    ...         x = layer(x)
    >>> x.sum().backward()
    >>> ctx.handle.offload_synchronizer.stats.forward_passes
    1
    >>> ctx.remove()
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

from torch import nn

from ..chunked import ChunkedOffload
from ..hooks.marking import mark_not_offload
from ..layer_hooks import OffloadLayersHandle, offload_layers
from ..policy.layer_discovery import find_layers
from ..report.step_report import StepReport

__all__ = ["OffloadActivations", "OffloadLayersContext", "get_act_offloading_ctx_manager"]


class OffloadActivations(ChunkedOffload):
    """torchtune's ``training.OffloadActivations`` (TRL's too), on cpu-offload's engine.

    Offloads what the forward inside ``with`` saves, in chunks of ``chunk_bytes`` (see
    :mod:`cpu_offload.chunked`), keeping the last chunk on the device; gradients are
    bit-identical to a run without it.

    Args:
        use_pin_memory: accepted; host buffers are pinned wherever the device supports
            it (an unpinned copy would synchronise the host).
        use_streams: accepted; copies always run on a side stream, ordered by events
            (torchtune's False runs them on the compute stream: slower, no safer).
        max_fwd_stash_size: accepted, no effect: the device memory of a chunk is
            released once its copies are done, ordered by an event, not after a count
            of tensors.
        min_offload_size: saved tensors of fewer bytes stay on the device (1024, as in
            torchtune); mapped to ``min_offload_bytes``.
        chunk_bytes, device, max_host_bytes, retain_pinned_cpu_buffers: as for
            :class:`~cpu_offload.chunked.ChunkedOffload` (by default chunks grow with the
            forward: all but about an eighth of what it saves moves, from the first step).
        keep_passes: refused (``offload_layers``' word): every forward in flight already
            moves all but its last chunk.

    Attributes:
        param_storages: what :meth:`update_model_params` recorded (TRL's attribute).

    Example:
        >>> import torch
        >>> from cpu_offload.integrations.torchtune import OffloadActivations
        >>> model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4)))
        >>> ctx = OffloadActivations()
        >>> with ctx:
        ...     loss = model(torch.randn(64, 256, requires_grad=True)).sum()
        >>> loss.backward()
        >>> print(ctx.offload_synchronizer.stats)
        copied 4 tensors (0.25 MiB) to the host and 4 (0.25 MiB) back in 1 forward passes
    """

    bytes_threshold_name = "min_offload_size"

    def __init__(
        self,
        use_pin_memory: bool = True,
        use_streams: bool = True,
        max_fwd_stash_size: int = 5,
        min_offload_size: int = 1024,
        *,
        chunk_bytes: int | None = None,
        device: Any = None,
        max_host_bytes: int | str | None = None,
        retain_pinned_cpu_buffers: bool = False,
        keep_passes: int | None = None,
    ) -> None:
        if keep_passes is not None:
            raise TypeError(
                f"OffloadActivations: keep_passes={keep_passes!r} is for the per-layer "
                "schedule of offload_layers() and get_cpu_offload_context(); a whole-forward "
                "context already moves every forward in flight but its last chunk. Leave "
                "keep_passes out, or use offload_layers(layers, k, keep_passes=N)."
            )
        for name, flag in (("use_pin_memory", use_pin_memory), ("use_streams", use_streams)):
            if not isinstance(flag, bool):
                raise TypeError(f"OffloadActivations: {name} must be a bool, got {flag!r}.")
        if isinstance(max_fwd_stash_size, bool) or not isinstance(max_fwd_stash_size, int):
            raise TypeError(
                f"OffloadActivations: max_fwd_stash_size must be an int, got "
                f"{max_fwd_stash_size!r}."
            )
        if max_fwd_stash_size < 1:
            raise ValueError(
                f"OffloadActivations: max_fwd_stash_size must be >= 1, got {max_fwd_stash_size}."
            )
        check_threshold(min_offload_size, "OffloadActivations")
        super().__init__(
            chunk_bytes,
            device=device,
            min_offload_bytes=min_offload_size,
            max_host_bytes=max_host_bytes,
            retain_pinned_cpu_buffers=retain_pinned_cpu_buffers,
        )
        self.param_storages: set[int] = set()

    def update_model_params(self, model: nn.Module) -> None:
        """TRL's call: keep ``model``'s parameters and buffers, and every tensor sharing
        their storage, on the device.  Parameters and their views stay anyway; this also
        keeps buffers (RoPE caches, masks, saved in slices by every layer) and records
        the parameters' storages in :attr:`param_storages`."""
        mark_not_offload(*model.parameters(), *model.buffers())
        self.param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}


class OffloadLayersContext:
    """Offloads the layers' activations for the forwards run inside ``with``.

    The hooks stay installed between ``with`` blocks and pass forwards outside them
    through untouched (validation, generation); the backward may run outside.

    Attributes:
        handle: the :class:`~cpu_offload.OffloadLayersHandle` of the layers.
        offload_synchronizer: its synchronizer (``.stats`` count what moved).
    """

    def __init__(self, handle: OffloadLayersHandle) -> None:
        self.handle = handle
        self.offload_synchronizer = handle.offload_synchronizer
        handle.enabled = False

    def __enter__(self) -> OffloadLayersContext:
        self.handle.enabled = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self.handle.enabled = False

    def remove(self) -> None:
        """Remove the hooks from the layers."""
        self.handle.remove()

    def report(self) -> StepReport:
        """What the last step did, per layer (:meth:`OffloadLayersHandle.report`)."""
        return self.handle.report()

    def __repr__(self) -> str:
        return f"OffloadLayersContext({self.handle!r})"


def check_threshold(min_offload_size: object, api: str) -> None:
    """TRL's ``min_offload_size=`` (bytes): an int >= 0, refused in its own name."""
    if isinstance(min_offload_size, bool) or not isinstance(min_offload_size, int):
        raise TypeError(
            f"{api}: min_offload_size must be an int >= 0 (bytes), got {min_offload_size!r}."
        )
    if min_offload_size < 0:
        raise ValueError(
            f"{api}: min_offload_size must be an int >= 0 (bytes), got {min_offload_size!r}."
        )


def get_act_offloading_ctx_manager(
    model: nn.Module,
    enable_activation_offloading: bool = True,
    num_offloaded_layers: int | float | None = None,
    *,
    use_pin_memory: bool = True,
    use_streams: bool = True,
    min_offload_size: int = 1024,
    max_fwd_stash_size: int = 5,
    warn_if_no_head: bool = True,
    memory_budget: int | str | None = None,
    **options: Any,
) -> OffloadLayersContext | contextlib.nullcontext[None]:
    """torchtune's ``training.get_act_offloading_ctx_manager``, offloading ``k`` layers.

    Args:
        model: a torchtune ``TransformerDecoder`` (or any model
            :func:`~cpu_offload.policy.layer_discovery.find_layers` knows).
        enable_activation_offloading: False returns a ``contextlib.nullcontext``.
        num_offloaded_layers: ``k`` layers, or a fraction of them; by default every layer
            but the last (whose activations backward needs first), the nearest to
            torchtune's offloading of everything. Fewer layers leave the copies more
            compute to hide behind.
        use_pin_memory, use_streams, max_fwd_stash_size, warn_if_no_head: TRL's
            keywords, accepted (see :class:`OffloadActivations`; the output head is never
            a decoder layer, so it is never offloaded).
        min_offload_size: saved tensors of fewer bytes stay on the device (1,024 by
            default, as torchtune's and TRL's own contexts do); mapped to
            ``min_offload_bytes``, with ``min_offload_numel=0`` unless that is given.
        memory_budget: instead of ``k``: bytes, a string such as ``"20GiB"``, or
            ``"auto"``; the first forward inside the context (and its backward) is
            measured and the policy chosen from the next (``ctx.handle.plan``;
            docs/planning.md).
        **options: keyword arguments of :func:`~cpu_offload.get_cpu_offload_context`.
    """
    del use_pin_memory, use_streams, max_fwd_stash_size, warn_if_no_head  # see Args
    if not enable_activation_offloading:
        return contextlib.nullcontext()
    # The hosts' threshold in bytes replaces ours in elements, so that the tensors their
    # own contexts move are the ones that move here.
    check_threshold(min_offload_size, "get_act_offloading_ctx_manager")
    options.setdefault("min_offload_bytes", min_offload_size)
    options.setdefault("min_offload_numel", 0)
    if memory_budget is not None:
        if num_offloaded_layers is not None:
            raise TypeError(
                "get_act_offloading_ctx_manager: pass either num_offloaded_layers (k) or "
                "memory_budget=..., not both."
            )
        return OffloadLayersContext(offload_layers(model, memory_budget=memory_budget, **options))
    if num_offloaded_layers is not None:
        return OffloadLayersContext(offload_layers(model, num_offloaded_layers, **options))
    with warnings.catch_warnings():
        # k = L - 1 by default, torchtune's nearest: its "cannot overlap" warning is
        # advice for a k the caller chose, not for this default.
        warnings.filterwarnings("ignore", "cpu_offload: num_layers == model_layers - 1")
        handle = offload_layers(model, len(find_layers(model)) - 1, **options)
    return OffloadLayersContext(handle)
