"""The estimate of one report: its phases (vision, prefill, decode), each costed from the mode's rates and the
weights it streams, their power and energy, and the checks against NVIDIA's published tokens/s.

Why one module: this is the cost model's formula (docs/orin-estimate.md derives it); the data, shapes and bundles it
reads live beside it. `estimate_report` only resolves its inputs and hands each phase to a function of its own.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgekit.errors import ConfigError
from edgekit.model_description import VisionDescription

from .bundle import read_bundle
from .data import DEFAULT_DEVICE, DEFAULT_MODE, Device, PowerMode, get_device, load_data
from .model import KV_BYTES, PRESETS, ModelDescription, Precision, ReportTokens, preset
from .rates import Rates, mode_rates


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
    shape: ModelDescription
    precision: Precision
    report: ReportTokens
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


@dataclass(frozen=True)
class _Costing:
    """What every phase of one estimate is costed with, worked out once: the mode's rates, the assumptions, the
    effective bandwidth and GEMM rate, and the bytes of the weights each phase streams."""

    shape: ModelDescription
    precision: Precision
    rates: Rates
    a: dict[str, float]
    bw: float  # effective DRAM bandwidth, bytes/s
    launch: float  # one kernel launch, s
    sparse_math: float  # the 2:4 speed-up counted (1.0: none)
    gemm_rate: float  # the decoder's matmuls at its compute precision, op/s
    decoder_bytes: float
    head_bytes: float
    vision_bytes: float

    @classmethod
    def of(cls, shape: ModelDescription, precision: Precision, rates: Rates, a: dict[str, float]) -> _Costing:
        sparse_math = (
            a["sparse24_math_speedup"] if precision.sparse24 and precision.weights in ("fp16", "int8") else 1.0
        )
        wbytes = functools.partial(precision.bytes_per_weight, sparse_fraction=a["sparse24_storage_fraction"])
        vision_bytes = 0.0
        if shape.vision is not None:
            vision_bytes = shape.vision_params() * precision.bytes_per_weight(precision.vision or precision.weights)
        return cls(
            shape,
            precision,
            rates,
            a,
            bw=rates.bandwidth_gbs * 1e9 * a["bandwidth_fraction"],
            launch=a["kernel_overhead_us"] * 1e-6,
            sparse_math=sparse_math,
            gemm_rate=rates.compute(precision.compute_dtype) * sparse_math * a["gemm_efficiency"],
            decoder_bytes=shape.decoder_params(precision.head_keep) * wbytes(precision.weights),
            head_bytes=shape.lm_head_params() * wbytes(precision.lm_head or precision.weights),
            vision_bytes=vision_bytes,
        )

    @property
    def query_width(self) -> float:
        """Query heads x head_dim left after head pruning: what the attention scores scale with."""
        return self.shape.heads * self.precision.head_keep * self.shape.head_dim


def estimate_report(
    model: str | Path | ModelDescription,
    device: str | Device = DEFAULT_DEVICE,
    mode: str = DEFAULT_MODE,
    *,
    weights: str | Precision | None = None,
    prompt_tokens: int | None = None,
    new_tokens: int | None = None,
    vision_on: str = "gpu",
    assumptions: dict[str, float] | None = None,
) -> OrinEstimate:
    """Latency and energy of one report: `model` is a bundle (directory or .ekb), a preset name or a `ModelDescription`;
    `weights` is a dtype name or a `Precision`: it replaces a bundle's own formats (read from its manifest when
    omitted); a shape runs in FP16 unless told otherwise.
    `assumptions` overrides named entries of devices.toml's [assumptions] (for sensitivity studies)."""
    data = load_data()
    dev = get_device(device)
    pm = dev.mode(mode)
    a = _assumptions(data.assumptions, assumptions)
    shape, precision, report, notes, facts = _workload(model, weights, prompt_tokens, new_tokens)
    if vision_on not in ("gpu", "dla"):
        raise ConfigError(f"field 'vision_on' = {vision_on!r} (expected gpu or dla)")

    c = _Costing.of(shape, precision, mode_rates(dev, pm, data.architecture), a)
    phases = [] if shape.vision is None else [_vision_phase(c, shape.vision, dev, pm, vision_on)]
    prompt = (0 if shape.vision is None else shape.vision.image_tokens) + report.prompt_tokens
    phases += [_prefill_phase(c, prompt), _decode_phase(c, prompt, report.new_tokens)]
    for ph in phases:
        ratio = 3.0 if ph.on == "dla" else 1.0
        ph.power_w = _phase_power(ph, pm, a, ratio)

    memory = _memory(c, dev, prompt + report.new_tokens)
    notes += _caveats(c, dev, pm, memory)
    return OrinEstimate(dev, pm, shape, precision, report, c.rates, phases, memory, a, notes, facts)


