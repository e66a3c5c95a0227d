"""`edgekit build`: model weights in, a verified deployable bundle for one target out.

The steps are explicit and each leaves a figure in the manifest: export (graphs written from weights), the
recipe's passes, the target's own steps (its plug-in's build side: `edgekit.target.Target.prepare`), parity (the
exported graphs against the PyTorch reference, when torch is installed), size, and quality when an eval split is
given. This module names no target: it asks `edgekit.plugins` for one.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgekit import names
from edgekit.bundle import sha256_file, write_bundle
from edgekit.bundle.io import tool_versions
from edgekit.bundle.manifest import EXTERNAL_DATA_ROLES
from edgekit.errors import ConfigError, EdgekitError
from edgekit.plugins import DEFAULT_MODEL, get_model_family, get_target, target_names
from edgekit.reference import REFERENCE_FILE, write_reference
from edgekit.target import BuildInputs

DEFAULT_MODEL_NAME = DEFAULT_MODEL
WEIGHT_FILES = names.WEIGHT_FILES


def default_model_dir() -> Path:
    """The embedded default model's weights, shipped inside the package."""
    return get_model_family().weights_dir()


@dataclass
class BuildResult:
    bundle: Path
    figures: dict
    steps: list[dict] = field(default_factory=list)


def _check_source(model_dir: Path) -> None:
    if not model_dir.is_dir():
        raise EdgekitError("model directory not found", model_dir)
    for name in (names.WEIGHTS_FILE, *WEIGHT_FILES.values()):
        if not (model_dir / name).is_file():
            raise EdgekitError(f"not a model directory: {name} is missing", model_dir)


def learned_head_importance(model_dir: Path) -> dict:
    """The head importance a model learned in training (its gates, written beside the weights), as a bundle
    component: the X1's DSS reads it as `g[l,h]` with no further step."""
    path = model_dir / names.HEAD_IMPORTANCE_FILE
    return {names.HEAD_IMPORTANCE: path} if path.is_file() else {}


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
        onnx_dir,
        load_weights(model_dir / names.WEIGHTS_FILE),
        load_model_config(model_dir / "config.json"),
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
    image_size: int | None = None,
) -> BuildResult:
    """Build a bundle of `model_dir` (default: the embedded radreport-tiny) for `target` at `out`.

    `recipe` (a TOML file or the name of one the model family ships) runs its passes on the exported graphs
    before the target's own steps: that is how the daemon's variants (fp16, int8, int4, sparse) are built.
    `machine` is a machine description, for targets that take one. `image_size` pins a Hugging Face Qwen2-VL's
    dynamic resolution to that square side (`edgekit.hf.convert_hf`); any other model refuses it.
    """
    plugin = _plugin(target, machine)
    model_dir = Path(model_dir) if model_dir else default_model_dir()
    hf, text = _source_kind(model_dir, image_size)
    loaded_recipe = _load_recipe(recipe) if recipe is not None else None
    if loaded_recipe is not None:
        loaded_recipe = retarget_recipe(loaded_recipe, target, getattr(plugin, "weight_formats", None))
        plugin.check_recipe(tuple(p.name for p in loaded_recipe.passes))
    say = progress or (lambda _msg: None)
    steps: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="edgekit-build-") as tmp:
        work = Path(tmp)
        onnx_dir = work / "onnx"
        hf_spec, model_files = _export(model_dir, onnx_dir, work, hf, image_size, steps, say)
        figures: dict = {}
        components: dict = {}
        graphs_dir = onnx_dir
        if loaded_recipe is not None:
            graphs_dir = _apply_recipe(loaded_recipe, onnx_dir, work, steps, figures, components, say)
        prepared = plugin.prepare(
            BuildInputs(
                graphs=graphs_dir,
                work=work,
                model_dir=model_files["model_config"].parent if hf else model_dir,
                recipe=loaded_recipe.name if loaded_recipe else None,
                recipe_passes=tuple(p.name for p in loaded_recipe.passes) if loaded_recipe else (),
                machine=Path(machine) if machine else None,
                say=say,
            )
        )
        steps += prepared.steps
        figures.update(prepared.figures)
        if parity:
            figures["parity"] = _parity(graphs_dir, model_dir, model_files, hf_spec, hf=hf, text=text, say=say)
        # a recipe's heads pass scores the graphs it pruned: its scores (in `components`) win over learned gates
        components = {**_graph_components(prepared.graphs, text), **model_files, **components, **prepared.components}
        bundle_name = name or (model_dir.name if hf else DEFAULT_MODEL_NAME)
        staged = write_bundle(
            work / "staged", components, name=bundle_name, target=target, runtime=prepared.runtime, link=True
        )
        if eval_data is not None:
            figures["quality"] = measure_quality(staged, Path(eval_data), eval_limit, say)
        components.update(write_reference(staged, work / REFERENCE_FILE, say))  # its own outputs, for the device
        size = sum(Path(p).stat().st_size for p in components.values())
        figures["size"] = {"bytes": size, "source": "sum of the bundle's component files"}
        say(f"bundle: writing {out}")
        path = write_bundle(
            out,
            components,
            name=bundle_name,
            target=target,
            provenance=_provenance(model_dir, hf, steps),
            figures=figures,
            runtime=prepared.runtime,
            archive=archive,
        )
    return BuildResult(bundle=path, figures=figures, steps=steps)


