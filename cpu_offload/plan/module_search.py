"""The policy search, per submodule where that wins: ``modules=`` chosen with the policy.

``modules=`` is one choice for every offloaded layer, so the search is the layer-level
search (``policy_search.py``) run once per candidate set of kept parts, each measured
by its own census (``measure_layer(modules=...)``: the bytes it keeps and moves, byte
for byte), and the fastest plan that fits wins.  The first candidate keeps nothing:
today's layer-level search, which wins ties, so the answer is never slower than it.

NOTE [Which parts to try keeping]
Keeping a part of every offloaded layer costs its bytes on the device and spares their
copies; a byte costs the same memory and the same link time whichever part saved it.
So what a candidate changes is how much of each layer moves, and what the search gains
is granularity: between "offload this layer" and "keep it", a layer that moves only
part of what it saves, its copy short enough to hide behind the next layer's compute.
The candidates are the parts a Megatron user names (``--offload-modules``), found in
the layer: each kept alone, the two norms together (what Megatron-Core users most often
keep: cheap to recompute, large in fp32), and the layer's own code kept with every named
part offloaded (``rest``: in the presets, the rotary, the attention's output and the
SwiGLU products, the elementwise-heavy part).  Small parts to large ones: a spread of
kept fractions, each one census and one search (a second or two at 32 layers).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..cli import Parser, memory_amount
from ..device.profiles import PROFILES, DeviceProfile, get_profile
from ..policy.module_choices import KEEP, MEGATRON_MODULES, OFFLOAD, REST, names_in
from .census import LayerProfile, measure_layer
from .layers import preset_layer
from .policy_search import MAX_SEARCH_LAYERS, PolicyPlan, PolicySearch

__all__ = ["Candidate", "ModulePlan", "ModuleSearch", "candidate_modules"]

#: ``(label, modules=)``: a set of kept parts (None: keep nothing, the layer-level search)
Candidate = tuple[str, dict[str, str] | None]


def candidate_modules(layer: nn.Module) -> list[Candidate]:
    """The candidates for ``layer`` (NOTE [Which parts to try keeping])."""
    found = set(names_in(layer))
    present = [name for name in MEGATRON_MODULES if name in found]
    candidates: list[Candidate] = [("layer-level", None)]
    norms = [name for name in ("attn_norm", "mlp_norm") if name in present]
    if len(norms) == 2:
        candidates.append(("keep norms", {name: KEEP for name in norms}))
    candidates += [(f"keep {name}", {name: KEEP}) for name in present]
    if present:
        candidates.append(("keep rest", {**{name: OFFLOAD for name in present}, REST: KEEP}))
    return candidates


@dataclass
class ModulePlan:
    """The answer of :meth:`ModuleSearch.choose`.

    Attributes:
        label: which candidate won (``"layer-level"``: no ``modules=``).
        modules: pass it to ``offload_layers(..., modules=...)`` with ``policy``
            (None: leave it out).
        plan: the winner's policy and prediction.
        layer_level: the layer-level search's plan for the same budget.
        tried: ``(label, predicted step seconds or None where it does not fit)`` per
            candidate.
        profile: the winner's census (measured with its ``modules=``).
    """

    label: str
    modules: dict[str, str] | None
    plan: PolicyPlan
    layer_level: PolicyPlan
    tried: list[tuple[str, float | None]] = field(default_factory=list)
    profile: LayerProfile | None = field(default=None, repr=False)

    @property
    def gain(self) -> float:
        """How much faster than the layer-level plan (0.02: 2% less step time); 0.0
        where the layer-level plan wins or nothing fits."""
        if not (self.plan.fits and self.layer_level.fits):
            return 0.0
        return 1.0 - self.plan.predicted.step_s / self.layer_level.predicted.step_s

    def summary(self) -> str:
        """Lines for a person: the winner, what to pass, and every candidate's step."""
        steps = ", ".join(
            f"{label} {'-' if step is None else f'{step * 1e3:.1f}'}" for label, step in self.tried
        )
        passed = "leave out modules=" if self.modules is None else f"modules={self.modules}"
        return (
            f"per module: {self.label} ({passed}), {self.gain * 100:.2f}% less step time "
            f"than layer-level\n  predicted step ms per candidate (-: does not fit): {steps}"
        )

    def to_json(self) -> dict[str, object]:
        return {
            "label": self.label,
            "modules": self.modules,
            "gain": self.gain,
            "layer_level_policy": self.layer_level.policy,
            "layer_level_step_time_s": self.layer_level.predicted.step_s,
            "tried": [{"label": label, "step_time_s": step} for label, step in self.tried],
        }


