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
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

from edgekit.compat import tomllib  # tomli on JetPack 6's Python 3.10
from edgekit.decoder_shape import DecoderShape
from edgekit.errors import ConfigError

DATA_FILE = "devices.toml"
DEFAULT_DEVICE = "agx-orin-64"
DEFAULT_MODE = "MAXN"
WEIGHT_DTYPES = ("fp32", "fp16", "int8", "int4")
COMPUTE_DTYPES = ("fp32", "fp16", "int8")
_BYTES = {"fp32": 4.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5}
KV_BYTES = 2.0  # the engine keeps K and V in FP16
SCALE_BYTES = 2.0  # one FP16 scale per block of a blocked INT4/INT8 weight


# --- the data file ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PowerMode:
    """One nvpmodel mode: its budget and the caps it sets (device maxima where the mode leaves them free)."""

    name: str
    nvpmodel_id: int
    nvpmodel_name: str
    budget_w: float
    gpu_tpcs: int
    gpu_mhz: float
    emc_mhz: float
    dla_mhz: float
    unconstrained: tuple[str, ...]
    source: str


@dataclass(frozen=True)
class Device:
    id: str
    name: str
    label: str  # the model part of the figure label: estimated:orin-<label>-<mode>
    gpu_tpcs: int
    gpu_cuda_cores: int
    gpu_tensor_cores: int
    gpu_max_mhz: float
    dla_cores: int
    dla_max_mhz: float
    memory_gb: float
    memory_bus_bits: int
    emc_max_mhz: float
    memory_bandwidth_gbs: float
    power_min_w: float
    power_max_w: float
    total_sparse_int8_tops: float
    modes: dict[str, PowerMode]
    provenance: dict[str, str]
    unverified: tuple[str, ...] = ()

    def mode(self, name: str) -> PowerMode:
        """The mode called `name` (case-insensitive; nvpmodel's own names such as MODE_30W work too)."""
        want = str(name).strip().upper()
        for m in self.modes.values():
            if want in (m.name.upper(), m.nvpmodel_name.upper(), f"MODE_{m.name.upper()}"):
                return m
        raise ConfigError(f"{self.id} has no power mode '{name}' (known: {', '.join(self.modes)})")


@dataclass(frozen=True)
class OrinData:
    devices: dict[str, Device]
    architecture: dict[str, float]
    assumptions: dict[str, float]
    sources: dict[str, dict[str, str]]
    references: dict[str, dict[str, Any]]
    raw: dict[str, Any] = field(repr=False, compare=False)


DEVICE_FIELDS = tuple(f.name for f in dataclasses.fields(Device) if f.name not in ("id", "modes", "provenance"))
MODE_FIELDS = tuple(f.name for f in dataclasses.fields(PowerMode) if f.name != "name")


@functools.lru_cache(maxsize=1)
def load_data() -> OrinData:
    """devices.toml as shipped in the package (importlib.resources, so the wheel finds it as the checkout does)."""
    text = files(__package__ or "edgekit.targets.orin").joinpath(DATA_FILE).read_text(encoding="utf-8")
    return parse_data(tomllib.loads(text), DATA_FILE)


def parse_data(raw: dict[str, Any], where: str) -> OrinData:
    """Validate the data file: a missing field or an unknown source is one error naming the device and field."""
    sources = raw.get("sources", {})
    devices = {}
    for dev_id, d in raw.get("devices", {}).items():
        missing = [f for f in DEVICE_FIELDS if f not in d and f != "unverified"]
        if missing:
            raise ConfigError(f"device '{dev_id}' lacks {', '.join(missing)}", where)
        modes = {}
        for mode_name, m in d.get("modes", {}).items():
            lacking = [f for f in MODE_FIELDS if f not in m]
            if lacking:
                raise ConfigError(f"device '{dev_id}' mode '{mode_name}' lacks {', '.join(lacking)}", where)
            if m["source"] not in sources:
                raise ConfigError(f"device '{dev_id}' mode '{mode_name}' cites unknown source '{m['source']}'", where)
            modes[mode_name] = PowerMode(name=mode_name, **{**m, "unconstrained": tuple(m["unconstrained"])})
        if not modes:
            raise ConfigError(f"device '{dev_id}' has no power modes", where)
        provenance = dict(d.get("provenance", {}))
        for f, src in provenance.items():
            if src not in sources:
                raise ConfigError(f"device '{dev_id}' field '{f}' cites unknown source '{src}'", where)
        fields_ = {f: d[f] for f in DEVICE_FIELDS if f in d}
        fields_["unverified"] = tuple(d.get("unverified", ()))
        devices[dev_id] = Device(id=dev_id, modes=modes, provenance=provenance, **fields_)
    arch = {k: float(v) for k, v in raw.get("architecture", {}).items() if k != "provenance"}
    assumptions = {k: float(v["value"]) for k, v in raw.get("assumptions", {}).items()}
    return OrinData(devices, arch, assumptions, sources, raw.get("references", {}), raw)


