"""The per-layer state machine: legal and illegal transitions, round trips."""

from __future__ import annotations

import pytest
import torch

from cpu_offload import LayerState, OffloadableLayerState, OffloadStateError
from cpu_offload.device.runtime import get_backend
from cpu_offload.engine.host_buffers import HostBufferPool
from cpu_offload.engine.transitions import TRANSITIONS
from cpu_offload.hooks.handles import unpack_saved

pytestmark = pytest.mark.usefixtures("streams")  # host, strict_streams(), strict_runtime()

S = LayerState


def make_state(retain: bool = False, min_numel: int = 0, index: int = 3) -> OffloadableLayerState:
    backend = get_backend("cpu")
    return OffloadableLayerState(
        backend.new_stream(),
        layer_index=index,
        backend=backend,
        host_buffers=HostBufferPool(backend, retain),
        min_offload_numel=min_numel,
    )


def test_legal_cycle_twice(streams):
    state = make_state()
    for _ in range(2):
        x = torch.randn(64, 8)
        handle = state.push_tensor(x)
        assert handle is not x and state.state is S.NOT_OFFLOADED
        state.start_offload()
        assert state.state is S.OFFLOAD_STARTED
        state.release_activation_forward_gpu_memory()
        assert state.state is S.OFFLOAD_FINISHED
        assert state.get_offloaded_total_size_mb() == x.numel() * 4 / 2**20
        state.start_reload()
        assert state.state is S.RELOAD_STARTED
        y = state.pop_tensor(handle)
        assert y is not x and torch.equal(x, y)
        state.release_all_memory()
        # The handle (its graph) is alive: the host copy stays for another backward.
        assert state.state is S.OFFLOAD_FINISHED
        del handle, y
        assert state.state is S.NOT_OFFLOADED
        assert state.get_offloaded_total_size_mb() == 0


def offloaded(state: OffloadableLayerState, x: torch.Tensor):
    """Push ``x``, copy it out and release it on the device; returns its handle."""
    handle = state.push_tensor(x)
    state.start_offload()
    state.release_activation_forward_gpu_memory()
    return handle


def test_reused_state_invalidates_the_old_cycle(streams):
    state = make_state()
    old = offloaded(state, torch.randn(64, 8))
    state.start_reload()
    state.pop_tensor(old)
    state.release_all_memory()
    new = state.push_tensor(torch.randn(64, 8))  # next iteration, old handle still alive
    assert state.state is S.NOT_OFFLOADED and new is not old
    with pytest.raises(OffloadStateError, match="reused for another forward pass"):
        state.pop_tensor(old)


@pytest.mark.parametrize("reached", list(S), ids=lambda s: s.name)
def test_release_all_from_every_state_keeps_what_the_graph_needs(streams, reached):
    state = make_state()
    x = torch.randn(64, 8)
    handle = state.push_tensor(x)
    steps = [state.start_offload, state.release_activation_forward_gpu_memory, state.start_reload]
    for step in steps[: list(S).index(reached)]:
        step()
    assert state.state is reached
    state.release_all_memory()
    # A second backward through the same graph gets the same values back.
    expected = S.NOT_OFFLOADED if reached is S.NOT_OFFLOADED else S.OFFLOAD_FINISHED
    assert state.state is expected
    assert torch.equal(state.pop_tensor(handle), x)
    del handle
    assert state.state is S.NOT_OFFLOADED and state.get_offloaded_total_size_mb() == 0


ILLEGAL = [
    ("push_tensor", S.OFFLOAD_STARTED),
    ("push_tensor", S.OFFLOAD_FINISHED),
    ("push_tensor", S.RELOAD_STARTED),
    ("start_offload", S.OFFLOAD_STARTED),
    ("start_offload", S.OFFLOAD_FINISHED),
    ("start_offload", S.RELOAD_STARTED),
    ("release_activation_forward_gpu_memory", S.NOT_OFFLOADED),
    ("release_activation_forward_gpu_memory", S.OFFLOAD_FINISHED),
    ("release_activation_forward_gpu_memory", S.RELOAD_STARTED),
    ("start_reload", S.NOT_OFFLOADED),
    ("start_reload", S.OFFLOAD_STARTED),
    ("start_reload", S.RELOAD_STARTED),
]


