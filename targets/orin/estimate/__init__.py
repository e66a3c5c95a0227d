"""Orin cost model: latency and energy of one report on a Jetson Orin module, from NVIDIA's published tables.

Why: our users hold Orins and we hold none, yet `edgekit pareto` and the orin build want an Orin front before
anyone has run an engine on a device. So this is an estimate and says so: every figure is labelled
`estimated:orin-<model>-<mode>` (e.g. `estimated:orin-agx64-maxn`) and no part of it has been checked on a device.

The model (docs/orin-estimate.md derives it; devices.toml holds every number with its source, and says which are
published, derived or assumed):
- a power mode's peaks are the module's published rates scaled by the mode's active TPCs and clocks, and its
  memory clock (NVIDIA's nvpmodel caps);
- the vision encoder and the prefill are compute-bound: FLOPs / (Tensor Core peak at the compute precision x an
  efficiency), or their weight bytes / effective bandwidth where that is longer, plus a launch cost per kernel;
- each decode step is memory-bound: (weight bytes at the bundle's precision + the KV cache read) / (peak bandwidth x
  the achievable fraction), max'd with its compute time, plus a per-token launch and host overhead;
- power in a phase = idle + (mode budget - idle) x utilisation, where utilisation weighs how busy the math units
  and DRAM are in that phase; energy = sum of power x time. Weight-only INT4/INT8 computes in FP16 (TensorRT
  dequantises in the GEMM), so it speeds up decode, not prefill.

API, for `edgekit pareto` and the orin bundle build:

    from edgekit.targets.orin.estimate import estimate_report, known_devices, preset, shape_from_params
    est = estimate_report("out/radreport-tiny-orin", device="agx-orin-64", mode="MAXN")   # a bundle
    est = estimate_report(preset("seed-1.2b"), weights="int4", prompt_tokens=32, new_tokens=96)
    est = estimate_report(shape_from_params(1.2e9, layers=22, hidden=2048, heads=32, kv_heads=4), weights="fp16")
    est.latency_ms, est.energy_j, est.avg_power_w, est.source  # "estimated:orin-agx64-maxn"
    est.breakdown        # per phase: vision, prefill, decode (time, energy, power, bound, FLOPs, bytes)
    est.figure()         # a bundle-manifest figure: the numbers and where they come from
    known_devices()      # {"agx-orin-64": ("MAXN", "50W", "30W", "15W"), ...}

An unknown device or mode raises `ConfigError` with one line that lists the known ones.

One module per job: `data.py` reads and checks devices.toml; `rates.py` scales a module's peaks to a power mode;
`model.py` holds what is run (the core's `ModelDescription`, presets, `Precision`, `ReportTokens`); `bundle.py`
reads a bundle into those; `report.py` costs the phases of one report (`estimate_report`) and checks it against
`reference_checks`.
"""

from .bundle import precision_from_manifest, read_bundle
from .data import (
    DATA_FILE,
    DEFAULT_DEVICE,
    DEFAULT_MODE,
    DEVICE_FIELDS,
    MODE_FIELDS,
    Device,
    OrinData,
    PowerMode,
    get_device,
    known_devices,
    load_data,
    parse_data,
)
from .model import (
    COMPUTE_DTYPES,
    KV_BYTES,
    PRESETS,
    SCALE_BYTES,
    SIGLIP_B16_256,
    WEIGHT_DTYPES,
    ModelDescription,
    Precision,
    ReportTokens,
    VisionDescription,
    preset,
    shape_from_params,
)
from .rates import Rates, mode_rates
from .report import OrinEstimate, Phase, estimate_report, reference_checks

__all__ = [
    "COMPUTE_DTYPES",
    "DATA_FILE",
    "DEFAULT_DEVICE",
    "DEFAULT_MODE",
    "DEVICE_FIELDS",
    "KV_BYTES",
    "MODE_FIELDS",
    "PRESETS",
    "SCALE_BYTES",
    "SIGLIP_B16_256",
    "WEIGHT_DTYPES",
    "Device",
    "ModelDescription",
    "OrinData",
    "OrinEstimate",
    "Phase",
    "PowerMode",
    "Precision",
    "Rates",
    "ReportTokens",
    "VisionDescription",
    "estimate_report",
    "get_device",
    "known_devices",
    "load_data",
    "mode_rates",
    "parse_data",
    "precision_from_manifest",
    "preset",
    "read_bundle",
    "reference_checks",
    "shape_from_params",
]
