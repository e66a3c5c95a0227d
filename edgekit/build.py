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
BUILDABLE_TARGETS = ("cpu", "x1")


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
    machine: Path | None = None,
    recipe: str | Path | None = None,
) -> BuildResult:
    """Build a bundle of `model_dir` (default: the embedded radreport-tiny) for `target` at `out`.

    `recipe` (a TOML file or the name of one in models/radreport_tiny/recipes/) runs its passes on the exported
    graphs before the target's own steps: that is how the daemon's variants (fp16, int8, int4, sparse) are built.
    """
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
        extra_components: dict = {}
        if recipe is not None:
            onnx_dir, graphs = _apply_recipe(recipe, onnx_dir, Path(tmp), steps, figures, extra_components, say)
        x1_components: dict = {}
        if target == "x1":
            x1_components = _build_x1(onnx_dir, Path(tmp), figures, steps, say, machine)
            graphs = type(graphs)(**{f: Path(tmp) / "x1-int4" / Path(getattr(graphs, f)).name
                                     for f in ("vision_encoder", "embed_tokens", "decoder")})
        if parity:
            say("parity: ONNX Runtime against the PyTorch reference")
            figures["parity"] = measure_parity_figure(onnx_dir, model_dir)
        components = {
            "vision_encoder": graphs.vision_encoder,
            "embed_tokens": graphs.embed_tokens,
            "decoder": graphs.decoder,
            **{role: model_dir / fname for role, fname in WEIGHT_FILES.items()},
            **x1_components,
            **extra_components,
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


def _apply_recipe(recipe, onnx_dir: Path, tmp: Path, steps: list, figures: dict, components: dict, say):
    """Run a recipe's passes over the exported graphs; record each pass report; keep head-importance scores."""
    import json

    from edgekit.export.default import DECODER, EMBED_TOKENS, VISION_ENCODER, ExportedGraphs
    from edgekit.passes.pipeline import run_pipeline
    from edgekit.passes.recipe import load_recipe

    r = load_recipe(recipe)
    say(f"passes: recipe {r.name} ({', '.join(p.name for p in r.passes)})")
    out = tmp / "optimized"
    result = run_pipeline(onnx_dir, out, r.passes, overwrite=True)
    reports = [rep.to_dict() for rep in result.reports]
    for rep in reports:
        scores = rep.get("notes", {}).pop("head_importance", None)
        if scores is not None:
            path = tmp / "head_importance.json"
            path.write_text(json.dumps(scores, indent=1))
            components["head_importance"] = path
    steps.append({"name": "recipe", "params": {"recipe": r.name}, "passes": reports,
                  "seconds": round(result.seconds, 3)})
    end_to_end = result.provenance()["end_to_end_error"] or {  # one pass: its own check is the end-to-end one
        rep["graph"]: rep.get("check") or [] for rep in reports}
    figures["recipe"] = {
        "name": r.name,
        "end_to_end_error": end_to_end,
        "source": "ONNX Runtime, the graphs before and after the recipe's passes on the pipeline's check inputs",
    }
    graphs = ExportedGraphs(vision_encoder=out / VISION_ENCODER, embed_tokens=out / EMBED_TOKENS, decoder=out / DECODER)
    return out, graphs


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


def _int4_block(onnx_dir: Path) -> int:
    """32 (the x1 default) when it divides every weight MatMul's K, else the largest block that does."""
    import onnx

    ks = set()
    for f in onnx_dir.glob("*.onnx"):
        m = onnx.load(str(f), load_external_data=False)
        dims = {t.name: list(t.dims) for t in m.graph.initializer}
        for n in m.graph.node:
            if n.op_type == "Transpose" and n.input[0] in dims and len(dims[n.input[0]]) == 2:
                ks.add(dims[n.input[0]][1])
    return next((b for b in (32, 16) if all(k % b == 0 for k in ks)), 16)


def _build_x1(onnx_dir: Path, tmp: Path, figures: dict, steps: list, say, machine_path: Path | None) -> dict:
    """export -> INT4 (target x1) -> compile; returns the x1 components and stamps the figures."""
    import time

    from edgekit.passes.pipeline import run_pipeline
    from edgekit.passes.registry import make_pass
    from edgekit.targets.x1.backend import MACHINE_ROLE, PROGRAM_FILES, PROGRAM_ROLES
    from edgekit.targets.x1.compiler import compile_model
    from edgekit.targets.x1.machine import DEFAULT_MACHINE, load_machine

    block = _int4_block(onnx_dir)
    spec = f"int4:block={block},target=x1"
    say(f"passes: {spec}")
    result = run_pipeline(onnx_dir, tmp / "x1-int4", [make_pass(spec)], overwrite=True)
    steps.append({"name": "int4", "params": {"block": block, "target": "x1"}, "seconds": round(result.seconds, 3)})
    mach = load_machine(machine_path)
    say(f"compile: X1 programs for machine {mach.machine.name} ({mach.short_hash})")
    t0 = time.perf_counter()
    programs = compile_model(tmp / "x1-int4", mach)
    seconds = time.perf_counter() - t0
    out = tmp / "x1-programs"
    out.mkdir()
    components, sizes = {}, {}
    for graph, prog in programs.items():
        path = prog.save(out / PROGRAM_FILES[graph])
        components[PROGRAM_ROLES[graph]] = path
        sizes[graph] = path.stat().st_size
    machine_file = Path(machine_path) if machine_path else DEFAULT_MACHINE
    components[MACHINE_ROLE] = machine_file
    steps.append({"name": "x1_compile", "params": {"machine": mach.machine.name, "machine_hash": mach.hash}})
    figures["x1_compile"] = {
        "machine": mach.machine.name, "machine_hash": mach.hash, "compile_seconds": round(seconds, 3),
        "program_bytes": sizes,
        "host_partitions": {g: p.meta["host_partitions"] for g, p in programs.items()},
        "instructions": {g: len(p.instructions) for g, p in programs.items()},
        "source": "measured during this build: wall time of compile_model on the INT4 graphs; program file sizes",
    }
    return components