def _assumptions(defaults: dict[str, float], overrides: dict[str, float] | None) -> dict[str, float]:
    """devices.toml's [assumptions] with the caller's named overrides; a name the file lacks is refused."""
    a = dict(defaults)
    for k, v in (overrides or {}).items():
        if k not in a:
            raise ConfigError(f"unknown assumption '{k}' (known: {', '.join(a)})")
        a[k] = float(v)
    return a


def _workload(
    model: str | Path | ModelDescription,
    weights: str | Precision | None,
    prompt_tokens: int | None,
    new_tokens: int | None,
) -> tuple[ModelDescription, Precision, ReportTokens, list[str], dict[str, Any]]:
    """(shape, precision, tokens, notes, facts) to estimate: a bundle's own, or a preset's or shape's in FP16 with
    the default report, each field replaced where the caller names it."""
    notes: list[str] = []
    facts: dict[str, Any] = {}
    report = ReportTokens()
    precision = Precision()
    if isinstance(model, ModelDescription):
        shape = model
    elif isinstance(model, str) and model in PRESETS:
        shape = preset(model)
    else:
        path = Path(model)
        if not path.exists():
            raise ConfigError(
                f"'{model}' is neither a bundle (directory or .ekb) nor a model preset (presets: {', '.join(PRESETS)})"
            )
        shape, precision, report, notes, facts = read_bundle(path)
    if isinstance(weights, Precision):
        precision = weights
    elif weights is not None:
        precision = Precision(weights=weights)
    report = ReportTokens(
        report.prompt_tokens if prompt_tokens is None else prompt_tokens,
        report.new_tokens if new_tokens is None else new_tokens,
    )
    return shape, precision, report, notes, facts


def _vision_phase(c: _Costing, v: VisionDescription, device: Device, mode: PowerMode, on: str) -> Phase:
    """Every frame and tile through the tower, then the connector: compute-bound, on the GPU at the vision weights'
    precision, or on the DLA, which needs INT8 vision weights (its FP16 rate is not in the published tables)."""
    vdtype = c.precision.vision or c.precision.weights
    ph = Phase("vision", flops=v.flops(c.shape.hidden), bytes=c.vision_bytes, on=on)
    ph.memory_s = c.vision_bytes / c.bw
    if on == "dla":
        if device.dla_cores == 0 or mode.dla_mhz <= 0:
            raise ConfigError(f"{device.id} has no DLA in mode {mode.name}: run the vision encoder on the GPU")
        if vdtype != "int8":
            raise ConfigError(
                f"vision on the DLA needs INT8 vision weights (got {vdtype}): the DLA's FP16 rate is not in "
                "the published tables this model reads"
            )
        ph.compute_s = ph.flops / (c.rates.dla_int8_tops * 1e12 * c.a["dla_efficiency"])
        ph.overhead_s = c.launch  # one DLA loadable
    else:
        cdtype = c.precision.compute_dtype
        vrate = c.rates.compute("fp32" if vdtype == "fp32" else "int8" if cdtype == "int8" else "fp16")
        ph.compute_s = ph.flops / (vrate * c.a["vision_efficiency"])
        ph.overhead_s = v.layers * c.a["kernels_per_vision_layer"] * c.launch
    return ph


