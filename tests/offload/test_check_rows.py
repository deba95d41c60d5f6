"""The rows of ``check --full`` that run in process (cpu_offload/check_rows.py) fail where
what they measure does not hold."""

from __future__ import annotations

import contextlib
import re

import torch

from cpu_offload import check_full, check_rows
from cpu_offload.engine.host_buffers import HostBufferPool
from cpu_offload.graphs import graph_synchronizer
from cpu_offload.graphs.graph_synchronizer import GraphHostPool
from cpu_offload.report.copy_timer import CopyTimer
from cpu_offload.testing import timed_runtime
from cpu_offload.testing.modeled_cuda import modeled_cuda


def test_the_reloads_row_fails_when_the_release_one_by_one_saves_nothing(monkeypatch):
    """Without the hold as its baseline, the plain policy's peak equals the baseline's:
    the row says FAIL and which criterion failed."""
    monkeypatch.setattr(check_rows, "layers_hold_their_reloads", contextlib.nullcontext)
    status, figure = check_rows.reloads("cpu", "h100")
    assert status == "FAIL"
    assert figure.endswith("(one by one not below the hold)"), figure


def test_the_reloads_row_needs_a_device_or_the_model():
    assert check_rows.reloads("cpu", None) == (
        "NOT RUN",
        "peak device memory needs a GPU or NPU (else --simulate)",
    )


def test_the_compile_row_fails_when_the_offloaded_program_differs(monkeypatch):
    """A compiled program that offloads and computes something else (the gradients of a
    scaled loss) is a FAIL, as a difference in the last bit would be."""
    gradients = check_rows._gradients
    calls = []

    def scaled(model, x):
        calls.append(model)
        return [g * 2 if len(calls) > 2 else g for g in gradients(model, x)]

    monkeypatch.setattr(check_rows, "_gradients", scaled)
    status, figure = check_rows.compiled_blocks("cpu", None)
    assert status == "FAIL" and "DIFFER from the compiled program" in figure, figure


def test_the_cuda_graph_row_fails_when_a_replay_moves_other_bytes_than_eager(monkeypatch):
    """Captured with one layer offloaded where the eager step offloaded two: the replays
    move half the eager step's bytes, and the row says FAIL."""
    offload_layers = check_rows.offload_layers

    def fewer_when_captured(layers, k, **options):
        return offload_layers(layers, 1 if options.get("cuda_graph") else k, **options)

    monkeypatch.setattr(check_rows, "offload_layers", fewer_when_captured)
    status, figure = check_rows.cuda_graph("cpu", "h100")
    assert status == "FAIL"
    assert "replays moved 144.0 MiB out and 144.0 MiB back" in figure, figure
    assert "(an eager step: 288.0, 288.0)" in figure, figure
    assert check_rows.cuda_graph("cpu", None)[0] == "NOT RUN"


def peaks(figure: str) -> list[str]:
    return re.findall(r"([\d.]+) GiB", figure)


def test_the_reloads_rows_device_path_measures_what_the_model_counts(monkeypatch):
    """The device path (warm-up, then the backend's peak memory around each step) run on
    the modeled CUDA, one step per way: the peaks the modeled path reports (its step
    times are this CPU's wall clock, so only the peaks are compared)."""
    monkeypatch.setattr(check_rows, "WARMUP", 0)
    monkeypatch.setattr(check_rows, "STEPS", 1)
    with timed_runtime("h100", record=False) as run, modeled_cuda(run.live):
        _, measured = check_rows.reloads("cuda", None)
    _, modeled = check_rows.reloads("cpu", "h100")
    assert peaks(measured) == peaks(modeled) == ["6.18", "6.67", "4.39", "4.20"], measured


def test_the_host_pool_rows_device_path_reads_torchs_pinned_allocator(monkeypatch):
    """The device path on the modeled CUDA, ``host_memory_stats()`` read from the modeled
    pinned allocator: the pool's count is what it holds."""
    with timed_runtime("h100", record=False) as run, modeled_cuda(run.live):
        pinned = run.live.memory.pinned

        def host_memory_stats() -> dict:
            return {
                "allocated_bytes.current": pinned.reserved,
                "num_host_alloc": pinned.allocations,
            }

        monkeypatch.setattr(torch.cuda, "host_memory_stats", host_memory_stats, raising=False)
        status, figure = check_rows.host_pool("cuda", None)
    assert (status, figure) == (
        "PASS",
        "the pool holds 448.0 MiB, torch 448.0 MiB, 1.02x of 439.0 MiB moved; pinned "
        "allocations per step [12, 0, 0, 0], torch's 12",
    )


