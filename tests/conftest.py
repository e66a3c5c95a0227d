"""Fixtures several test modules share: one small random-init model (built from its config, no weights
downloaded), its exported graphs, and the ONNX Runtime backend over them: the one test backend."""

from __future__ import annotations

import os
from pathlib import Path

# MKL may use fewer threads than asked while other processes load the cores (MKL_DYNAMIC defaults to true), which
# changes how reductions split and so the last bit of a training step. The bit-identical rerun test failed once
# under CI's two workers (it passed alone and in every other run); this is the likely cause, not a proven one.
# Set before anything loads MKL (torch does, on import).
os.environ.setdefault("MKL_DYNAMIC", "FALSE")

import pytest

from edgekit.export import export_model, random_weights
from edgekit.export.model_config import ModelConfig
from edgekit.ort import CpuBackend

from small_model import SMALL


@pytest.fixture(scope="session")
def small_config() -> ModelConfig:
    return SMALL


@pytest.fixture(scope="session")
def small_onnx_dir(tmp_path_factory) -> Path:
    """SMALL's three graphs, exported once per session from seeded random weights."""
    out = tmp_path_factory.mktemp("small-onnx")
    export_model(random_weights(SMALL, seed=4), SMALL, out)
    return out


@pytest.fixture(scope="session")
def small_backend(small_onnx_dir) -> CpuBackend:
    """ONNX Runtime over SMALL's graphs, one thread (CI has two cores for two workers)."""
    return CpuBackend.from_dir(small_onnx_dir, intra_op_threads=1)


@pytest.fixture
def placeholder_bundle(tmp_path, monkeypatch) -> Path:
    """A valid bundle whose components are placeholder bytes: for commands that read manifests, not models."""
    from edgekit.bundle import REQUIRED_ROLES, write_bundle

    monkeypatch.setenv("EDGEKIT_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    comps = {}
    for role in REQUIRED_ROLES:
        p = src / f"{role}.bin"
        p.write_bytes(role.encode() * 50)
        comps[role] = p
    return write_bundle(
        tmp_path / "b",
        comps,
        name="tiny",
        target="cpu",
        provenance={"passes": []},
        figures={"parity": {"max_abs": 0.0, "source": "test"}},
    )


@pytest.fixture(scope="session")
def tiny_orin_bundles(tmp_path_factory):
    """The tiny random-weights model (seed 3, 8 new tokens) built for orin and for cpu: (orin, cpu) bundle paths.
    orin's graphs run in ONNX Runtime here, billed by its cost model; nothing is measured on an Orin."""
    from edgekit.build import build
    from edgekit.daemon.testing import write_tiny_model

    root = tmp_path_factory.mktemp("tiny-orin")
    model = write_tiny_model(root / "model", seed=3, max_new_tokens=8)
    build("orin", root / "tiny-orin", model_dir=model, parity=False)
    build("cpu", root / "tiny-cpu", model_dir=model, parity=False)
    return root / "tiny-orin", root / "tiny-cpu"


@pytest.fixture(scope="session")
def synth_split3(tmp_path_factory):
    """A synthetic test split of 3 studies (the folder `--data` takes)."""
    from edgekit.models.synth import write_split

    return write_split(tmp_path_factory.mktemp("synth-split3") / "test", "test", 3).parent