def known_devices() -> dict[str, tuple[str, ...]]:
    """Device id -> its power-mode names, in the data file's order."""
    return {dev_id: tuple(d.modes) for dev_id, d in load_data().devices.items()}


def get_device(device: str | Device) -> Device:
    """A device by id (agx-orin-64) or label (agx64); a `Device` passes through (tests vary one field)."""
    if isinstance(device, Device):
        return device
    devices = load_data().devices
    want = str(device).strip().lower()
    for d in devices.values():
        if want in (d.id, d.label):
            return d
    raise ConfigError(f"unknown Orin device '{device}' (known: {', '.join(devices)})")


# --- what a mode can do -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rates:
    """Peak rates of one device in one power mode (before any efficiency assumption)."""

    fp16_tflops: float  # dense FP16 Tensor Core
    int8_tops: float  # dense INT8 Tensor Core
    fp32_tflops: float  # CUDA cores
    dla_int8_tops: float  # dense INT8, all DLAs
    bandwidth_gbs: float
    gpu_sparse_int8_tops: float  # the headline-style figure, to compare with NVIDIA's tables

    def compute(self, dtype: str) -> float:
        """Dense peak in FLOP/s (or op/s) for a compute precision."""
        return {"fp16": self.fp16_tflops, "int8": self.int8_tops, "fp32": self.fp32_tflops}[dtype] * 1e12


def mode_rates(device: Device, mode: PowerMode, arch: dict[str, float] | None = None) -> Rates:
    a = arch if arch is not None else load_data().architecture
    tpc_hz = mode.gpu_tpcs * mode.gpu_mhz * 1e6
    fp16 = a["dense_fp16_flops_per_tpc_per_clock"] * tpc_hz / 1e12
    sparse_int8 = a["sparse_int8_ops_per_tpc_per_clock"] * tpc_hz / 1e12
    dla = a["dla_sparse_int8_ops_per_core_per_clock"] / 2 * device.dla_cores * mode.dla_mhz * 1e6 / 1e12
    bw = device.memory_bus_bits / 8 * a["transfers_per_emc_clock"] * mode.emc_mhz * 1e6 / 1e9
    return Rates(
        fp16_tflops=fp16,
        int8_tops=2 * fp16,
        fp32_tflops=a["fp32_flops_per_tpc_per_clock"] * tpc_hz / 1e12,
        dla_int8_tops=dla,
        bandwidth_gbs=bw,
        gpu_sparse_int8_tops=sparse_int8,
    )


# --- what is being run --------------------------------------------------------------------------------------------


