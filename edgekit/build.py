"""`edgekit build`: model weights in, a verified deployable bundle for one target out.

The steps are explicit and each leaves a figure in the manifest: export (graphs written from weights), parity
(the exported graphs against the PyTorch reference, when torch is installed), size, and quality when an eval
split is given. Target-specific compilation (x1 programs, TensorRT engines) plugs in after export.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from edgekit.bundle import sha256_file, write_bundle
from edgekit.bundle.io import tool_versions
from edgekit.errors import ConfigError, EdgekitError

DEFAULT_MODEL_NAME = "radreport-tiny"
WEIGHT_FILES = {
    "model_config": "config.json",
    "tokenizer": "tokenizer.json",
    "generation_config": "generation_config.json",
    "preprocessor_config": "preprocessor_config.json",
}
BUILDABLE_TARGETS = ("cpu",)


def default_model_dir() -> Path:
    """The embedded default model's weights, shipped inside the package."""
    from edgekit.models import radreport_tiny

    return Path(radreport_tiny.__file__).parent / "weights"


@dataclass
class BuildResult:
    bundle: Path
    figures: dict
    steps: list[dict] = field(default_factory=list)


def _check_source(model_dir: Path) -> None:
    if not model_dir.is_dir():
        raise EdgekitError("model directory not found", model_dir)
    for name in ("model.safetensors", *WEIGHT_FILES.values()):
        if not (model_dir / name).is_file():
            raise EdgekitError(f"not a model directory: {name} is missing", model_dir)


def measure_parity_figure(onnx_dir: Path, model_dir: Path, samples: int = 8) -> dict:
    """ONNX Runtime vs the PyTorch reference, or a note saying why it was not measured."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return {"measured": False, "source": "not measured: needs PyTorch (pip install 'edgekit[train]')"}
    from edgekit.export import load_weights
    from edgekit.export.default import load_model_config
    from edgekit.export.parity import measure_export_parity

    report = measure_export_parity(
        onnx_dir, load_weights(model_dir / "model.safetensors"), load_model_config(model_dir / "config.json"),
        samples=samples,
    )
    return {
        "measured": True,
        **report.to_dict(),
        "source": f"ONNX Runtime CPU vs PyTorch reference, {samples} random inputs, greedy and teacher-forced decode",
    }


def build(
    target: str,
    out: Path,
    *,
    model_dir: Path | None = None,
    name: str | None = None,
    archive: bool = False,
    parity: bool = True,
    eval_data: Path | None = None,
    eval_limit: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> BuildResult:
    """Build a bundle of `model_dir` (default: the embedded radreport-tiny) for `target` at `out`."""
    if target not in BUILDABLE_TARGETS:
        raise ConfigError(f"target '{target}' is not buildable yet (buildable: {', '.join(BUILDABLE_TARGETS)})")
    model_dir = Path(model_dir) if model_dir else default_model_dir()
    _check_source(model_dir)
    say = progress or (lambda _msg: None)
    steps: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="edgekit-build-") as tmp:
        onnx_dir = Path(tmp) / "onnx"
        say("export: writing ONNX graphs from weights")
        from edgekit.export import export_default

        graphs = export_default(model_dir, onnx_dir)
        steps.append({"name": "export", "params": {"opset": 21, "format": "onnx", "dtype": "float32"}})
        figures: dict = {}
        if parity:
            say("parity: ONNX Runtime against the PyTorch reference")
            figures["parity"] = measure_parity_figure(onnx_dir, model_dir)
        components = {
            "vision_encoder": graphs.vision_encoder,
            "embed_tokens": graphs.embed_tokens,
            "decoder": graphs.decoder,
            **{role: model_dir / fname for role, fname in WEIGHT_FILES.items()},
        }
        size = sum(Path(p).stat().st_size for p in components.values())
        figures["size"] = {"bytes": size, "source": "sum of the bundle's component files"}
        provenance = {
            "source_weights_sha256": sha256_file(model_dir / "model.safetensors"),
            "source": str(model_dir.name if model_dir == default_model_dir() else model_dir),
            "passes": steps,
            "tools": tool_versions(),
        }
        if eval_data is not None:
            staged = write_bundle(Path(tmp) / "staged", components, name=name or DEFAULT_MODEL_NAME, target=target)
            figures["quality"] = measure_quality(staged, Path(eval_data), eval_limit, say)
        say(f"bundle: writing {out}")
        path = write_bundle(
            out, components, name=name or DEFAULT_MODEL_NAME, target=target,
            provenance=provenance, figures=figures, archive=archive,
        )
    return BuildResult(bundle=path, figures=figures, steps=steps)


def measure_quality(bundle_path: Path, eval_data: Path, limit: int | None, say) -> dict:
    """Finding F1, BLEU-4 and ROUGE-L of a bundle on an eval split, as a manifest figure."""
    from edgekit.eval.runner import evaluate
    from edgekit.reporter import Reporter

    say(f"eval: {eval_data}")
    o = evaluate(Reporter.from_bundle(bundle_path), eval_data, limit=limit, include_video=False)["overall"]
    return {
        "finding_f1": o["finding_f1"],
        "bleu4": o["bleu4"],
        "rouge_l": o["rouge_l"],
        "hallucinated_finding_rate": o["hallucinated_finding_rate"],
        "n": o["n"],
        "source": f"edgekit eval on {eval_data.name} ({o['n']} studies), 95% bootstrap intervals",
    }
