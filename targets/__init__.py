"""Deployment targets. Each turns a bundle into a generation backend (see `edgekit.generate`).

`cpu` runs the ONNX graphs in ONNX Runtime; `x1` (the emulated NPU) and `orin` (TensorRT on Jetson) plug in here
as they land, each behind the same backend protocol so reports, eval and the daemon never special-case a target.
"""

from __future__ import annotations

from pathlib import Path

from edgekit.errors import ConfigError

TARGETS = ("cpu", "orin", "x1")


def load_backend(bundle, *, threads: int | None = None, profile_dir: str | Path | None = None):
    """The backend for `bundle.target`, with its graphs loaded and ready."""
    target = bundle.target
    if target == "cpu":
        from edgekit.targets.cpu import CpuBackend

        return CpuBackend(
            bundle.component("vision_encoder"),
            bundle.component("embed_tokens"),
            bundle.component("decoder"),
            intra_op_threads=threads,
            profile_dir=profile_dir,
        )
    if target == "x1":
        from edgekit.targets.x1.backend import X1Backend

        return X1Backend(bundle)
    if target in TARGETS:
        raise ConfigError(f"bundles for target '{target}' cannot run on this machine yet", bundle.root)
    raise ConfigError(f"unknown target '{target}' (known: {', '.join(TARGETS)})", bundle.root)