def _positive_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"model shape field '{name}' must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class VisionShape:
    """A ViT run per frame (patch embedding, `layers` pre-norm blocks), pooled, then a 2-layer connector."""

    image_size: int
    patch_size: int
    hidden: int
    layers: int
    mlp: int
    channels: int = 3
    frames: int = 1
    pool_stride: int = 1  # spatial pooling of the patch grid before the connector
    connector_in: int = 0  # input width of the connector; 0: the encoder's width
    tiles: int = 1  # tower inputs per frame, each its own image tokens (Idefics3's split: rows x cols + global)
    extra_tokens: int = 0  # image tokens no tower input makes (LLaVA-NeXT's image_newline, one per feature row)

    def __post_init__(self) -> None:
        for name in (
            "image_size",
            "patch_size",
            "hidden",
            "layers",
            "mlp",
            "channels",
            "frames",
            "pool_stride",
            "tiles",
        ):
            _positive_int(f"vision.{name}", getattr(self, name))

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def image_tokens(self) -> int:
        return self.tiles * (self.image_size // self.patch_size // self.pool_stride) ** 2 + self.extra_tokens

    def encoder_params(self) -> int:
        d, m = self.hidden, self.mlp
        return self.layers * (4 * d * d + 2 * d * m) + self.channels * self.patch_size**2 * d

    def connector_params(self, out_hidden: int) -> int:
        return (self.connector_in or self.hidden) * out_hidden + out_hidden * out_hidden

    def flops(self, out_hidden: int) -> float:
        """All frames through the encoder (GEMMs and attention), then the connector on the pooled tokens."""
        t, d = self.patches, self.hidden
        per_input = 2 * t * self.encoder_params() + self.layers * 4 * t * t * d
        return self.frames * self.tiles * per_input + 2 * self.image_tokens * self.connector_params(out_hidden)


@dataclass(frozen=True)
class ModelShape(DecoderShape):
    """A LLaMA-style decoder (RMSNorm, RoPE, GQA, SwiGLU) with an optional vision encoder."""

    vision: VisionShape | None = None

    def embedding_params(self) -> int:
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    def vision_params(self) -> int:
        return 0 if self.vision is None else self.vision.encoder_params() + self.vision.connector_params(self.hidden)

    def total_params(self) -> float:
        return self.decoder_params() + self.lm_head_params() + self.embedding_params() + self.vision_params()

    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * KV_BYTES

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["params"] = self.total_params()
        d["image_tokens"] = self.vision.image_tokens if self.vision else 0
        return d

    @classmethod
    def from_model_config(cls, config, name: str = "radreport-tiny") -> ModelShape:
        """edgekit's own ModelConfig (edgekit/export/model_config.py): frames pooled by mean and std, so the
        connector takes twice the encoder's width."""
        c = config
        vision = VisionShape(
            image_size=c.image_size,
            patch_size=c.patch_size,
            hidden=c.vision_hidden,
            layers=c.vision_layers,
            mlp=c.vision_mlp,
            channels=1,
            frames=c.num_frames,
            pool_stride=c.pool_stride,
            connector_in=2 * c.vision_hidden,
        )
        dims = (c.hidden, c.layers, c.heads, c.kv_heads, c.head_dim, c.intermediate, c.vocab_size)
        return cls(name, *dims, False, vision)

    @classmethod
    def from_hf_config(cls, cfg: dict, name: str = "hf") -> ModelShape:
        """An imported VLM's config.json (a bundle's `model_config`): the language model from `text_config`, the
        tower from `vision_config` at the depth edgekit built (`edgekit_vlm.tower_layers`), Idefics3's pixel
        shuffle as the pooling (its connector takes the shuffled width) and its image splitting as tiles (rows x
        cols + the global image, each through the tower)."""
        from edgekit.hf.config import decoder_shape_fields, language_model_config

        text = decoder_shape_fields(language_model_config(cfg), "config.json text_config")
        v = cfg.get("vision_config") or {}
        built = cfg.get("edgekit_vlm") or {}
        vision = None
        if v and built.get("family") == "qwen2_vl":
            vision = _qwen2_vl_vision(v, built)
        elif v:
            sf = int(cfg.get("scale_factor") or 1) if built.get("family") == "idefics3" else 1
            hidden = int(v["hidden_size"])
            vision = VisionShape(
                image_size=int(v["image_size"]),
                patch_size=int(v["patch_size"]),
                hidden=hidden,
                layers=int(built.get("tower_layers") or v["num_hidden_layers"]),
                mlp=int(v["intermediate_size"]),
                channels=int(v.get("num_channels", 3)),
                pool_stride=sf,
                connector_in=hidden * sf * sf,
                tiles=(split["rows"] * split["cols"] + 1) if (split := built.get("image_splitting")) else 1,
            )
            counted = built.get("image_tokens")  # the import's own count (LLaVA-NeXT adds a newline per row)
            if isinstance(counted, int) and counted > vision.image_tokens:
                vision = dataclasses.replace(vision, extra_tokens=counted - vision.image_tokens)
        dims = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
        return cls(
            name,
            *(int(text[k]) for k in dims),
            int(text["intermediate_size"]),
            int(text["vocab_size"]),
            text["tie_word_embeddings"],
            vision,
        )


def _qwen2_vl_vision(v: dict, built: dict) -> VisionShape:
    """Qwen2-VL / Qwen2.5-VL's tower at the fixed side edgekit built (`edgekit_vlm.image_size`): every patch
    through the blocks, the 2 x 2 merge as the pooling (the merger takes 4 patches' width), the still image's
    temporal copies as input channels of the patch embedding. Qwen2.5-VL's SwiGLU counts three matrices (mlp =
    1.5 x intermediate) and its windowed blocks are costed as full attention: edgekit's graph computes every
    score and masks the ones outside a window (a constant block mask, edgekit.hf.qwen2_vl), so that is what the
    engine runs; a window-by-window kernel would do 1 / windows of it."""
    merge = int(v.get("spatial_merge_size", 2))
    if built.get("model_type") == "qwen2_5_vl":
        hidden, mlp = int(v["hidden_size"]), int(1.5 * int(v["intermediate_size"]))
    else:
        hidden = int(v["embed_dim"])
        mlp = int(hidden * float(v.get("mlp_ratio", 4)))
    return VisionShape(
        image_size=int(built["image_size"]),
        patch_size=int(v["patch_size"]),
        hidden=hidden,
        layers=int(built.get("tower_layers") or v["depth"]),
        mlp=mlp,
        channels=int(v.get("in_channels", 3)) * int(v.get("temporal_patch_size", 2)),
        pool_stride=merge,
        connector_in=hidden * merge * merge,
    )


# SigLIP-B/16 at 256 px: 256 image tokens, ~86M parameters (the usual vision tower of a ~1B VLM)
SIGLIP_B16_256 = VisionShape(image_size=256, patch_size=16, hidden=768, layers=12, mlp=3072)


def shape_from_params(
    params: float,
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    vocab: int = 32000,
    head_dim: int | None = None,
    tied_embeddings: bool = False,
    vision: VisionShape | None = SIGLIP_B16_256,
    name: str | None = None,
) -> ModelShape:
    """A shape for a model known by its size: the MLP width is solved so the parameters add up to `params`
    (vision tower and embeddings included), so a 1.2B model can be estimated without a bundle."""
    hd = head_dim or hidden // heads
    probe = ModelShape("probe", hidden, layers, heads, kv_heads, hd, 1, vocab, tied_embeddings, vision)
    rest = params - probe.lm_head_params() - probe.embedding_params() - probe.vision_params()
    attn = layers * (2 * hidden * heads * hd + 2 * hidden * kv_heads * hd)
    intermediate = int(round((rest - attn) / (3 * hidden * layers)))
    if intermediate < 1:
        raise ConfigError(
            f"model shape field 'params': {params:.3g} is too small for {layers} layers of width {hidden} "
            "with this vocabulary and vision tower"
        )
    label = name or f"{params / 1e9:.3g}b"
    return ModelShape(label, hidden, layers, heads, kv_heads, hd, intermediate, vocab, tied_embeddings, vision)


def _seed_shape() -> ModelShape:
    # The seed names only "a 1.2B medical VLM". Assumed: a TinyLlama-1.1B-shaped decoder with a SigLIP-B/16 tower
    # and a LLaVA-style 2-layer connector: 1.19B parameters, 256 image tokens.
    return ModelShape("seed-1.2b", 2048, 22, 32, 4, 64, 5632, 32000, False, SIGLIP_B16_256)


def _radreport_tiny() -> ModelShape:
    from edgekit.export.model_config import ModelConfig
    from edgekit.plugins import get_model_family

    return ModelShape.from_model_config(ModelConfig.load(get_model_family().weights_dir() / "config.json"))


PRESETS = {
    "seed-1.2b": _seed_shape,
    "radreport-tiny": _radreport_tiny,
    # decoders of NVIDIA's published Orin Nano tokens/s ([references] in devices.toml), from their HF configs
    "llama-3.1-8b": lambda: ModelShape("llama-3.1-8b", 4096, 32, 32, 8, 128, 14336, 128256, False),
    "llama-3.2-3b": lambda: ModelShape("llama-3.2-3b", 3072, 28, 24, 8, 128, 8192, 128256, True),
    "smollm2-1.7b": lambda: ModelShape("smollm2-1.7b", 2048, 24, 32, 32, 64, 8192, 49152, True),
}


def preset(name: str) -> ModelShape:
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset '{name}' (known: {', '.join(PRESETS)})")
    return PRESETS[name]()


@dataclass(frozen=True)
class Precision:
    """Weight formats as the engine holds them. Weight-only INT4/INT8 computes in FP16; FP32 weights compute on
    CUDA cores; `compute="int8"` is W8A8 (INT8 activations too)."""

    weights: str = "fp16"  # the decoder's matmuls
    lm_head: str | None = None  # default: as `weights`
    vision: str | None = None  # default: as `weights`
    embedding: str = "fp16"
    block: int = 32  # block of a blocked INT4/INT8 weight (one FP16 scale each)
    compute: str | None = None  # default: fp32 for fp32 weights, else fp16
    sparse24: bool = False
    head_keep: float = 1.0  # share of attention heads left after head pruning

    def __post_init__(self) -> None:
        for name in ("weights", "lm_head", "vision", "embedding"):
            v = getattr(self, name)
            if v is not None and v not in WEIGHT_DTYPES:
                raise ConfigError(f"field '{name}' = {v!r} (expected one of {', '.join(WEIGHT_DTYPES)})")
        if self.compute is not None and self.compute not in COMPUTE_DTYPES:
            raise ConfigError(f"field 'compute' = {self.compute!r} (expected one of {', '.join(COMPUTE_DTYPES)})")
        _positive_int("block", self.block)
        if not 0.0 < self.head_keep <= 1.0:
            raise ConfigError(f"field 'head_keep' = {self.head_keep!r} (expected 0 < keep <= 1)")

    @property
    def compute_dtype(self) -> str:
        return self.compute or ("fp32" if self.weights == "fp32" else "fp16")

    def bytes_per_weight(self, dtype: str, sparse_fraction: float = 1.0) -> float:
        scales = SCALE_BYTES / self.block if dtype in ("int4", "int8") else 0.0
        if self.sparse24 and dtype in ("fp16", "int8"):
            return _BYTES[dtype] * sparse_fraction + scales
        return _BYTES[dtype] + scales

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(lm_head=self.lm_head or self.weights, vision=self.vision or self.weights, compute=self.compute_dtype)
        return d


# --- bundles ------------------------------------------------------------------------------------------------------


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
    from edgekit.errors import BundleError, EdgekitError
    from edgekit.export.model_config import ModelConfig
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
        raw = json.loads((root / comps["model_config"].path).read_text())
        if "model_type" in raw:  # an imported Hugging Face VLM
            shape = ModelShape.from_hf_config(raw, name=manifest.name)
        else:
            shape = ModelShape.from_model_config(
                ModelConfig.load(root / comps["model_config"].path), name=manifest.name
            )
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
    return shape, precision, Report(prompt_tokens, new_tokens), notes, facts


# --- the estimate -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Report:
    """The workload of one report: text prompt tokens and generated tokens (image tokens come from the shape)."""

    prompt_tokens: int = 32
    new_tokens: int = 96

    def __post_init__(self) -> None:
        if isinstance(self.prompt_tokens, bool) or not isinstance(self.prompt_tokens, int) or self.prompt_tokens < 0:
            raise ConfigError(f"field 'prompt_tokens' = {self.prompt_tokens!r} (expected an integer >= 0)")
        if isinstance(self.new_tokens, bool) or not isinstance(self.new_tokens, int) or self.new_tokens < 1:
            raise ConfigError(f"field 'new_tokens' = {self.new_tokens!r} (expected an integer >= 1)")


@dataclass
class Phase:
    name: str  # "vision" | "prefill" | "decode"
    compute_s: float = 0.0  # math-unit busy time
    memory_s: float = 0.0  # DRAM busy time
    overhead_s: float = 0.0  # launches and host work, neither busy
    flops: float = 0.0
    bytes: float = 0.0
    steps: int = 1
    power_w: float = 0.0
    on: str = "gpu"
    critical_s: float | None = None  # sum over steps of max(compute, memory); None: one step

    @property
    def time_s(self) -> float:
        critical = max(self.compute_s, self.memory_s) if self.critical_s is None else self.critical_s
        return critical + self.overhead_s

    @property
    def energy_j(self) -> float:
        return self.power_w * self.time_s

    @property
    def bound(self) -> str:
        if self.overhead_s > max(self.compute_s, self.memory_s):
            return "overhead"
        return "compute" if self.compute_s >= self.memory_s else "memory"

    def to_dict(self) -> dict:
        return {
            "phase": self.name,
            "on": self.on,
            "steps": self.steps,
            "time_ms": self.time_s * 1e3,
            "compute_ms": self.compute_s * 1e3,
            "memory_ms": self.memory_s * 1e3,
            "overhead_ms": self.overhead_s * 1e3,
            "bound": self.bound,
            "power_w": self.power_w,
            "energy_j": self.energy_j,
            "gflops": self.flops / 1e9,
            "gbytes": self.bytes / 1e9,
        }


@dataclass
class OrinEstimate:
    device: Device
    mode: PowerMode
    shape: ModelShape
    precision: Precision
    report: Report
    rates: Rates
    phases: list[Phase]
    memory: dict[str, float]
    assumptions: dict[str, float]
    notes: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def source(self) -> str:
        return f"estimated:orin-{self.device.label}-{self.mode.name.lower().replace('_', '-')}"

    @property
    def latency_ms(self) -> float:
        return sum(p.time_s for p in self.phases) * 1e3

    @property
    def energy_j(self) -> float:
        return sum(p.energy_j for p in self.phases)

    @property
    def avg_power_w(self) -> float:
        return self.energy_j / (self.latency_ms / 1e3)

    @property
    def ms_per_token(self) -> float:
        decode = self.phase("decode")
        return decode.time_s * 1e3 / decode.steps if decode.steps else 0.0

    @property
    def breakdown(self) -> list[dict]:
        return [p.to_dict() for p in self.phases]

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)

    def figure(self) -> dict:
        """The estimate as a bundle-manifest figure: numbers plus where they come from."""
        return {
            "latency_ms": round(self.latency_ms, 3),
            "energy_j": round(self.energy_j, 4),
            "avg_power_w": round(self.avg_power_w, 2),
            "ms_per_token": round(self.ms_per_token, 4),
            "memory_gb": round(self.memory["total_gb"], 3),
            "prompt_tokens": self.report.prompt_tokens,
            "new_tokens": self.report.new_tokens,
            "source": f"{self.source} (edgekit Orin cost model, edgekit.targets.orin.estimate, from NVIDIA's "
            f"published tables for the {self.device.name} in nvpmodel mode {self.mode.name}; not measured on a device)",
        }

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "device": self.device.id,
            "device_name": self.device.name,
            "mode": self.mode.name,
            "latency_ms": self.latency_ms,
            "energy_j": self.energy_j,
            "avg_power_w": self.avg_power_w,
            "ms_per_token": self.ms_per_token,
            "breakdown": self.breakdown,
            "memory": self.memory,
            "rates": dataclasses.asdict(self.rates),
            "budget_w": self.mode.budget_w,
            "model": self.shape.to_dict(),
            "precision": self.precision.to_dict(),
            "report": dataclasses.asdict(self.report),
            "assumptions": self.assumptions,
            "notes": self.notes,
            **self.facts,
        }


