"""Bundles changed after they were built, for the tests of the reference check: files dropped or replaced under
a manifest written again (so every checksum passes, as an attacker or a broken pipeline would leave them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgekit.bundle import load_bundle, write_bundle


def rewrite(bundle_path: Path, out: Path, *, drop: tuple[str, ...] = (), replace: dict | None = None) -> Path:
    """The bundle's files (less `drop`, with `replace` {role: file}) under a fresh manifest: every checksum good."""
    b = load_bundle(bundle_path)
    files = {r: b.component(r) for r in b.roles if r not in drop}
    files.update(replace or {})
    m = b.manifest
    return write_bundle(out, files, name=m.name, target=m.target, provenance=m.provenance, runtime=m.runtime)


def altered_embeddings(bundle_path: Path, work: Path) -> Path:
    """The bundle's embedding graph with its table's rows shuffled (a seeded permutation): other weights."""
    import onnx
    from onnx import numpy_helper

    src = load_bundle(bundle_path).component("embed_tokens")
    model = onnx.load(str(src))
    table = max(model.graph.initializer, key=lambda t: int(np.prod(t.dims)))
    values = numpy_helper.to_array(table)
    shuffled = values[np.random.default_rng(0).permutation(values.shape[0])]
    table.CopyFrom(numpy_helper.from_array(shuffled, table.name))
    work.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(work / src.name))
    return work / src.name