def _provenance(model_dir: Path, hf: bool, steps: list[dict]) -> dict:
    """Where the bundle came from: its source weights' digest, the source, the passes, the tools' versions."""
    return {
        "source_weights_sha256": _weights_sha256(model_dir, hf),
        "source": str(model_dir.name if model_dir == default_model_dir() else model_dir),
        "passes": steps,
        "tools": tool_versions(),
    }


def _plugin(target: str, machine: Path | None):
    """The target's plug-in, refused in one line if this install cannot build it or it takes no machine."""
    if target not in target_names():
        raise ConfigError(f"target '{target}' is not buildable here (buildable: {', '.join(target_names())})")
    plugin = get_target(target)
    if machine is not None and not plugin.takes_machine:
        raise ConfigError(f"target '{target}' takes no machine description", machine)
    return plugin


def _source_kind(model_dir: Path, image_size: int | None) -> tuple[bool, bool]:
    """(a Hugging Face directory, a decoder alone: a text model's bundle), checked up front; `image_size` is
    refused for anything but a Qwen2-VL."""
    if not _is_hf_dir(model_dir):
        _check_source(model_dir)
        if image_size is not None:
            from edgekit.hf.qwen2_vl_processor import image_size_refused  # importing edgekit.hf takes a second

            raise image_size_refused("edgekit's own model", model_dir, "edgekit")
        return False, False
    text = _check_hf_source(model_dir) == "decoder"
    if text and image_size is not None:
        from edgekit.hf.qwen2_vl_processor import image_size_refused

        raise image_size_refused(read_model_type(model_dir), model_dir / "config.json", "decoder")
    return True, text


def _export(
    model_dir: Path,
    onnx_dir: Path,
    work: Path,
    hf: bool,
    image_size: int | None,
    steps: list[dict],
    say: Callable[[str], None],
) -> tuple[Any, dict[str, Path]]:
    """The ONNX graphs written from weights into `onnx_dir`: (the Hugging Face spec or None, the model's files a
    bundle ships beside its graphs); the step recorded in `steps`."""
    say("export: writing ONNX graphs from weights")
    if hf:
        hf_spec, model_files, described = _export_hf(model_dir, onnx_dir, work, image_size)
        steps.append({"name": "hf_import", "params": {"opset": 21, "dtype": "float32", **described}})
        return hf_spec, model_files
    from edgekit.export import export_default

    export_default(model_dir, onnx_dir)
    model_files = {role: model_dir / fname for role, fname in WEIGHT_FILES.items()}
    model_files.update(learned_head_importance(model_dir))
    steps.append({"name": "export", "params": {"opset": 21, "format": "onnx", "dtype": "float32"}})
    return None, model_files