@pytest.mark.parametrize("operation,reached", ILLEGAL, ids=lambda v: getattr(v, "name", v))
def test_illegal_transition_raises(streams, operation, reached):
    state = make_state(index=3)
    state.push_tensor(torch.randn(64, 8))
    steps = [state.start_offload, state.release_activation_forward_gpu_memory, state.start_reload]
    for step in steps[: list(S).index(reached)]:
        step()
    args = (torch.randn(4),) if operation == "push_tensor" else ()
    with pytest.raises(OffloadStateError) as info:
        getattr(state, operation)(*args)
    message = str(info.value)
    assert "layer 3" in message and reached.name in message
    transition = TRANSITIONS[operation]
    assert f"{operation} needs {transition.needs.name}" in message
    assert transition.advice in message
    assert state.state is reached  # nothing changed


def test_the_transition_table_is_the_state_machine(streams):
    """Every legal step leads where the table says."""
    state = make_state()
    state.push_tensor(torch.randn(64, 8))
    for operation in ("start_offload", "release_activation_forward_gpu_memory", "start_reload"):
        assert state.state is TRANSITIONS[operation].needs
        getattr(state, operation)()
        assert state.state is TRANSITIONS[operation].leads_to


def test_copies_stay_out_of_the_autograd_graph(streams):
    state = make_state()
    x = torch.randn(64, 8, requires_grad=True) * 2
    handle = state.push_tensor(x)
    state.start_offload()
    assert not any(buffer.requires_grad for buffer in state._data.host)
    state.release_activation_forward_gpu_memory()
    state.start_reload()
    assert state.pop_tensor(handle).grad_fn is None


def test_pop_before_offload_and_while_offloading_returns_device_tensor(streams):
    state = make_state()
    x = torch.randn(64, 8)
    handle = state.push_tensor(x)
    assert state.pop_tensor(handle) is x
    state.start_offload()
    assert state.pop_tensor(handle) is x


def test_pop_without_scheduled_reload_reloads_on_demand(streams):
    state = make_state()
    x = torch.randn(64, 8)
    handle = offloaded(state, x)
    with pytest.warns(UserWarning, match="reloaded now"):
        y = state.pop_tensor(handle)
    assert torch.equal(x, y) and state.state is S.RELOAD_STARTED
    assert state.stats.on_demand_reloads == 1


VIEWS = {
    "contiguous": lambda: torch.randn(32, 16),
    "transposed_restride": lambda: torch.randn(16, 32).t(),
    "offset_slice_contiguous": lambda: torch.randn(40, 16)[3:35],
    "int64": lambda: torch.randint(-5, 5, (32, 16)),
    "bool": lambda: torch.randn(32, 16) > 0,
    "bf16": lambda: torch.randn(32, 16, dtype=torch.bfloat16),
    "fp16_3d": lambda: torch.randn(4, 8, 16, dtype=torch.float16),
    "dense_permuted_no_base": lambda: (
        torch.randn(2, 16, 4, 8).transpose(1, 2).clone(memory_format=torch.preserve_format)
    ),
}


@pytest.mark.parametrize("name", list(VIEWS))
def test_round_trip_is_exact(streams, name):
    state = make_state()
    x = VIEWS[name]()
    handle = state.push_tensor(x)
    state.start_offload()
    state.release_activation_forward_gpu_memory()
    state.start_reload()
    y = state.pop_tensor(handle)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert y.stride() == x.stride()
    # A contiguous slice is copied by itself and comes back at offset 0 (keeping the
    # offset would cost that many extra device elements); views copied through their
    # base keep theirs.
    assert y.storage_offset() == (0 if name == "offset_slice_contiguous" else x.storage_offset())
    assert torch.equal(x, y)
    assert state.num_offloaded_tensors == 1


class _TwoPart:
    """A test double of the quantized-tensor protocol: a big and a small component."""

    def __init__(self, data: torch.Tensor, scale: torch.Tensor) -> None:
        self.data, self.scale = data, scale

    def prepare_for_saving(self):
        saved, self.data, self.scale = [self.data, None, self.scale], None, None
        return saved, self

    def restore_from_saved(self, tensors):
        self.data, _, self.scale = tensors[:3]
        return tensors[3:]


