"""The policy cpu_offload.plan chooses for each memory budget, against offloading alone and
checkpointing alone: Llama-3-8B (32 layers, 8k tokens, bf16) on H100 and 910B profiles.

    python examples/memory_budget.py [--plot memory_budget.png] [--seq 8192]

Prints a markdown table per device (docs/planning.md shows them). Every time in it is a
prediction of the schedule model; nothing is allocated.
"""

from __future__ import annotations

from cpu_offload.cli import Parser, at_least, plot_file
from cpu_offload.plan import measure_layer, plan_offload, simulate_policy
from cpu_offload.plan.layers import preset_layer
from cpu_offload.plan.policy_search import PolicySearch
from cpu_offload.plan.schedule_model import LayerCosts
from cpu_offload.report.policy_words import policy_runs

GIB = 2**30
LAYERS = 32
BUDGETS_GIB = [64, 40, 30, 20, 12, 8, 4, 2, 1.5, 1]
SHORT = {"keep": "K", "offload": "O", "checkpoint": "C", "checkpoint+offload": "CO"}


def summary(policy: list[str]) -> str:
    """'6 O, 10 C, 16 K': runs of layers, first to last."""
    return ", ".join(f"{last - first + 1} {SHORT[c]}" for first, last, c in policy_runs(policy))


def walk(device: str, seq: int) -> tuple[list[str], list[tuple[float, float, float, float]]]:
    spec = preset_layer("llama8b-layer", seq=seq)
    layer = measure_layer(spec.make_layer, spec.inputs, kwargs=spec.kwargs)
    search = PolicySearch(layer, LAYERS, device)
    rows = plan_offload(layer, LAYERS, device).rows
    baseline = rows[0].step_s
    costs = LayerCosts.of(layer, search.device)
    everything = simulate_policy(
        ["checkpoint"] * LAYERS, costs, search.device.d2h, search.device.h2d, log=False
    )
    lines = [
        f"| budget | policy (first layer to last) | predicted step | offload k alone "
        f"| checkpoint all ({everything.peak_bytes / GIB:.1f} GiB) |",
        "| ---: | --- | ---: | ---: | ---: |",
    ]
    points = []
    for gib in BUDGETS_GIB:
        budget = int(gib * GIB)
        choice = search.choose(budget)
        fitting = [row for row in rows if row.peak_bytes <= budget]
        k_alone = (
            f"k={fitting[0].k}: {fitting[0].step_s / baseline - 1:+.0%}" if fitting else "no k fits"
        )
        ckpt = (
            f"{everything.step_s / baseline - 1:+.0%}"
            if everything.peak_bytes <= budget
            else "does not fit"
        )
        overhead = choice.predicted.step_s / baseline - 1
        mark = "" if choice.fits else " (nothing fits; closest)"
        lines.append(
            f"| {gib:g} GiB | {summary(choice.policy)}{mark} | {overhead:+.1%} | {k_alone} "
            f"| {ckpt} |"
        )
        best_k = fitting[0].step_s / baseline - 1 if fitting else float("nan")
        fits_all = everything.peak_bytes <= budget
        points.append(
            (gib, overhead, best_k, everything.step_s / baseline - 1 if fits_all else float("nan"))
        )
    return lines, points


def plot(results: dict[str, list[tuple[float, float, float, float]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(results), figsize=(11, 4), sharey=True)
    for ax, (device, points) in zip(axes, results.items()):
        budgets = [p[0] for p in points]
        ax.plot(budgets, [100 * p[1] for p in points], "o-", label="chosen policy")
        ax.plot(budgets, [100 * p[2] for p in points], "s--", label="offload k alone")
        ax.plot(budgets, [100 * p[3] for p in points], "^:", label="checkpoint all")
        ax.set_xscale("log")
        ax.invert_xaxis()
        ax.set_xlabel("activation budget, GiB (tighter to the right)")
        ax.set_title(f"Llama-3-8B, 32 layers, {device} (predicted)")
    axes[0].set_ylabel("step overhead vs keeping everything, %")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path)


def main() -> None:
    parser = Parser(prog="examples/memory_budget.py", description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=at_least(1), default=8192)
    parser.add_argument("--plot", metavar="PATH", type=plot_file, help="checked before the run")
    args = parser.parse_args()
    results = {}
    for device in ("h100", "910b"):
        lines, results[device] = walk(device, args.seq)
        print(f"\n{device}, seq {args.seq}:\n")
        print("\n".join(lines))
    if args.plot:
        plot(results, args.plot)
        print(f"\nplot written to {args.plot}")


if __name__ == "__main__":
    main()