def _parity(
    graphs_dir: Path,
    model_dir: Path,
    model_files: dict[str, Path],
    hf_spec: Any,
    *,
    hf: bool,
    text: bool,
    say: Callable[[str], None],
) -> dict:
    """The graphs held to the PyTorch reference (without torch, the figure says it was not measured)."""
    if importlib.util.find_spec("torch") is not None:
        say("parity: ONNX Runtime against the PyTorch reference")
    if text:
        from edgekit.hf.text_parity import measure_text_parity

        return measure_text_parity(graphs_dir, model_dir, model_files["generation_config"])
    if hf:
        from edgekit.hf.parity import measure_hf_parity

        return measure_hf_parity(graphs_dir, model_dir, hf_spec)
    return measure_parity_figure(graphs_dir, model_dir)


def _graph_components(graphs: Path, text: bool) -> dict[str, Path]:
    """The bundle's graph files by role, and the external weights beside any past protobuf's limit."""
    graph_roles = names.TEXT_GRAPH_ROLES if text else names.GRAPH_ROLES
    graph_files = {role: graphs / names.GRAPH_FILES[role] for role in graph_roles}
    external = {
        EXTERNAL_DATA_ROLES[role]: p.with_name(p.name + ".data")
        for role, p in graph_files.items()
        if p.with_name(p.name + ".data").is_file()
    }
    return {**graph_files, **external}


def _is_hf_dir(model_dir: Path) -> bool:
    from edgekit.hf import is_hf_model_dir

    return model_dir.is_dir() and is_hf_model_dir(model_dir)


def _check_hf_source(model_dir: Path) -> str:
    """A Hugging Face directory must hold a VLM or a decoder (a text model) of a family edgekit builds: refused up
    front otherwise. Returns its kind, "vlm" or "decoder"."""
    from edgekit.hf import read_hf_config
    from edgekit.hf.config import DECODER_TYPES, VLM_TYPES, model_kind

    cfg = read_hf_config(model_dir)
    kind = model_kind(cfg, model_dir)  # an unknown family: the one line listing the supported ones
    if kind not in ("vlm", "decoder"):
        raise ConfigError(
            f"model_type {cfg.get('model_type')!r} is a {kind} alone; a bundle needs a vision-language model "
            f"({', '.join(VLM_TYPES)}) or a decoder ({', '.join(DECODER_TYPES)}); `edgekit convert` writes its graphs",
            model_dir / "config.json",
        )
    return kind


def read_model_type(model_dir: Path) -> str:
    from edgekit.hf import read_hf_config

    return str(read_hf_config(model_dir).get("model_type"))


def _export_hf(model_dir: Path, onnx_dir: Path, work: Path, image_size: int | None = None):
    """A Hugging Face VLM or decoder directory -> its graphs (three, or a decoder's two), the files the runtime
    serves it with by role, and what was imported (the provenance step's parameters)."""
    from edgekit.hf import SafetensorsCheckpoint, convert_hf, decoder_spec, read_hf_config
    from edgekit.hf.config import model_kind
    from edgekit.hf.serving import write_serving_files
    from edgekit.hf.text_serving import text_model_summary, write_text_serving_files
    from edgekit.hf.vlm import vlm_spec

    cfg = read_hf_config(model_dir)
    entries = SafetensorsCheckpoint(model_dir).entries
    # tokenizer and chat template first: a model the runtime could not prompt is refused before any export
    if model_kind(cfg, model_dir) == "decoder":
        text = decoder_spec(cfg, model_dir, entries)
        files = write_text_serving_files(text, model_dir, cfg, work / "serving")
        described = text_model_summary(text, cfg)
    else:
        vlm = vlm_spec(cfg, model_dir, entries, image_size=image_size)
        files = write_serving_files(vlm, model_dir, cfg, work / "serving")
        described = vlm.to_dict()
    return convert_hf(model_dir, onnx_dir, image_size=image_size).spec, files, described


