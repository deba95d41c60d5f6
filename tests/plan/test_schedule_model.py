"""The event model against hand-computed schedules; the plan's answers; device profiles."""

from __future__ import annotations

import json

import pytest

from cpu_offload.device.profiles import PROFILES, get_profile
from cpu_offload.plan import DeviceProfile, LayerProfile, plan_offload, simulate

UNIT = 100  # bytes one layer saves


def run(k, link, kept=0, L=4):
    return simulate(
        L,
        k,
        saved_bytes=UNIT,
        offloaded_bytes=UNIT - kept,
        kept_bytes=kept,
        forward_s=1.0,
        backward_s=2.0,
        d2h_bytes_per_s=link,
        h2d_bytes_per_s=link,
    )


def test_the_worked_example_of_the_design_document():
    """docs/design.md, L = 4, k = 2: the actions and the layers on the device per step."""
    row = run(2, link=1e12)
    expected = [
        ("fwd 0", "-", 1),
        ("fwd 1", "start offload 0", 2),
        ("fwd 2", "start offload 1; release 0", 2),
        ("fwd 3", "release 1", 2),
        ("bwd 3", "-", 2),
        ("bwd 2", "release 3; start reload 1", 2),
        ("bwd 1", "release 2; start reload 0", 2),
        ("bwd 0", "release 1", 1),
        ("end", "release 0", 0),
    ]
    assert [(step, action, on_device // UNIT) for step, action, on_device in row.log] == expected
    assert row.end_of_forward_bytes == row.peak_bytes == 2 * UNIT  # (L - k) layers
    assert row.offloaded_bytes == 2 * UNIT


def test_a_fast_link_hides_every_copy():
    row = run(2, link=1e12)
    assert row.exposed_copy_s == pytest.approx(0.0, abs=1e-9)
    assert row.step_s == 12.0 and row.overhead == 0.0


def test_a_slow_link_exposes_every_copy():
    """Copies of 100 s at 1 B/s, worked by hand: the releases at fwd 2 and fwd 3 wait 99 s
    each, the pops at bwd 1 and bwd 0 wait 98 s each."""
    row = run(2, link=1.0)
    assert row.exposed_copy_s == pytest.approx(99 + 99 + 98 + 98)
    assert row.step_s == pytest.approx(12 + 394)
    assert row.overhead == pytest.approx(394 / 12)


def test_what_stays_of_an_offloaded_layer_counts_at_the_end_of_forward():
    row = run(3, link=1e12, kept=10)
    assert row.end_of_forward_bytes == 4 * UNIT - 3 * (UNIT - 10)
    assert run(0, link=1.0).end_of_forward_bytes == 4 * UNIT


def test_k_out_of_range_is_refused():
    with pytest.raises(ValueError, match=r"k must be in \[0, 3\], got 4"):
        run(4, link=1.0)


def layer_profile(saved=2**30, flops=1e12):
    return LayerProfile(
        saved_bytes=saved,
        offloaded_bytes=saved,
        kept_bytes=0,
        kept_by_reason={},
        tensors_offloaded=10,
        forward_flops=int(flops),
        backward_flops=int(2 * flops),
        attention="flash",
        min_offload_numel=0,
    )


def test_the_plan_answers_from_its_rows():
    device = DeviceProfile(link_bytes_per_s=50e9, flops_per_s=500e12)
    plan = plan_offload(layer_profile(), 8, device, memory_budget=4 * 2**30)
    assert [row.k for row in plan.rows] == list(range(8))
    overheads = [row.overhead for row in plan.rows]
    assert overheads == sorted(overheads)  # more layers, more copies to hide
    assert plan.largest_hidden_k == max(r.k for r in plan.rows if r.overhead <= 0.02)
    assert plan.smallest_fitting_k == 4  # (8 - k) GiB <= 4 GiB
    assert not plan.needs_checkpointing
    tight = plan_offload(layer_profile(), 8, device, memory_budget=2**29)
    assert tight.smallest_fitting_k is None and tight.needs_checkpointing


def test_built_in_and_custom_profiles():
    assert set(PROFILES) == {"h100", "h200", "a100", "gh200", "910b"}
    assert get_profile("GH200").d2h > 5 * get_profile("h100").d2h  # NVLink-C2C vs PCIe
    with pytest.raises(ValueError, match="link_bytes_per_s must be a finite number > 0, got 0"):
        DeviceProfile(link_bytes_per_s=0, flops_per_s=1.0)
    with pytest.raises(ValueError, match="unknown device profile 'tpu'"):
        get_profile("tpu")


def test_a_profile_times_a_kernel_as_a_roofline():
    h100 = get_profile("h100")
    assert h100.memory_bytes_per_s == pytest.approx(3.35e12 * 0.8)
    assert h100.launch_s > 0 and h100.host_issue_s > 0 and h100.runtime == "cuda"
    assert get_profile("910b").runtime == "npu"
    matmul = h100.kernel_seconds(1e12, 1e6)  # bound by its FLOPs
    assert matmul == pytest.approx(1e12 / h100.flops_per_s + h100.launch_s)
    elementwise = h100.kernel_seconds(1e6, 1e9)  # bound by its bytes
    assert elementwise == pytest.approx(1e9 / h100.memory_bytes_per_s + h100.launch_s)
    assert h100.compute_seconds(2e12, [(1e12, 1e6), (1e6, 1e9)]) == matmul + elementwise
    plain = DeviceProfile(link_bytes_per_s=5e10, flops_per_s=1e14)  # FLOPs only, as given
    assert plain.compute_seconds(2e12, [(1e12, 1e6), (1e12, 1e9)]) == 2e12 / 1e14
    assert plain.pageable == 2.5e10  # half the pinned rate, unless given


def test_a_measured_profile_from_the_check_command(tmp_path):
    path = tmp_path / "check.json"
    document = {
        "environment": {"device_name": "NVIDIA H100 80GB HBM3"},
        "checks": [
            {"name": "bandwidth", "figures": {"d2h_bytes_per_s": 5.1e10, "h2d_bytes_per_s": 4.9e10}}
        ],
    }
    path.write_text(json.dumps(document))
    profile = DeviceProfile.from_json(path)
    assert (profile.d2h, profile.h2d) == (5.1e10, 4.9e10)
    assert profile.flops_per_s == PROFILES["h100"].flops_per_s
    assert profile.memory_bytes_per_s == PROFILES["h100"].memory_bytes_per_s  # its kernels
    assert "measured" in profile.name
    document["environment"]["device_name"] = "Some Accelerator"
    path.write_text(json.dumps(document))
    with pytest.raises(ValueError, match="matches no built-in profile"):
        DeviceProfile.from_json(path)
    assert DeviceProfile.from_json(path, flops_per_s=1e14).flops_per_s == 1e14
    path.write_text(json.dumps({"environment": {}, "checks": []}))
    with pytest.raises(ValueError, match="holds no measured link bandwidth"):
        DeviceProfile.from_json(path)


def test_plan_offload_refuses_a_bad_layer_count():
    with pytest.raises(ValueError, match=r"num_layers must be in 1..512, got 0 \(the plan"):
        plan_offload(layer_profile(), 0)
    with pytest.raises(ValueError, match="num_layers must be in 1..512, got 100000"):
        plan_offload(layer_profile(), 100_000)
    with pytest.raises(TypeError, match="num_layers must be an int, got 4.0"):
        plan_offload(layer_profile(), 4.0)


@pytest.mark.parametrize(
    "figures, error, message",
    [
        ({"h2d_bytes_per_s": -1.0}, ValueError, "h2d_bytes_per_s must be a finite number > 0"),
        ({"h2d_bytes_per_s": float("nan")}, ValueError, "h2d_bytes_per_s must be a finite"),
        ({"link_bytes_per_s": float("inf")}, ValueError, "link_bytes_per_s must be a finite"),
        ({"flops_per_s": 0}, ValueError, "flops_per_s must be a finite number > 0, got 0"),
        ({"h2d_bytes_per_s": "5e10"}, TypeError, "h2d_bytes_per_s must be a number of bytes"),
        ({"flops_per_s": True}, TypeError, "flops_per_s must be a number of FLOP per second"),
        ({"memory_bytes_per_s": 0.0}, ValueError, "memory_bytes_per_s must be a finite number"),
        ({"launch_s": -1e-6}, ValueError, "launch_s must be a finite number >= 0, got -1e-06"),
        ({"host_issue_s": "8us"}, TypeError, "host_issue_s must be a number of seconds"),
        ({"runtime": "tpu"}, ValueError, "runtime must be 'cuda' or 'npu', got 'tpu'"),
    ],
    ids=[
        "negative-h2d",
        "nan-h2d",
        "inf-link",
        "zero-flops",
        "string-h2d",
        "bool-flops",
        "zero-memory",
        "negative-launch",
        "string-issue",
        "unknown-runtime",
    ],
)
def test_a_device_profile_refuses_figures_no_device_has(figures, error, message):
    given = {"link_bytes_per_s": 5e10, "flops_per_s": 1e14, **figures}
    with pytest.raises(error, match="DeviceProfile: " + message):
        DeviceProfile(**given)


def test_a_measured_profile_refuses_a_file_of_another_shape(tmp_path):
    path = tmp_path / "check.json"
    for document, what in [
        ([1, 2], "the file"),
        ({"environment": "H100"}, "'environment'"),
        ({"checks": {"figures": {}}}, None),
        ({"checks": [{"figures": [1]}]}, "'figures'"),
    ]:
        path.write_text(json.dumps(document))
        expected = f"expected {what} to be a JSON object" if what else "expected 'checks' to be"
        with pytest.raises(ValueError, match=expected):
            DeviceProfile.from_json(path)
    path.write_text(
        json.dumps({"checks": [{"figures": {"d2h_bytes_per_s": -5, "h2d_bytes_per_s": 1}}]})
    )
    with pytest.raises(ValueError, match="link_bytes_per_s must be a finite number > 0, got -5"):
        DeviceProfile.from_json(path, flops_per_s=1e14)
