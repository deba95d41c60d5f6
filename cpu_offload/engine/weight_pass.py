"""A backward in two phases (zero-bubble schedules: ZB-V): the weight gradients' reloads,
prefetched in their order.

NOTE [A backward in two phases]
    Zero-bubble pipeline schedules (``torch.distributed.pipelining``'s
    ``ScheduleZBVZeroBubble``) split a pass's backward in two: ``I``
    (``stage_backward_input``: ``autograd.grad`` to the stage's inputs, with
    ``retain_graph=True``), then later ``W`` (``stage_backward_weight``: a second
    ``autograd.grad``, from the nodes where the weights' paths meet the inputs' path, to
    the weights).  ``W`` unpacks saved tensors again (a linear layer's input, for its
    weight's gradient); it passes no layer output, so the pre-hooks ``sync_fn``
    registers do not see it, and nothing but the unpacks tells where it is.

    ``I`` runs as any backward: each layer is reloaded on its schedule and released as
    backward passes it; the graph is retained, so an offloaded layer's host copy stays
    (``release_all_memory``: ``OFFLOAD_FINISHED``) and what was never moved stays on the
    device with the graph.  As ``I`` ends (the end-of-backward callback of ``sync_fn``'s
    hooks, after ``finish_part_of_bwd``), :func:`arm_second_backward` prepares ``W``,
    the simplest design that keeps the device as it was after ``I`` save one layer, and
    makes no reload wait on demand:

    - the offloaded layers the backward released with the graph alive, and whose part
      of the graph it left partly unrun (below), form a chain, in the order torch's
      ``stage_backward_weight`` unpacks them: it runs one ``autograd.grad`` per group of
      parameters, in the order of ``parameters()``, so from the first layer up.  The
      first one's reload starts now (it waits on the device, with the pass's kept
      layers, for ``W``);
    - the first unpack of a chain layer (its first node of ``W``) releases the chain
      layer unpacked before it (its device tensors; the host copy stays while the graph
      may unpack it) and starts the reload of the next one in the direction ``W`` goes
      (up, until a first unpack below the last one says down): ``W`` at layer ``j``
      holds layers ``j`` and ``j + 1`` of what was offloaded, as a pass moved whole
      holds two layers in its backward, and the reload of ``j + 1`` runs behind the
      weight gradients of ``j``;
    - the last layer of the chain goes with the graph, when ``W`` drops it.

    Only a backward that leaves part of a layer's graph unrun arms it: ``I``'s
    ``autograd.grad`` to the inputs runs the nodes on the inputs' path, not those that
    lead only to the weights (a weight's ``AccumulateGrad``, its ``t()``), which ``W``
    comes for.  A full backward runs them all, so a loop of
    ``backward(retain_graph=True)`` arms nothing and reloads each layer once, for that
    backward; a second full backward, if one comes, passes the layers' outputs and
    reloads on its own schedule, as the first did.  Which tensors the first backward
    left unpacked cannot tell: a node unpacks all its saved tensors when it runs, so
    ``I`` unpacks what only ``W`` needs as well.  So each hook notes the node it sits on
    (``torch._C._current_autograd_node``, in a ``BackwardCall`` that only the running
    backward holds), and as the backward ends (the engine still answers for it), the
    nodes below a chain layer's node, down to the next layer's, are asked
    ``torch._C._will_engine_execute_node``: the layer is armed when one of them does not
    run.  The walk is made only where a chain exists (a retained graph), and a node
    found run with everything below it is not walked again.  Whether a second backward
    will come is not known: a backward to some inputs with the graph retained
    (``autograd.grad(loss, x, retain_graph=True)``, ``backward(inputs=...)``) arms the
    chain, unused where nothing follows it; a layer whose node is not known (a hook run
    outside a node) is armed.

    The manual synchronizer arms nothing: every reload is the controller's
    (TransformerEngine's contract), a second backward's too.

    What ``W`` reloads is each layer's whole host copy (the state machine moves a layer
    at once), also what only ``I`` needed.  Keeping on the device from ``I`` to ``W``
    what only ``W`` needs would need to know which saved tensors ``W`` unpacks, which a
    pack hook cannot; and ``W`` reads most of a transformer layer's activations (every
    linear layer's input), so it would keep most of the pass.  A second full backward
    after ``I`` (not ``W``) runs through the same chain: its own schedule finds the
    first layer already reloading, and the rest as before.  The stage model of
    it is ``plan/pipeline/stage_model.py``'s (NOTE [A stage's passes in flight], NOTE
    [The stage model]).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from .transitions import LayerState

if TYPE_CHECKING:
    from .forward_pass import ForwardPass
    from .layer_state import OffloadableLayerState

__all__ = ["arm_second_backward", "layers_left_unrun", "second_backward_chain"]


def second_backward_chain(forward_pass: ForwardPass) -> list[OffloadableLayerState]:
    """The pass's layers a backward released with the graph alive (host copy held,
    device tensors gone), from the first up: what a second backward reloads."""
    chain = []
    for layer in range(forward_pass.model_layers):
        state = forward_pass.made_state(layer)
        if (
            state is not None
            and state.state is LayerState.OFFLOAD_FINISHED
            and state.backward_done
            and state.holds_data()
        ):
            chain.append(state)
    return chain


def arm_second_backward(forward_pass: ForwardPass, reached: Mapping[int, Any]) -> None:
    """A backward of ``forward_pass`` ended with its graph retained: start the reload of
    the first layer a second backward (ZB-V's ``W``) needs and chain the others to the
    first unpacks (NOTE [A backward in two phases]).  ``reached``: per layer, the node
    where this backward reached it (None: not known)."""
    chain = second_backward_chain(forward_pass)
    if chain:
        unrun = layers_left_unrun(reached)
        chain = [state for state in chain if state.layer_index in unrun]
    if not chain:
        return
    chain[0].start_reload()
    walk = _Walk(chain)
    for position, state in enumerate(chain):
        state.on_first_pop = walk.callback(position, state.on_first_pop)


def layers_left_unrun(reached: Mapping[int, Any]) -> set[int]:
    """Of the layers the running backward reached (``reached``: layer -> the node where
    it did), those whose part of the graph it leaves partly unrun: the nodes below the
    layer's, down to another layer's, include one it does not run (a weight's, in an
    ``autograd.grad`` to the inputs).  A layer whose node is not known counts as such."""
    bounds = {node for node in reached.values() if node is not None}
    clean: set[Any] = set()  # nodes whose nodes below, down to the bounds, all run
    unrun = set()
    for layer, node in sorted(reached.items(), reverse=True):
        if node is None or _unrun_below(node, bounds, clean):
            unrun.add(layer)
    return unrun


def _unrun_below(top: Any, bounds: set[Any], clean: set[Any]) -> bool:
    seen = {top}
    stack = [top]
    while stack:
        for below, _ in stack.pop().next_functions:
            if below is None or below in seen or below in bounds or below in clean:
                continue
            if not _runs(below):
                return True
            seen.add(below)
            stack.append(below)
    clean.update(seen)
    return False


def _runs(node: Any) -> bool:
    """Whether the running backward runs ``node``."""
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:  # a leaf whose gradient an autograd.grad captures: it is computed
        return True


class _Walk:
    """A second backward's way along the chain (NOTE [A backward in two phases])."""

    def __init__(self, chain: list[OffloadableLayerState]) -> None:
        self.chain = chain
        self.last: int | None = None  # the chain layer unpacked last

    def callback(self, position: int, before: Callable[[], None] | None) -> Callable[[], None]:
        def first_pop() -> None:
            if before is not None:
                before()
            self.reached(position)

        return first_pop

    def reached(self, position: int) -> None:
        """The first unpack of the chain's ``position``-th layer: release the one
        unpacked before, reload the next one on the way."""
        chain, last = self.chain, self.last
        step = 1 if last is None or position > last else -1
        if last is not None and chain[last].state is not LayerState.NOT_OFFLOADED:
            chain[last].release_all_memory()
        self.last = position
        following = position + step
        if 0 <= following < len(chain) and chain[following].state is LayerState.OFFLOAD_FINISHED:
            chain[following].start_reload()
