"""The X1 runtime API: `SparseConfig` and `X1Engine`, shaped so the seed's SDK snippet runs as written.

    config = SparseConfig(sparsity_target=0.38, sensitivity_threshold=0.015, enable_kv_caching=True)
    engine = X1Engine(model_path="radreport-tiny-x1", config=config)
    output = engine.generate(input_ids=input_tokens, max_new_tokens=128, temperature=0.7)

Why a thin layer over `X1Backend`: the backend is the x1 target's run side (DSS, cost accounting) and
`edgekit.generate` the one decoding loop; the engine adds the SDK's shape: a `SparseConfig` instead of runtime
settings, text-only generation from token ids, and `last_stats` (emulated time and energy per token, the skip
rate reached against the target) so every call says what it cost on the X1.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edgekit.bundle import Bundle, cache_dir, load_bundle
from edgekit.errors import BundleError, ConfigError, EdgekitError
from edgekit.export.model_config import ModelConfig
from edgekit.generate import GenerationOptions, generate

if TYPE_CHECKING:
    from edgekit.reporter import Reporter

BUNDLE_PATH_ENV = "EDGEKIT_BUNDLE_PATH"


_FIELD_OF_SETTING = {"dss": "enable_sparsity", "kv_caching": "enable_kv_caching"}


@dataclass(frozen=True)
class SparseConfig:
    """How the X1 runs a model. `sparsity_target`: the most heads DSS may skip per token (fraction of all);
    `sensitivity_threshold`: a head is a candidate when importance x output share is below it;
    `enable_kv_caching`: keep K/V between tokens (off: every token recomputes the whole sequence, dense);
    `enable_sparsity`: False runs dense (DSS off) with the same engine, for comparisons;
    `max_consecutive_skips`: anti-starvation (dss.md); `machine`: a machine-description TOML (None: default)."""

    sparsity_target: float = 0.38
    sensitivity_threshold: float = 0.015
    enable_kv_caching: bool = True
    enable_sparsity: bool = True
    max_consecutive_skips: int = 8
    machine: str | None = None

    def __post_init__(self) -> None:
        from .backend import check_settings  # the one table of the settings' types and ranges

        check_settings(self.settings(), label="SparseConfig field", names=_FIELD_OF_SETTING)
        if self.machine is not None and not isinstance(self.machine, (str, os.PathLike)):
            raise ConfigError(
                f"SparseConfig field 'machine' = {self.machine!r} (expected a path to a machine-description TOML "
                "or None)"
            )

    @property
    def dss_active(self) -> bool:
        """As the backend decides it: DSS needs KV caching (without it every token recomputes, dense)."""
        return self.enable_sparsity and self.sparsity_target > 0 and self.enable_kv_caching

    def settings(self) -> dict:
        """The x1 runtime settings (`backend.RUNTIME_DEFAULTS`) this config asks for."""
        return {
            "dss": self.enable_sparsity,
            "sparsity_target": self.sparsity_target,
            "sensitivity_threshold": self.sensitivity_threshold,
            "max_consecutive_skips": self.max_consecutive_skips,
            "kv_caching": self.enable_kv_caching,
        }


def resolve_bundle(model_path: str | os.PathLike | Bundle) -> Bundle:
    """A bundle from a directory, an `.ekb`, or a name looked up (as `NAME`, `NAME.ekb`, `NAME-x1`,
    `NAME-x1.ekb`) in `$EDGEKIT_BUNDLE_PATH` (os.pathsep-separated), `./out` and `<edgekit cache>/bundles`."""
    if isinstance(model_path, Bundle):
        return model_path
    p = Path(model_path)
    if p.exists():
        return load_bundle(p)
    name = str(model_path)
    if os.sep in name or (os.altsep and os.altsep in name):
        raise BundleError("bundle not found", p)
    roots = [Path(d) for d in os.environ.get(BUNDLE_PATH_ENV, "").split(os.pathsep) if d]
    roots += [Path.cwd() / "out", cache_dir() / "bundles"]
    for root in roots:
        for cand in (name, f"{name}.ekb", f"{name}-x1", f"{name}-x1.ekb"):
            if (root / cand).exists():
                return load_bundle(root / cand)
    raise BundleError(
        f"no bundle named {name!r} in {', '.join(str(r) for r in roots)} "
        f"(give a bundle directory or .ekb, or set {BUNDLE_PATH_ENV})"
    )


class X1Engine:
    """An x1 bundle on the emulated X1, with DSS as configured: a thin seed-API wrapper over `X1Backend` and
    edgekit's one decoding loop (`edgekit.generate`). One engine per model; not thread-safe."""

    def __init__(self, model_path: str | os.PathLike | Bundle, config: SparseConfig | None = None, *, machine=None):
        from .machine import load_machine

        if config is not None and not isinstance(config, SparseConfig):
            raise ConfigError(f"config must be a SparseConfig, got {type(config).__name__}")
        self.config = config if config is not None else SparseConfig()
        self.bundle = resolve_bundle(model_path)
        if self.bundle.target != "x1":
            raise BundleError(
                f"bundle is built for target '{self.bundle.target}', not x1 "
                "(build one with: edgekit build --target x1)",
                self.bundle.source,
            )
        self.machine = machine if machine is not None else load_machine(self.config.machine)
        self.model_config = ModelConfig.load(self.bundle.component("model_config"))
        self.generation_config = json.loads(self.bundle.component("generation_config").read_text())
        from .backend import X1Backend  # after the checks: a wrong bundle fails fast, before any compile

        # no config: the bundle's own runtime settings, as `run`, `eval` and edgekitd use them
        settings = self.config.settings() if config is not None else None
        self.backend = X1Backend(self.bundle, self.machine, settings=settings, keep_runs=True)
        self.policy = self.backend.policy
        self._reporter: Reporter | None = None
        self.last_stats: dict = {}

    def head_importance(self) -> np.ndarray:
        """g (layers, heads) from the bundle's `head_importance` component; uniform when it has none."""
        return self.backend.head_importance(self.bundle)

    # text only: the seed's snippet -----------------------------------------------------------------------------
    def generate(
        self,
        input_ids,
        max_new_tokens: int = 128,
        temperature: float = 0.7,
        *,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_token_ids=None,
    ) -> list[int]:
        """New token ids after `input_ids` (a list or array of ids, (seq,) or (1, seq)), stopping at the
        bundle's `<eos>` (or `stop_token_ids`). Sampling is seeded by `seed`; temperature 0 is greedy."""
        ids = np.asarray(input_ids)
        if ids.ndim == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise EdgekitError(
                f"input_ids must be a non-empty list or (seq,) / (1, seq) array of integer token "
                f"ids, got dtype {ids.dtype} shape {ids.shape}"
            )
        vocab = self.model_config.vocab_size
        if ids.min() < 0 or ids.max() >= vocab:
            raise EdgekitError(
                f"input_ids must lie in [0, {vocab}) for this model, got [{int(ids.min())}, {int(ids.max())}]"
            )
        stops = [self.generation_config["eos_token_id"]] if stop_token_ids is None else list(stop_token_ids)
        options = GenerationOptions(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, stop_token_ids=stops
        )
        result = generate(self.backend, None, ids.astype(np.int64)[None], options)
        self.last_stats = {"tokens": len(result.token_ids), "stop_reason": result.stop_reason, **result.cost}
        return list(result.token_ids)

    # study -> report -------------------------------------------------------------------------------------------
    def report(self, study_path, prompt: str = "", options: GenerationOptions | None = None):
        """edgekit's `Report` for a study (DICOM file, series folder, zip or video) on the emulated X1; its
        `cost` holds the emulated time and energy."""
        from edgekit.reporter import Reporter

        if self._reporter is None:
            self._reporter = Reporter(self.bundle, backend=self.backend)
        report = self._reporter.report(study_path, prompt, options)
        self.last_stats = {
            "tokens": int(report.timings.get("new_tokens", 0)),
            "stop_reason": report.stop_reason,
            **report.cost,
        }
        return report

    @property
    def history(self) -> list:
        """(phase, RunResult) of every emulator run of the last call, for traces and reports."""
        return list(self.backend.last_runs)
