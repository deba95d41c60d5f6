"""A warning points at the user's line that led to it, not at the library line that ran
our hook (issue 49 item 12)."""

from __future__ import annotations

import warnings

import torch
from helpers import tiny_hf_model

from cpu_offload import offload_layers
from cpu_offload.log import user_stacklevel, warn


def test_a_warning_from_inside_a_hugging_face_forward_points_at_the_users_line():
    model = tiny_hf_model("Llama", 3)
    handle = offload_layers(model, 1)  # every tensor is under min_offload_numel: one warning
    ids = torch.randint(0, 100, (1, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(input_ids=ids, labels=ids).loss.backward()
    handle.remove()
    ours = [w for w in caught if "cpu_offload:" in str(w.message)]
    assert ours, [str(w.message) for w in caught]
    assert {w.filename for w in ours} == {__file__}, [(w.filename, w.lineno) for w in ours]


def test_the_users_frame_is_the_first_outside_the_libraries():
    import heapq  # a standard-library function that calls back: its frame is passed over

    levels: list[int] = []

    def ask() -> None:
        heapq.nsmallest(1, [0], key=lambda _: levels.append(user_stacklevel(2)))

    ask()  # from the lambda (level 1), past heapq.nsmallest (2, a library's), to ask (3)
    assert levels == [3]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn("cpu_offload: from the test itself")
    assert [(w.filename, w.category) for w in caught] == [(__file__, UserWarning)]
