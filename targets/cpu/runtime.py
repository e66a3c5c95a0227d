"""The cpu target's run side: which decoder serves a bundle, and its settings.

A bundle built since the fused decoder (`decoder = "fused"` in its runtime section, the `cpu_decoder` component)
is served by `CpuSlotBackend`: the engine's rows over one preallocated KV buffer per layer. Older bundles, a
decoder the build could not lower, or the setting `decoder = "portable"` (for comparisons) are served by
`edgekit.ort.CpuBackend` over the portable graph, as before.
"""

from __future__ import annotations

from edgekit import names
from edgekit.errors import ConfigError
from edgekit.target import runtime_settings

FUSED, PORTABLE = "fused", "portable"
RUNTIME_DEFAULTS = {
    "decoder": PORTABLE,  # what a bundle without a runtime section (built before the fused decoder) runs
    "max_rows": 8,  # requests the fused decoder's KV buffers hold at once (the engine's batch is capped to it)
    "kv_capacity": 256,  # positions per row before the buffers first double
}


def check_settings(s: dict, where=None) -> dict:
    def positive(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    if s["decoder"] not in (FUSED, PORTABLE):
        raise ConfigError(
            f"cpu runtime setting 'decoder' = {s['decoder']!r} (expected {FUSED!r} or {PORTABLE!r})", where
        )
    for key in ("max_rows", "kv_capacity"):
        if not positive(s[key]):
            raise ConfigError(f"cpu runtime setting '{key}' = {s[key]!r} (expected an integer >= 1)", where)
    return s


def load_backend(bundle, options):
    """The bundle's decoder in ONNX Runtime: `CpuSlotBackend` over the fused decoder, else `CpuBackend`."""
    from edgekit.ort import CpuBackend

    from .fused import FUSED_ROLE
    from .slots import CpuSlotBackend

    where = bundle.source
    s = check_settings(runtime_settings(RUNTIME_DEFAULTS, bundle.manifest.runtime, options.settings, where), where)
    vision = None if bundle.is_text else bundle.component(names.VISION)
    if s["decoder"] == PORTABLE:
        return CpuBackend(
            vision,
            bundle.component(names.EMBED),
            bundle.component(names.DECODER_ROLE),
            intra_op_threads=options.threads,
            profile_dir=options.profile_dir,
            spin_between_runs=options.spin_between_runs,
        )
    if FUSED_ROLE not in bundle.manifest.components:
        raise ConfigError("this bundle has no fused cpu decoder (built before it): use decoder = 'portable'", where)
    return CpuSlotBackend(
        bundle.component(FUSED_ROLE),
        bundle.component(names.EMBED),
        vision,
        max_rows=s["max_rows"],
        capacity=s["kv_capacity"],
        intra_op_threads=options.threads,
        profile_dir=options.profile_dir,
        spin_between_runs=options.spin_between_runs,
    )
