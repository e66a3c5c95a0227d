"""A bundle read for the estimate: its shape from its own config.json, its weight formats from the pass reports on
record in its manifest, and one report's token counts from its generation config and prompt template.

Why apart: this is the only part of the cost model that touches files and the core's bundle, export and prompt
modules (imported when a bundle is read, so a preset or shape estimate loads none of them).
"""

from __future__ import annotations

import json
from pathlib import Path

from .model import WEIGHT_DTYPES, Precision, ReportTokens


def precision_from_manifest(manifest) -> tuple[Precision, list[str]]:
    """The weight formats a bundle's recipe wrote, read from its manifest's pass reports, with notes on what was
    inferred. Graphs no weight pass touched are FP32 in a cpu/x1 bundle and FP16 in an orin one (the orin target
    builds strongly typed FP16 networks)."""
    notes: list[str] = []
    passes = [p for step in manifest.provenance.get("passes", []) for p in step.get("passes", [])]
    unquantised = "fp16" if manifest.target == "orin" else "fp32"
    fmt = {"decoder": unquantised, "vision": unquantised, "embedding": unquantised}
    lm_head, block, sparse, head_keep = None, 32, False, 1.0
    for p in passes:
        name, graph, cfg = p.get("pass_name"), str(p.get("graph", "")), p.get("config", {})
        part = "decoder" if graph.startswith("decoder") else "vision" if graph.startswith("vision") else "embedding"
        if name == "fp16":
            fmt[part] = "fp16"
        elif name in ("int4", "int8"):
            fmt[part] = name
            if part == "decoder":
                block = int(cfg.get("block", block))
                if "lm_head" in cfg.get("keep", []):
                    lm_head = f"int{cfg.get('keep_bits', 8)}"
        elif name == "qembed":
            fmt["embedding"] = f"int{cfg.get('bits', 4)}"
        elif name == "sparse24":
            sparse = True
        elif name == "heads":
            n = p.get("notes", {})
            if n.get("heads_total"):
                head_keep = 1.0 - n["heads_pruned"] / n["heads_total"]
    if fmt["decoder"] == "fp32" and fmt["vision"] == "fp32":
        notes.append(f"no weight pass in a {manifest.target} bundle: FP32 graphs, estimated as FP32 on CUDA cores")
    if sparse and fmt["decoder"] == "int4":
        notes.append("2:4 sparsity under INT4 weight-only: no sparse INT4 kernel, so no speed-up is counted")
    if fmt["embedding"] not in WEIGHT_DTYPES:
        fmt["embedding"] = "int4"
    precision = Precision(
        weights=fmt["decoder"],
        lm_head=lm_head,
        vision=fmt["vision"],
        embedding=fmt["embedding"],
        block=block,
        sparse24=sparse,
        head_keep=head_keep,
    )
    return precision, notes


def read_bundle(path: str | Path):
    """(shape, precision, default report, notes, facts) of a bundle directory or `.ekb` archive. A directory's
    manifest is read without hashing every file (an estimate needs no integrity check; `load_bundle` does one)."""
    from edgekit import names
    from edgekit.bundle import load_bundle
    from edgekit.bundle.manifest import read_manifest
    from edgekit.describe_model import describe_config
    from edgekit.errors import BundleError, EdgekitError
    from edgekit.prompt import prompt_ids

    root = Path(path)
    if root.is_dir():
        manifest = read_manifest(root)
    else:
        bundle = load_bundle(root)
        root, manifest = bundle.root, bundle.manifest
    comps = manifest.components
    if "model_config" not in comps:
        raise BundleError("the manifest lists no model_config (config.json)", root / "manifest.json")
    try:
        config_path = root / comps["model_config"].path
        shape = describe_config(json.loads(config_path.read_text()), manifest.name, config_path)
        gen = json.loads((root / comps["generation_config"].path).read_text()) if "generation_config" in comps else {}
    except (OSError, ValueError, TypeError, KeyError, EdgekitError) as err:
        raise BundleError(f"cannot read the model's config: {err}", root) from None
    precision, notes = precision_from_manifest(manifest)
    prompt_tokens = 16
    if "tokenizer" in comps and gen.get("bos_token_id") is not None:
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(root / comps["tokenizer"].path))
        except Exception as err:  # tokenizers raises plain Exception on a corrupt file
            raise BundleError(f"cannot read the tokenizer: {err}", root / comps["tokenizer"].path) from None
        prompt_tokens = len(prompt_ids(tok, gen, "CR", ""))
        notes.append(f"prompt: the bundle's template with modality CR and the default indication ({prompt_tokens})")
    new_tokens = int(gen.get("max_new_tokens", 96))
    notes.append(f"new tokens: the bundle's max_new_tokens ({new_tokens}), a worst-case report length")
    facts = {
        "bundle": manifest.name,
        "bundle_target": manifest.target,
        "graph_bytes": {r: c.bytes for r, c in comps.items() if r in names.GRAPH_ROLES},
    }
    return shape, precision, ReportTokens(prompt_tokens, new_tokens), notes, facts