def _weights_sha256(model_dir: Path, hf: bool) -> str:
    if not hf:
        return sha256_file(model_dir / names.WEIGHTS_FILE)
    from edgekit.hf.checkpoint import weights_digest

    return weights_digest(model_dir)


def _load_recipe(recipe: str | Path):
    from edgekit.passes.recipe import load_recipe

    return load_recipe(recipe)


def retarget_recipe(recipe, target: str, accepted: tuple[str, ...] | None):
    """The recipe with the weight format `target` takes on every pass that writes one (`accepted`: the target's
    `weight_formats`): a pass naming none gets the first it can write, one naming a format the target does not
    take is refused, each config validated again, so a combination the target cannot take (asymmetric INT4 as
    blocked DequantizeLinear, say) is refused here, before export, in one line naming the pass and field.
    None (a plug-in that declares no formats): the recipe's own formats."""
    from edgekit.passes.weight_formats import WritesWeightFormat, for_target

    if accepted is None:
        return recipe
    passes = []
    for i, p in enumerate(recipe.passes):
        if isinstance(p.config, WritesWeightFormat):
            where = f"recipe {recipe.name} for target {target}: pass[{i}] {p.name}"
            p = type(p)(for_target(p.config, target, accepted, where))
        passes.append(p)
    return dataclasses.replace(recipe, passes=passes)


def _apply_recipe(recipe, onnx_dir: Path, work: Path, steps: list, figures: dict, components: dict, say) -> Path:
    """Run a recipe's passes over the exported graphs; record each pass report; keep head-importance scores.
    Returns the folder of the optimised graphs."""
    from edgekit.passes.pipeline import run_pipeline

    say(f"passes: recipe {recipe.name} ({', '.join(p.name for p in recipe.passes)})")
    out = work / "optimized"
    result = run_pipeline(onnx_dir, out, recipe.passes, overwrite=True)
    step = result.step("recipe", {"recipe": recipe.name})
    reports = step["passes"]
    for rep in reports:  # the scores travel as their own component (the pipeline wrote it), not in provenance
        rep.get("notes", {}).pop(names.HEAD_IMPORTANCE, None)
    if (out / names.HEAD_IMPORTANCE_FILE).is_file():
        components[names.HEAD_IMPORTANCE] = out / names.HEAD_IMPORTANCE_FILE
    steps.append(step)
    end_to_end = result.provenance()["end_to_end_error"] or {  # one pass: its own check is the end-to-end one
        rep["graph"]: rep.get("check") or [] for rep in reports
    }
    figures["recipe"] = {
        "name": recipe.name,
        "end_to_end_error": end_to_end,
        "source": "ONNX Runtime, the graphs before and after the recipe's passes on the pipeline's check inputs",
    }
    return out


def measure_quality(bundle_path: Path, eval_data: Path, limit: int | None, say) -> dict:
    """Finding F1, BLEU-4 and ROUGE-L of a bundle on an eval split (a text model's: on a JSON Lines file of prompts
    and references), as a manifest figure."""
    from edgekit.eval.runner import evaluate
    from edgekit.reporter import Reporter

    say(f"eval: {eval_data}")
    reporter = Reporter.from_bundle(bundle_path)
    try:
        if reporter.is_text:
            from edgekit.eval.prompts import evaluate_prompts

            o = evaluate_prompts(reporter, eval_data, limit=limit)["overall"]
            return {
                **{k: o.get(k) for k in ("bleu4", "rouge_l", "finding_f1", "finding_n", "n")},
                "source": f"edgekit eval on {eval_data.name} ({o['n']} prompts), 95% bootstrap intervals",
            }
        o = evaluate(reporter, eval_data, limit=limit, include_video=False)["overall"]
    finally:
        reporter.close()
    return {
        "finding_f1": o["finding_f1"],
        "bleu4": o["bleu4"],
        "rouge_l": o["rouge_l"],
        "hallucinated_finding_rate": o["hallucinated_finding_rate"],
        "n": o["n"],
        "source": f"edgekit eval on {eval_data.name} ({o['n']} studies), 95% bootstrap intervals",
    }
