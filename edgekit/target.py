"""What a deployment target and a model family are to the core: small protocols, resolved through
`edgekit.plugins`.

A target has a **build side** (`prepare`: exported, recipe-optimised graphs in, the files, figures, steps and
runtime settings of its bundle out, as data) and a **run side** (`load_backend`: a bundle in, a generation backend
out). The generic build (`edgekit/build.py`) and the reporter only ever talk to these.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True)
class BuildInputs:
    """What the generic build hands a target after export and the recipe."""

    graphs: Path  # folder with the three graphs (names in edgekit.names), after the recipe's passes
    work: Path  # scratch folder the target may write into; removed after the build
    model_dir: Path  # the source weights folder (config.json, tokenizer.json, ...)
    recipe: str | None = None  # name of the recipe that produced `graphs`, None for plain export
    recipe_passes: tuple[str, ...] = ()  # names of its passes, in order
    machine: Path | None = None  # a machine description, for targets that take one
    say: Callable[[str], None] = lambda _msg: None


@dataclass
class TargetBuild:
    """What a target adds to a bundle. `graphs` is the folder whose three graphs the bundle ships."""

    graphs: Path
    components: dict[str, Path] = field(default_factory=dict)  # extra bundle files by role
    figures: dict[str, dict] = field(default_factory=dict)  # each with a `source`
    steps: list[dict] = field(default_factory=list)  # provenance entries, in order
    runtime: dict[str, Any] = field(default_factory=dict)  # manifest["runtime"]: settings the run side reads


@dataclass(frozen=True)
class RuntimeOptions:
    """How to run a bundle. `settings` are target-specific overrides of the bundle's `runtime` section (for x1:
    `dss`, `sparsity_target`, `sensitivity_threshold`); a target refuses settings it does not know. `state_dir` is
    where a target may keep what it builds on the device (orin: TensorRT engines), so a service's copies live in
    its own state directory; None: the target's default. `engine` names which of the target's engines runs the
    bundle (`Target.engines`: orin's `onnxruntime` runs its ONNX graphs in ONNX Runtime off the device); None: the
    target's own (`edgekit.plugins.resolve_engine` checks it). `spin_between_runs=False`: ONNX Runtime's pool
    threads stop spinning at the end of each run, for a process that does other work between runs (edgekitd)."""

    threads: int | None = None
    profile_dir: Path | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)
    state_dir: Path | None = None
    engine: str | None = None
    spin_between_runs: bool = True


@dataclass(frozen=True)
class ParetoKnob:
    """A run-time knob `edgekit pareto` varies on a target's bundles (`Target.pareto_knobs`).

    `setting` is the `RuntimeOptions.settings` key the knob's value goes to, with `fixed` settings beside it (orin's
    `orin_estimate` sets `estimate` and `engine=onnxruntime`); None marks one of the core's own knobs
    (`max_new_tokens`, `video_max_frames`, `threads`, `max_batch`: every target has them), listed only to add
    `grid` values.
    `grid`: the values the default grid varies it over on this target, each alone from the bundle's own settings
    (none: not in the default grid). `device`: the knob says where the figures come from (a front of its own), not
    what a report costs, so it is never in the default grid."""

    setting: str | None = None
    fixed: Mapping[str, Any] = field(default_factory=dict)
    grid: tuple[Any, ...] = ()
    device: bool = False

    def settings(self, value: Any) -> dict[str, Any]:
        """The runtime settings for `value` (empty for a core knob: the core applies it)."""
        return {} if self.setting is None else {**self.fixed, self.setting: value}


class Target(Protocol):
    name: str
    takes_machine: bool  # whether `--machine` means anything here
    # The weight formats this target's runtime reads (`edgekit.passes.weight_formats`: `matmulnbits`,
    # `qdq-blocked`, ..., or one its package registers), in order of preference. The generic build gives every
    # recipe pass that writes a format and names none the first of these it can write (so one recipe builds for
    # every target) and refuses, in one line, a pass naming one not here. A plug-in without the attribute keeps
    # the recipe's own formats (and edgekit's defaults where a pass names none).
    weight_formats: tuple[str, ...]
    # `edgekit pareto`'s knobs on this target's bundles beyond the core's, and the core's it adds default-grid
    # values to (cpu: `threads`, as its latency is this machine's clock). A plug-in without it has the core's only.
    pareto_knobs: Mapping[str, ParetoKnob]
    # The engines that run this target's bundles, its own first (orin: tensorrt, onnxruntime); `RuntimeOptions.engine`
    # names one. A plug-in without the attribute runs on its own engine only, and any other is refused.
    engines: tuple[str, ...]

    def check_recipe(self, recipe_passes: tuple[str, ...]) -> None:
        """Refuse, up front and in one line, a recipe this target cannot build."""

    def prepare(self, inputs: BuildInputs) -> TargetBuild: ...

    def load_backend(self, bundle, options: RuntimeOptions): ...


@dataclass(frozen=True)
class CalibrationStudy:
    """Display-ready frames (T, H, W) float32 in [0, 1] and the modality, as the reporter would see a study."""

    frames: Any
    modality: str


class ModelFamily(Protocol):
    name: str

    def weights_dir(self) -> Path:
        """The family's default weights (a model directory), shipped as package data."""

    def recipe_path(self, name: str) -> Path | None:
        """A bundled recipe by name, None when there is none."""

    def recipe_names(self) -> list[str]: ...

    def calibration_studies(self, n: int, *, split: str = "train", start: int = 0) -> list[CalibrationStudy]:
        """`n` studies for calibration-aware passes (deterministic)."""

    def reference_model(self, config):
        """The PyTorch module the exported graphs must reproduce (parity figures); needs torch."""

    def test_split(self, cache_root: Path, count: int) -> Path:
        """The family's default eval split (a folder with `studies.jsonl`), written once under `cache_root`."""


def runtime_settings(
    defaults: Mapping[str, Any], bundle_runtime: Mapping[str, Any], overrides: Mapping[str, Any], where
) -> dict[str, Any]:
    """The bundle's runtime section over the target's defaults, then the request's overrides; unknown keys are
    refused by name (a typo must not silently run another configuration)."""
    from edgekit.errors import ConfigError

    for source in (bundle_runtime, overrides):
        unknown = sorted(set(source) - set(defaults))
        if unknown and not defaults:
            raise ConfigError(f"this target takes no runtime settings (got {', '.join(unknown)})", where)
        if unknown:
            raise ConfigError(
                f"unknown runtime setting(s) {', '.join(unknown)} (known: {', '.join(sorted(defaults))})", where
            )
    return {**defaults, **bundle_runtime, **overrides}