def _prefill_phase(c: _Costing, prompt: int) -> Phase:
    """Every prompt position (image tokens included) through every matmul; the LM head only for the last one."""
    shape, precision = c.shape, c.precision
    attention = shape.layers * 2 * 2 * c.query_width * prompt * prompt / 2  # QK^T and PV, causal
    pre = Phase("prefill", steps=1)
    pre.flops = 2 * shape.decoder_params(precision.head_keep) * prompt + 2 * shape.lm_head_params() + attention
    pre.bytes = c.decoder_bytes + c.head_bytes + prompt * shape.kv_bytes_per_token(KV_BYTES)
    pre.compute_s = pre.flops / c.gemm_rate
    pre.memory_s = pre.bytes / c.bw
    pre.overhead_s = shape.layers * c.a["kernels_per_decoder_layer"] * c.launch
    return pre


def _decode_phase(c: _Costing, prompt: int, new_tokens: int) -> Phase:
    """The prefill yields the first token; each later one streams all weights and the KV cache so far. A step
    lasts as long as its slower side (bytes or math), the other overlapping it, plus its launches and host work."""
    shape, precision, a = c.shape, c.precision, c.a
    dec = Phase("decode", steps=new_tokens - 1)
    per_token_overhead = (
        shape.layers * a["kernels_per_decoder_layer"] * c.launch + a["host_overhead_per_token_ms"] / 1e3
    )
    for i in range(dec.steps):
        context = prompt + 1 + i  # tokens in the cache, this one included
        kv_read = context * shape.kv_bytes_per_token(KV_BYTES)
        nbytes = (
            c.decoder_bytes + c.head_bytes + kv_read + shape.hidden * precision.bytes_per_weight(precision.embedding)
        )
        matmuls = shape.decoder_params(precision.head_keep) + shape.lm_head_params()
        flops = 2 * matmuls + shape.layers * 4 * c.query_width * context
        t_mem, t_comp = nbytes / c.bw, flops / c.gemm_rate
        dec.memory_s += t_mem
        dec.compute_s += t_comp
        dec.critical_s = (dec.critical_s or 0.0) + max(t_mem, t_comp)
        dec.bytes += nbytes
        dec.flops += flops
        dec.overhead_s += per_token_overhead
    return dec


def _memory(c: _Costing, device: Device, tokens: int) -> dict[str, float]:
    """What the module must hold for one report: the weights, the KV cache of all its tokens, and the runtime's
    share (an assumption), against the module's memory."""
    shape, precision, a = c.shape, c.precision, c.a
    embedding_bytes = shape.embedding_params() * precision.bytes_per_weight(precision.embedding)
    weights_gb = (c.decoder_bytes + c.head_bytes + embedding_bytes + c.vision_bytes) / 1e9
    kv_gb = tokens * shape.kv_bytes_per_token(KV_BYTES) / 1e9
    return {
        "weights_gb": weights_gb,
        "kv_cache_gb": kv_gb,
        "runtime_gb_assumed": a["runtime_memory_gb"],
        "total_gb": weights_gb + kv_gb + a["runtime_memory_gb"],
        "device_memory_gb": device.memory_gb,
    }


def _caveats(c: _Costing, device: Device, mode: PowerMode, memory: dict[str, float]) -> list[str]:
    """Notes on where the estimate stretches: a model that does not fit, 2:4 counted at its peak, device maxima
    standing in for a mode's free clocks."""
    notes = []
    if memory["total_gb"] > device.memory_gb:
        notes.append(f"does not fit: needs {memory['total_gb']:.1f} GB of the module's {device.memory_gb:g} GB")
    if c.precision.sparse24 and c.sparse_math > 1:
        notes.append("2:4 sparsity counted at the peak speed-up: an upper bound (TensorRT uses it where faster)")
    if mode.unconstrained:
        notes.append(f"mode {mode.name} leaves {', '.join(mode.unconstrained)} unconstrained: device maxima are used")
    return notes


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
