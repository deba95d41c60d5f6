"""``plan --cuda-graph``: a step captured in one CUDA graph and replayed (NOTE [Planning a
captured step] in plan/planner.py): no host issue time, the same peaks held for the
graph's life, the JSON that says so, and the combinations refused."""

from __future__ import annotations

import json

import pytest

from cpu_offload.device.profiles import PROFILES
from cpu_offload.engine.host_buffers import pool_reserve
from cpu_offload.plan import DeviceProfile, LayerProfile, choose_policy, plan_offload
from cpu_offload.plan.__main__ import main
from cpu_offload.plan.planner import replay_profile

MS = 1e-3
#: 10 us of host per kernel, 1 us of device: a launch-bound layer, eagerly
LAUNCH_BOUND = DeviceProfile(link_bytes_per_s=1e9, flops_per_s=1e12, host_issue_s=10e-6)


def launch_bound_layer() -> LayerProfile:
    """100 forward and 200 backward kernels of 1 us each on the device (0.1 and 0.2 ms),
    10x that on the host (1 and 2 ms); 500 kB moved: 0.5 ms each way on the link."""
    kernel = (10**6, 0)  # 1e6 FLOP at 1e12 FLOP/s: 1 us
    return LayerProfile(
        saved_bytes=500_000,
        offloaded_bytes=500_000,
        kept_bytes=0,
        kept_by_reason={},
        tensors_offloaded=5,
        forward_flops=100 * 10**6,
        backward_flops=200 * 10**6,
        attention="flash",
        min_offload_numel=0,
        forward_kernels=[kernel] * 100,
        backward_kernels=[kernel] * 200,
    )


def test_a_replay_drops_the_host_issue_time_and_exposes_the_copies_it_hid():
    """L = 4, k = 2, worked by hand.  Eagerly each layer runs at the host's pace (1 ms
    forward, 2 ms backward: 12 ms), which hides every 0.5 ms copy.  Replayed, the layers
    take their device time (0.1 and 0.2 ms: 1.2 ms without offload), and the copies
    stay: the releases at forward 2 and 3 wait 0.4 ms each, the first pops of layers 1
    and 0 wait 0.3 ms each, 1.4 ms in all, a 2.6 ms step."""
    layer = launch_bound_layer()
    eager = plan_offload(layer, 4, LAUNCH_BOUND)
    captured = plan_offload(layer, 4, LAUNCH_BOUND, cuda_graph=True)
    assert not eager.cuda_graph and captured.cuda_graph
    assert eager.rows[0].step_s == pytest.approx(12 * MS)
    assert eager.rows[2].step_s == pytest.approx(12 * MS)
    assert eager.rows[2].exposed_copy_s == pytest.approx(0.0, abs=1e-12)
    assert captured.rows[0].step_s == pytest.approx(1.2 * MS)
    assert captured.rows[2].exposed_copy_s == pytest.approx(1.4 * MS)
    assert captured.rows[2].step_s == pytest.approx(2.6 * MS)
    assert captured.largest_hidden_k == 0 < eager.largest_hidden_k
    # what the step holds is what it peaks at eagerly (held for the graph's life)
    for before, after in zip(eager.rows, captured.rows):
        assert (after.peak_bytes, after.end_of_forward_bytes, after.offloaded_bytes) == (
            before.peak_bytes,
            before.end_of_forward_bytes,
            before.offloaded_bytes,
        )
    assert captured.device is LAUNCH_BOUND  # the plan names the device as given
    assert captured.graph_launch_s == LAUNCH_BOUND.host_issue_s