def _phase_power(phase: Phase, mode: PowerMode, a: dict[str, float], dla_power_ratio: float = 1.0) -> float:
    """idle + (budget - idle) x utilisation; utilisation weighs how much of the phase the math units and DRAM
    are busy. A DLA phase draws its math share at 1/dla_power_ratio (NVIDIA: DLA is 3-5x more efficient)."""
    t = phase.time_s
    if t <= 0:
        return 0.0
    idle = a["idle_fraction"] * mode.budget_w
    u = a["compute_power_share"] * (phase.compute_s / t) / dla_power_ratio + a["memory_power_share"] * (
        phase.memory_s / t
    )
    return idle + (mode.budget_w - idle) * min(1.0, u)


def estimate_report(
    model: str | Path | ModelShape,
    device: str | Device = DEFAULT_DEVICE,
    mode: str = DEFAULT_MODE,
    *,
    weights: str | Precision | None = None,
    prompt_tokens: int | None = None,
    new_tokens: int | None = None,
    vision_on: str = "gpu",
    assumptions: dict[str, float] | None = None,
) -> OrinEstimate:
    """Latency and energy of one report: `model` is a bundle (directory or .ekb), a preset name or a `ModelShape`;
    `weights` is a dtype name or a `Precision`: it replaces a bundle's own formats (read from its manifest when
    omitted); a shape runs in FP16 unless told otherwise.
    `assumptions` overrides named entries of devices.toml's [assumptions] (for sensitivity studies)."""
    data = load_data()
    dev = get_device(device)
    pm = dev.mode(mode)
    a = dict(data.assumptions)
    for k, v in (assumptions or {}).items():
        if k not in a:
            raise ConfigError(f"unknown assumption '{k}' (known: {', '.join(a)})")
        a[k] = float(v)
    notes: list[str] = []
    facts: dict[str, Any] = {}
    report = Report()
    precision = Precision()
    if isinstance(model, ModelShape):
        shape = model
    elif isinstance(model, str) and model in PRESETS:
        shape = preset(model)
    else:
        path = Path(model)
        if not path.exists():
            raise ConfigError(
                f"'{model}' is neither a bundle (directory or .ekb) nor a model preset (presets: {', '.join(PRESETS)})"
            )
        shape, precision, report, bundle_notes, facts = read_bundle(path)
        notes += bundle_notes
    if isinstance(weights, Precision):
        precision = weights
    elif weights is not None:
        precision = Precision(weights=weights)
    report = Report(
        report.prompt_tokens if prompt_tokens is None else prompt_tokens,
        report.new_tokens if new_tokens is None else new_tokens,
    )
    if vision_on not in ("gpu", "dla"):
        raise ConfigError(f"field 'vision_on' = {vision_on!r} (expected gpu or dla)")

    rates = mode_rates(dev, pm, data.architecture)
    bw = rates.bandwidth_gbs * 1e9 * a["bandwidth_fraction"]
    launch = a["kernel_overhead_us"] * 1e-6
    cdtype = precision.compute_dtype
    sparse_math = a["sparse24_math_speedup"] if precision.sparse24 and precision.weights in ("fp16", "int8") else 1.0
    wbytes = functools.partial(precision.bytes_per_weight, sparse_fraction=a["sparse24_storage_fraction"])
    dec_w = shape.decoder_params(precision.head_keep) * wbytes(precision.weights)
    head_w = shape.lm_head_params() * wbytes(precision.lm_head or precision.weights)
    phases = []

    image_tokens = 0
    vision_bytes = 0.0
    if shape.vision is not None:
        v = shape.vision
        image_tokens = v.image_tokens
        vdtype = precision.vision or precision.weights
        vision_bytes = shape.vision_params() * precision.bytes_per_weight(vdtype)
        ph = Phase("vision", flops=v.flops(shape.hidden), bytes=vision_bytes, on=vision_on)
        ph.memory_s = vision_bytes / bw
        if vision_on == "dla":
            if dev.dla_cores == 0 or pm.dla_mhz <= 0:
                raise ConfigError(f"{dev.id} has no DLA in mode {pm.name}: run the vision encoder on the GPU")
            if vdtype != "int8":
                raise ConfigError(
                    f"vision on the DLA needs INT8 vision weights (got {vdtype}): the DLA's FP16 rate is not in "
                    "the published tables this model reads"
                )
            ph.compute_s = ph.flops / (rates.dla_int8_tops * 1e12 * a["dla_efficiency"])
            ph.overhead_s = launch  # one DLA loadable
        else:
            vrate = rates.compute("fp32" if vdtype == "fp32" else "int8" if cdtype == "int8" else "fp16")
            ph.compute_s = ph.flops / (vrate * a["vision_efficiency"])
            ph.overhead_s = v.layers * a["kernels_per_vision_layer"] * launch
        phases.append(ph)

    # prefill: every prompt position through every matmul; the LM head only for the last position
    p = image_tokens + report.prompt_tokens
    hq = shape.heads * precision.head_keep * shape.head_dim
    attn_prefill = shape.layers * 2 * 2 * hq * p * p / 2  # QK^T and PV, causal
    pre = Phase("prefill", steps=1)
    pre.flops = 2 * shape.decoder_params(precision.head_keep) * p + 2 * shape.lm_head_params() + attn_prefill
    pre.bytes = dec_w + head_w + p * shape.kv_bytes_per_token()
    pre.compute_s = pre.flops / (rates.compute(cdtype) * sparse_math * a["gemm_efficiency"])
    pre.memory_s = pre.bytes / bw
    pre.overhead_s = shape.layers * a["kernels_per_decoder_layer"] * launch
    phases.append(pre)

    # decode: the prefill yields the first token; each later one streams all weights and the KV cache so far
    dec = Phase("decode", steps=report.new_tokens - 1)
    per_token_overhead = shape.layers * a["kernels_per_decoder_layer"] * launch + a["host_overhead_per_token_ms"] / 1e3
    token_rate = rates.compute(cdtype) * sparse_math * a["gemm_efficiency"]
    for i in range(dec.steps):
        context = p + 1 + i  # tokens in the cache, this one included
        kv_read = context * shape.kv_bytes_per_token()
        nbytes = dec_w + head_w + kv_read + shape.hidden * precision.bytes_per_weight(precision.embedding)
        matmuls = shape.decoder_params(precision.head_keep) + shape.lm_head_params()
        flops = 2 * matmuls + shape.layers * 4 * hq * context
        t_mem, t_comp = nbytes / bw, flops / token_rate
        dec.memory_s += t_mem  # a step lasts as long as its slower side; the other overlaps it
        dec.compute_s += t_comp
        dec.critical_s = (dec.critical_s or 0.0) + max(t_mem, t_comp)
        dec.bytes += nbytes
        dec.flops += flops
        dec.overhead_s += per_token_overhead
    phases.append(dec)

    for ph in phases:
        ratio = 3.0 if ph.on == "dla" else 1.0
        ph.power_w = _phase_power(ph, pm, a, ratio)

    total_tokens = p + report.new_tokens
    weights_gb = (
        dec_w + head_w + shape.embedding_params() * precision.bytes_per_weight(precision.embedding) + vision_bytes
    ) / 1e9
    kv_gb = total_tokens * shape.kv_bytes_per_token() / 1e9
    memory = {
        "weights_gb": weights_gb,
        "kv_cache_gb": kv_gb,
        "runtime_gb_assumed": a["runtime_memory_gb"],
        "total_gb": weights_gb + kv_gb + a["runtime_memory_gb"],
        "device_memory_gb": dev.memory_gb,
    }
    if memory["total_gb"] > dev.memory_gb:
        notes.append(f"does not fit: needs {memory['total_gb']:.1f} GB of the module's {dev.memory_gb:g} GB")
    if precision.sparse24 and sparse_math > 1:
        notes.append("2:4 sparsity counted at the peak speed-up: an upper bound (TensorRT uses it where faster)")
    if pm.unconstrained:
        notes.append(f"mode {pm.name} leaves {', '.join(pm.unconstrained)} unconstrained: device maxima are used")
    return OrinEstimate(dev, pm, shape, precision, report, rates, phases, memory, a, notes, facts)


def reference_checks() -> list[dict]:
    """The estimate's decode tokens/s against NVIDIA's published Orin measurements ([references] in the data
    file): the only outside check this model has until someone runs it on a device."""
    out = []
    for ref_id, r in load_data().references.items():
        est = estimate_report(
            preset(r["model"]),
            r["device"],
            r["mode"],
            weights=Precision(weights=r["weights"], block=int(r.get("block", 32))),
            prompt_tokens=16,
            new_tokens=129,
        )
        tps = 1e3 / est.ms_per_token
        out.append(
            {
                "reference": ref_id,
                "model": r["model"],
                "device": r["device"],
                "mode": r["mode"],
                "published_tokens_per_s": r["decode_tokens_per_s"],
                "estimated_tokens_per_s": tps,
                "ratio": tps / r["decode_tokens_per_s"],
                "source": r["source"],
            }
        )
    return out