def test_saving_protocol_components_offloaded_by_the_rules(streams):
    state = make_state(min_numel=100)
    data, scale = torch.randn(64, 8), torch.tensor([0.5])
    handle = state.push_tensor(_TwoPart(data, scale))
    assert state.num_offloaded_tensors == 0  # counted at offload
    state.start_offload()
    assert state.num_offloaded_tensors == 1  # the scale stays
    state.release_activation_forward_gpu_memory()
    state.start_reload()
    rebuilt = unpack_saved(handle)
    assert isinstance(rebuilt, _TwoPart)
    assert torch.equal(rebuilt.data, data) and rebuilt.data is not data
    assert rebuilt.scale is scale


def test_saving_protocol_with_nothing_to_offload_keeps_object(streams):
    state = make_state(min_numel=10**6)
    obj = _TwoPart(torch.randn(64, 8), torch.tensor([0.5]))
    assert state.push_tensor(obj) is obj
    assert obj.data is not None  # restored after the decomposition


def test_retained_buffers_are_reused_and_shape_change_is_an_error(streams):
    state = make_state(retain=True)
    pool = state.host_buffers
    for _ in range(2):
        handle = state.push_tensor(torch.randn(64, 8))
        state.start_offload()
        state.release_activation_forward_gpu_memory()
        state.start_reload()
        state.pop_tensor(handle)
        state.release_all_memory()
    assert pool.allocations == 1
    handle = state.push_tensor(torch.randn(32, 8))  # kept: a dropped handle saves nothing
    with pytest.raises(Exception, match=r"retain_pinned_cpu_buffers=True .* layer 3") as info:
        state.start_offload()
    assert "(64, 8)" in str(info.value) and "(32, 8)" in str(info.value)


class _CountingBackend(type(get_backend("cpu"))):
    """The host backend with a current stream that a test can switch, counting events."""

    one_stream = False  # its current stream changes: the layer must ask which it is

    def __init__(self) -> None:
        super().__init__()
        self.key = "compute"
        self.recorded: list[object] = []
        self.waited: list[object] = []

    def current_stream_key(self):
        return self.key

    def record_event(self, stream=None):
        event = super().record_event(stream)
        self.recorded.append(event)
        return event

    def wait_event(self, stream, event) -> None:
        self.waited.append(event)


def _counting_state() -> tuple[OffloadableLayerState, _CountingBackend]:
    backend = _CountingBackend()
    state = OffloadableLayerState(backend.new_stream(), backend=backend, min_offload_numel=0)
    return state, backend


def test_one_event_covers_the_layer_at_push_offload_and_reload():
    state, backend = _counting_state()
    tensors = [torch.randn(16, 8) for _ in range(20)]
    handles = [state.push_tensor(t) for t in tensors]
    assert backend.recorded == []  # no event per saved tensor
    state.start_offload()
    assert len(backend.recorded) == 2  # ready (on the push stream), copies finished
    assert backend.waited == [backend.recorded[0]]
    state.release_activation_forward_gpu_memory()
    state.start_reload()
    assert len(backend.recorded) == 3  # one for the reload of the whole layer
    backend.waited.clear()
    popped = [state.pop_tensor(h) for h in reversed(handles)]
    assert backend.waited == [backend.recorded[2]]  # the first pop waits, once
    assert all(torch.equal(p, t) for p, t in zip(reversed(popped), tensors))


def test_tensors_saved_on_another_stream_keep_their_own_event():
    state, backend = _counting_state()
    first = state.push_tensor(torch.randn(16, 8))
    backend.key = "side stream"
    side = torch.randn(16, 8)
    second = state.push_tensor(side)
    assert len(backend.recorded) == 1  # the side-stream tensor's own event
    own = backend.recorded[0]
    state.start_offload()
    assert own in backend.waited and backend.recorded[1] in backend.waited
    state.release_activation_forward_gpu_memory()
    state.start_reload()
    assert torch.equal(state.pop_tensor(second), side)
    backend.key = "compute"
    backend.waited.clear()
    state.pop_tensor(first)
    assert backend.waited == [backend.recorded[-1]]  # a pop on another stream waits again


def test_objects_pushed_by_hand_come_back_as_they_were(streams):
    """A handle that is a tuple stands for a tensor (NOTE [Handles]): a tuple pushed by
    hand is wrapped, and any other object is its own handle."""
    state = make_state()
    pair, name = (torch.randn(4), 2), "not a tensor"
    handles = [state.push_tensor(pair), state.push_tensor(name)]
    assert handles[1] is name and type(handles[0]) is not tuple
    assert state.pop_tensor(handles[0]) is pair and state.pop_tensor(handles[1]) is name