def test_a_device_bound_step_is_the_same_replayed():
    """Where the device is slower than the host (Llama-3-8B-like FLOPs on the H100's
    nominal profile), the host issue time was hidden already: nothing changes."""
    layer = LayerProfile(
        saved_bytes=2**30,
        offloaded_bytes=2**30,
        kept_bytes=0,
        kept_by_reason={},
        tensors_offloaded=10,
        forward_flops=10**12,
        backward_flops=2 * 10**12,
        attention="flash",
        min_offload_numel=0,
        forward_kernels=[(10**11, 2**28)] * 10,
        backward_kernels=[(10**11, 2**28)] * 20,
    )
    eager = plan_offload(layer, 6, "h100")
    captured = plan_offload(layer, 6, "h100", cuda_graph=True)
    assert [r.step_s for r in captured.rows] == [r.step_s for r in eager.rows]


def test_the_policy_for_a_budget_is_searched_on_the_replayed_times():
    layer = launch_bound_layer()
    budget = 2 * layer.saved_bytes
    captured = plan_offload(layer, 4, LAUNCH_BOUND, memory_budget=budget, cuda_graph=True)
    replayed = choose_policy(layer, 4, replay_profile(LAUNCH_BOUND), memory_budget=budget)
    eager = choose_policy(layer, 4, LAUNCH_BOUND, memory_budget=budget)
    assert captured.policy is not None
    assert captured.policy.policy == replayed.policy
    assert captured.policy.predicted.step_s == replayed.predicted.step_s
    assert replayed.predicted.step_s < eager.predicted.step_s


def test_the_json_says_the_step_is_captured_and_what_it_holds(tmp_path, capsys):
    eager_path, captured_path = tmp_path / "eager.json", tmp_path / "captured.json"
    assert main(["--preset", "tiny", "--json", str(eager_path)]) == 0
    assert "CUDA graph" not in capsys.readouterr().out
    flags = ["--preset", "tiny", "--memory-budget", "0.03", "--cuda-graph"]
    assert main([*flags, "--json", str(captured_path)]) == 0
    out = capsys.readouterr().out
    assert "captured: each step replays one CUDA graph (--cuda-graph)" in out
    assert "a replay's launch: 8 us of host" in out
    eager = json.loads(eager_path.read_text())
    captured = json.loads(captured_path.read_text())
    assert "cuda_graph" not in eager and "graph_launch_s" not in eager
    assert not any(key.startswith("graph_") for row in eager["rows"] for key in row)
    assert captured["cuda_graph"] is True
    assert captured["graph_launch_s"] == PROFILES["h100"].host_issue_s
    assert captured["device"] == eager["device"]  # the profile as given
    # the tiny layer is launch-bound on the H100: its replay is faster
    assert captured["rows"][0]["step_s"] < eager["rows"][0]["step_s"]
    for row in captured["rows"]:
        assert row["graph_pool_bytes"] == row["peak_bytes"]
        assert row["graph_host_bytes"] == pool_reserve(row["offloaded_bytes"])
        assert row["graph_host_bytes"] == row["host_bytes_per_rank"]
    predicted = captured["policy_predicted"]
    assert predicted["graph_pool_bytes"] == predicted["peak_bytes"]
    assert predicted["graph_host_bytes"] == pool_reserve(predicted["offloaded_bytes_per_step"])


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--pipeline-stages", "2", "--microbatches", "4"],
            "--cuda-graph: plans one stack's step captured whole in one graph; a pipeline "
            "stage's step runs its schedule's actions from Python",
        ),
        (
            ["--device", "910b"],
            "--cuda-graph with --device 910b: a CUDA graph needs a CUDA device; Ascend 910B "
            "runs the 'npu' runtime",
        ),
    ],
)
def test_what_a_captured_step_cannot_be_is_refused(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--preset", "tiny", "--cuda-graph", *flags])
    assert exit_info.value.code == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_plan_offload_refuses_a_graph_on_a_device_that_is_not_cuda():
    with pytest.raises(ValueError, match=r"cuda_graph=True: a CUDA graph needs a CUDA device"):
        plan_offload(launch_bound_layer(), 4, "910b", cuda_graph=True)
    assert plan_offload(launch_bound_layer(), 4, "910b").cuda_graph is False