class ModuleSearch:
    """One census and one layer-level search per candidate; answers any budget.

    Args:
        make_layer, inputs: as :func:`~cpu_offload.plan.measure_layer` takes them.
        num_layers: the layers of the stack.
        device: a profile name, a ``check --json`` file, or a :class:`DeviceProfile`.
        candidates: the sets to try (:func:`candidate_modules` of the layer by
            default); the layer-level one is put first if missing.
        **measure: more keyword arguments of ``measure_layer`` (``kwargs``,
            ``attention``, ``min_offload_numel``, ``description``).
    """

    def __init__(
        self,
        make_layer: Callable[[], nn.Module] | nn.Module,
        inputs: Sequence[Any] | torch.Tensor,
        num_layers: int,
        device: str | DeviceProfile = "h100",
        *,
        candidates: Sequence[Candidate] | None = None,
        **measure: Any,
    ) -> None:
        self.device = get_profile(device)
        if candidates is None:
            if isinstance(make_layer, nn.Module):
                candidates = candidate_modules(make_layer)
            else:
                with torch.device("meta"):
                    candidates = candidate_modules(make_layer())
        candidates = list(candidates)
        if not any(modules is None for _, modules in candidates):
            candidates.insert(0, ("layer-level", None))
        candidates.sort(key=lambda c: c[1] is not None)  # layer-level first: it wins ties
        self.candidates = candidates
        self.profiles: list[LayerProfile] = []
        self.searches: list[PolicySearch] = []
        for _, modules in candidates:
            profile = measure_layer(make_layer, inputs, modules=modules, **measure)
            self.profiles.append(profile)
            self.searches.append(PolicySearch(profile, num_layers, self.device))

    def choose(self, memory_budget: int) -> ModulePlan:
        """The fastest fitting plan over the candidates; the layer-level one on ties and
        where nothing fits."""
        plans = [search.choose(memory_budget) for search in self.searches]
        tried = [
            (label, plan.predicted.step_s if plan.fits else None)
            for (label, _), plan in zip(self.candidates, plans)
        ]
        best = 0
        for index, plan in enumerate(plans):
            if plan.fits and (
                not plans[best].fits or plan.predicted.step_s < plans[best].predicted.step_s
            ):
                best = index
        label, modules = self.candidates[best]
        return ModulePlan(label, modules, plans[best], plans[0], tried, self.profiles[best])


def granularity_table(
    presets: Sequence[str], devices: Sequence[str], budgets_gib: Sequence[float]
) -> str:
    """The comparison of module-level with layer-level plans, a Markdown table: per
    preset (``NAME`` at its depth, or ``NAME:LAYERS``), device and budget, the
    layer-level plan's predicted step, the winner, its step and the change in step
    time (docs/planning.md, "Choices per submodule")."""

    header = "| model | device | budget GiB | layer-level step ms | winner | step ms | change |"
    lines = [header, "|---|---|---:|---:|---|---:|---:|"]
    for given in presets:
        name, _, depth = given.partition(":")
        spec = preset_layer(name)
        if depth and not depth.isdigit():
            raise ValueError(f"preset {given!r}: expected NAME or NAME:LAYERS, such as {name}:32.")
        layers = int(depth) if depth else spec.num_layers or 1
        for device in devices:
            search = ModuleSearch(spec.make_layer, spec.inputs, layers, device)
            for budget in budgets_gib:
                found = search.choose(int(budget * 2**30))
                base = found.layer_level
                if not base.fits:
                    cells = ["does not fit", found.label if found.plan.fits else "-", "-", "-"]
                else:
                    step = found.plan.predicted.step_s
                    change = step / base.predicted.step_s - 1.0
                    cells = [
                        f"{base.predicted.step_s * 1e3:.1f}",
                        found.label,
                        f"{step * 1e3:.1f}",
                        f"{change * 100:+.2f}%",
                    ]
                row = [f"{name} ({layers} layers)", device, f"{budget:g}", *cells]
                lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def preset_depth(text: str) -> str:
    """An argparse type: a preset ``NAME`` or ``NAME:LAYERS``, the layers in
    ``1..MAX_SEARCH_LAYERS`` (checked before the table is computed)."""
    name, colon, depth = text.partition(":")
    try:
        preset_layer(name)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None  # it names the preset
    if colon and not (depth.isdigit() and 1 <= int(depth) <= MAX_SEARCH_LAYERS):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected NAME or NAME:LAYERS with LAYERS in 1..{MAX_SEARCH_LAYERS} "
            f"(the policy search's limit), such as {name}:32"
        )
    return text


def device_profile(text: str) -> str:
    """An argparse type: a built-in device profile's name or a profile's JSON file."""
    try:
        get_profile(text)
    except (ValueError, TypeError, OSError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None  # it names the device
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cpu_offload.plan.module_search``: print :func:`granularity_table`."""
    parser = Parser(
        prog="python -m cpu_offload.plan.module_search",
        description="Module-level against layer-level plans, a Markdown table.",
    )
    parser.add_argument(
        "--presets",
        nargs="+",
        type=preset_depth,
        metavar="NAME[:LAYERS]",
        default=["llama8b-layer:32", "mixtral8x7b-layer"],
        help="Llama-3-8B has 32 layers",
    )
    parser.add_argument(
        "--devices",
        nargs="+",
        type=device_profile,
        metavar="DEVICE",
        default=["h100", "910b"],
        help=f"{', '.join(PROFILES)}, or a JSON file",
    )
    parser.add_argument(
        "--budgets",
        nargs="+",
        type=memory_amount("--budgets"),
        metavar="GIB",
        default=[n * 2**30 for n in (10, 20, 30, 40, 50, 60)],
        help="saved activations allowed: GiB (20, 0.5) or sizes with their unit (512MiB)",
    )
    args = parser.parse_args(argv)
    try:
        print(granularity_table(args.presets, args.devices, [b / 2**30 for b in args.budgets]))
    except ValueError as error:
        parser.error(str(error))
    return 0


if __name__ == "__main__":
    sys.exit(main())