def review(label: str) -> tuple[str, str]:
    """One check of the cuda_graph review row on the modeled H100, as ``--simulate`` runs it."""
    ((_, method, model),) = [c for c in check_full.REVIEW_CHECKS if c[0] == label]
    return check_full._review_check("cpu", "h100", label, method, model)


def test_the_review_row_runs_what_the_model_can_and_says_why_not_the_rest():
    status, figure = check_full.graph_review("cpu", "h100")
    assert status == "PASS"
    assert figure.startswith(
        "(a) PASS: the eager pass's input gradient bit-identical to eager without offload; "
        "(b) PASS: d2h "
    ), figure
    assert "over 4 copies timed (the eager step's: 4); (c) PASS: gradients of 3 replays" in figure
    assert "(d) PASS: shapes only: each of 3 replays copied 288.00 MiB out, 288.00 back" in figure
    assert figure.endswith(f"(e) NOT RUN: {check_full.NOT_MODELED}"), figure
    assert check_full.graph_review("cpu", None) == (
        "NOT RUN",
        "cpu captures no graphs (else --simulate)",
    )


def test_review_a_fails_when_a_captures_host_buffers_are_lent_to_eager_passes(monkeypatch):
    """The bug the review fixed, planted back: the graph's host buffer sets go back to
    the per-layer lending, so the replay writes into the eager pass's offloaded layers."""
    monkeypatch.setattr(GraphHostPool, "_release", HostBufferPool._release)
    assert review("a") == (
        "FAIL",
        "the eager pass's input gradient DIFFERS from eager without offload",
    )


def test_review_b_fails_when_captured_copies_are_timed(monkeypatch):
    class TimesCaptures(CopyTimer):
        def start(self, stream):
            event = self.backend.timing_event()
            event.record(stream)
            return event

    monkeypatch.setattr(check_full, "CopyTimer", TimesCaptures)
    status, figure = review("b")
    assert status == "FAIL" and figure.startswith("CaptureError: "), figure
    assert "cudaErrorInvalidValue" in figure, figure


def test_review_c_fails_where_a_capture_cannot_pin_memory(monkeypatch):
    monkeypatch.setattr(graph_synchronizer, "PINNED_IN_CAPTURE", False)
    status, figure = review("c")
    assert status == "FAIL"
    assert figure.startswith("CpuOffloadError: cpu_offload: cuda_graph=: layer 0 needs new"), figure


def test_review_d_fails_when_a_side_stream_is_left_unjoined(monkeypatch):
    def unjoined(self, x):
        self.side.wait_stream(self.runtime.current_stream())
        with self.runtime.stream(self.side):
            return self.inner(x)

    monkeypatch.setattr(check_full._SideStream, "forward", unjoined)
    status, figure = review("d")
    assert status == "FAIL" and figure.startswith("CaptureError: "), figure


def test_review_e_runs_its_device_path_in_the_data_mode():
    """(e)'s GPU path run in the modeled data mode (whose pinned allocator says nothing of
    torch's reuse, hence NOT RUN under --simulate): the context is let go, the new pinned
    tensors are filled and read back after the replay."""
    with timed_runtime("h100", flavour="cuda", data=True, record=False) as run:
        review = check_full._Review(run.live, "cpu", 32, 8)
        holds, figure = review.graph_outlives_its_context()
    assert (holds, figure) == (True, "0 of 6 new pinned tensors at a graph's address, intact")


def test_the_review_rows_device_branch_runs_on_a_graph_runtime(monkeypatch):
    """The device branch (the runtime ``graph_runtime`` gives, deterministic kernels) with
    the modeled data mode's runtime standing in for the GPU's, small blocks on the CPU:
    (a), (b), (c) and (e) run and PASS there (d computes on a side stream, which the
    data mode refuses)."""
    monkeypatch.setattr(check_full, "REVIEW_WIDTH", 32)
    monkeypatch.setattr(check_full, "REVIEW_ROWS", 8)
    with timed_runtime("h100", flavour="cuda", data=True, record=False) as run:
        monkeypatch.setattr(check_full, "graph_runtime", lambda device: run.live)
        found = {
            label: check_full._review_check("cpu", None, label, method, model)
            for label, method, model in check_full.REVIEW_CHECKS
        }
    assert {label: status for label, (status, _) in found.items()} == {
        "a": "PASS",
        "b": "PASS",
        "c": "PASS",
        "d": "FAIL",
        "e": "PASS",
    }, found
    assert found["d"][1].startswith("StreamHazardError: "), found["d"]
