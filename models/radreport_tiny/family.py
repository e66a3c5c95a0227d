"""radreport-tiny as a model family plug-in (`edgekit.plugins.MODEL_FAMILIES`): where its weights and recipes
are (package data, found through `importlib.resources` so an installed wheel works as a checkout does) and which
studies calibrate it (the synthetic train split it was trained on)."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from edgekit.target import CalibrationStudy

_PACKAGE = "edgekit.models.radreport_tiny"


class RadReportTiny:
    name = "radreport-tiny"

    def weights_dir(self) -> Path:
        return Path(str(files(_PACKAGE) / "weights"))

    def _recipes(self) -> Path:
        return Path(str(files(_PACKAGE) / "recipes"))

    def recipe_path(self, name: str) -> Path | None:
        path = self._recipes() / f"{name}.toml"
        return path if path.is_file() else None

    def recipe_names(self) -> list[str]:
        return sorted(p.stem for p in self._recipes().glob("*.toml"))

    def calibration_studies(self, n: int, *, split: str = "train", start: int = 0) -> list[CalibrationStudy]:
        from edgekit.models.synth import generate_study

        out = []
        for i in range(start, start + n):
            s = generate_study(i, split)
            frames = s.display()
            out.append(CalibrationStudy(frames=frames, modality=s.modality))
        return out

    def reference_model(self, config):
        """The PyTorch model the exported graphs must reproduce (needs the `train` extra)."""
        from .modeling import RadReportTiny

        return RadReportTiny(config)

    def test_split(self, cache_root: Path, count: int) -> Path:
        """The synthetic test split, written once (deterministically) under `cache_root`."""
        from edgekit.models.synth import write_split
        from edgekit.models.synth.generator import GENERATOR_VERSION

        out = Path(cache_root) / f"synth-test-v{GENERATOR_VERSION}-{count}"
        if not (out / "studies.jsonl").is_file():
            write_split(out, "test", count)
        return out


FAMILY = RadReportTiny()
