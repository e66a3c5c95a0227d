"""Weight formats by name: how a quantizing pass writes its integers into a graph, and what each format can carry.

Why a registry of formats rather than a pass parameter naming a target: what a runtime reads (MatMulNBits, blocked
DequantizeLinear, ...) is a property of the format, and several targets read the same one (TensorRT and the X1
compiler both read `qdq-blocked`). A pass takes `format=NAME`; a target declares the names it accepts
(`edgekit.target.Target.weight_formats`, in order of preference); the build fills an unset `format` with the
first of those the pass can write and refuses one the target does not accept (`for_target`). A new target with a
new format registers it from its own package (`register_weight_format`) and names it there: no pass changes.

Constraints live on the format: whether it takes zero points (asymmetric), float zero points, negative scales,
which widths, the opset it needs, and what it stores (`uses`: a weight MatMul's B, a MatMul quantized with its
activations by ONNX Runtime, an embedding table). `WritesWeightFormat.format_refusal` turns them into one line
naming the pass's field at fault.

The deprecated `target=T` of the int4, int8 and qembed passes (edgekit <= 0.x) still parses: it stands for the
format target T takes for that pass, with a FutureWarning naming `format=`; a build for a target replaces it with
that target's choice, as the build always did.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from edgekit.errors import ConfigError

from .embed_encode import EmbeddingEncoder, encode_dequantize, encode_gather
from .int4_encode import Encoder, encode_matmulnbits, encode_qdq

# what a format can store (`WeightFormat.uses`)
MATMUL = "matmul"  # a weight MatMul's B, weight-only: the pass quantizes it and the format's `encode_matmul` writes it
MATMUL_DYNAMIC = "matmul-dynamic"  # a weight MatMul quantized with its activations by ONNX Runtime's quantizer
EMBEDDING = "embedding"  # a Gather's (vocab, hidden) table: the format's `encode_embedding` writes it


@dataclass(frozen=True)
class WeightFormat:
    """One way to write quantized weights into a graph, and what it can carry."""

    name: str
    label: str  # what pass reports say (`notes["encoding"]`), `{bits}` filled in: "DequantizeLinear-int{bits}"
    summary: str  # one line for docs and errors: what reads it
    uses: tuple[str, ...]  # MATMUL, MATMUL_DYNAMIC, EMBEDDING
    bits: tuple[int, ...] = (4, 8)
    encode_matmul: Encoder | None = None  # required for MATMUL
    encode_embedding: EmbeddingEncoder | None = None  # required for EMBEDDING
    zero_points: bool = False  # integer zero points: asymmetric weights; False: symmetric only
    float_zero_points: bool = False  # zero points off the integer grid (ORT's HQQ writes them)
    signed_scales: bool = False  # negative scales (the abs-max element exactly on code -8, as ORT's quantizer)
    min_opset: int | None = None  # default-domain opset the result needs (None: none beyond the model's)

    def __post_init__(self) -> None:
        if MATMUL in self.uses and self.encode_matmul is None:
            raise ValueError(f"weight format {self.name}: stores {MATMUL} weights but has no encode_matmul")
        if EMBEDDING in self.uses and self.encode_embedding is None:
            raise ValueError(f"weight format {self.name}: stores {EMBEDDING} tables but has no encode_embedding")

    def report_label(self, bits: int) -> str:
        return self.label.format(bits=bits)


FORMATS: dict[str, WeightFormat] = {}


def register_weight_format(fmt: WeightFormat) -> WeightFormat:
    """Add (or replace) a format; a target package calls this for a format of its own."""
    FORMATS[fmt.name] = fmt
    return fmt


def format_names() -> tuple[str, ...]:
    return tuple(FORMATS)


def weight_format(name: str, where: str = "format") -> WeightFormat:
    """The format called `name`. A name not registered yet may be a target's own: the registered targets'
    plug-ins are loaded (they register their formats on import) before it is refused, in one line."""
    if name not in FORMATS:
        _load_target_plugins()
    if name not in FORMATS:
        raise ConfigError(f"{where}: unknown weight format {name!r} (known: {', '.join(FORMATS)})")
    return FORMATS[name]


def _load_target_plugins() -> None:
    from edgekit.plugins import TARGETS, get_target

    for name in list(TARGETS):
        try:
            get_target(name)
        except ImportError:  # a target this install cannot load registers nothing here
            continue


register_weight_format(
    WeightFormat(
        name="matmulnbits",
        label="MatMulNBits",
        summary="ONNX Runtime's com.microsoft.MatMulNBits (4 or 8 bits, zero points integer or float)",
        uses=(MATMUL,),
        encode_matmul=encode_matmulnbits,
        zero_points=True,
        float_zero_points=True,
        signed_scales=True,
    )
)
register_weight_format(
    WeightFormat(
        name="qdq-blocked",
        label="DequantizeLinear-int{bits}",
        summary="symmetric blocked DequantizeLinear (opset 21) feeding the MatMul or Gather: what TensorRT 10, "
        "the X1 compiler and any opset-21 runtime read",
        uses=(MATMUL, EMBEDDING),
        encode_matmul=encode_qdq,
        encode_embedding=encode_dequantize,
        min_opset=21,
    )
)
register_weight_format(
    WeightFormat(
        name="gather-block-quantized",
        label="GatherBlockQuantized",
        summary="ONNX Runtime's com.microsoft.GatherBlockQuantized: the 4-bit table, dequantized row by row",
        uses=(EMBEDDING,),
        bits=(4,),
        encode_embedding=encode_gather,
    )
)
register_weight_format(
    WeightFormat(
        name="ort-dynamic",
        label="MatMulInteger",
        summary="ONNX Runtime's dynamic quantization: MatMulInteger with the activations quantized at run time",
        uses=(MATMUL_DYNAMIC,),
        bits=(8,),
    )
)

# What a pass writes when no target chooses (`edgekit optimize`, a recipe built for a plug-in that names no
# formats): ONNX Runtime's own formats first, as edgekit always did (the old `target=cpu`).
UNTARGETED_FORMATS = ("ort-dynamic", "matmulnbits", "gather-block-quantized", "qdq-blocked")


class WritesWeightFormat:
    """Mixin of a pass config with a `format` field (and the deprecated `target`): which format runs, and why one
    cannot. Subclasses set `format_uses` and may refine `format_bits`, `format_refusal` and `also_writes`."""

    format_uses: ClassVar[tuple[str, ...]] = (MATMUL,)
    format: str | None
    target: str | None

    def format_bits(self) -> set[int]:
        """The widths this config writes."""
        return {4}

    def format_refusal(self, fmt: WeightFormat) -> str | None:
        """Why `fmt` cannot carry this config's weights, as "field: reason"; None when it can."""
        if not set(fmt.uses) & set(self.format_uses):
            return f"format: {fmt.name} stores {', '.join(fmt.uses)}, not what this pass writes"
        missing = sorted(self.format_bits() - set(fmt.bits))
        if missing:
            return f"format: {fmt.name} stores {', '.join(map(str, fmt.bits))}-bit weights, not {missing[0]}-bit"
        return None

    def also_writes(self) -> dict[str, str]:
        """Formats written besides the chosen one, by the field that asks for them (int4's `other_bits`)."""
        return {}

    def check_format(self, where: str) -> None:
        """`validate`'s part: an unknown or unfitting `format` is refused; the deprecated `target` is resolved
        (refused the same way when no format of that target fits) with a FutureWarning naming `format=`."""
        if self.format is not None:
            refusal = self.format_refusal(weight_format(self.format, f"{where}.format"))
            if refusal:
                raise ConfigError(f"{where}.{refusal}")
        if self.target is not None:
            chosen = self._target_default(self.target, where)
            meaning = f"format={self.format} is set and wins" if self.format else f"it writes format={chosen}"
            warnings.warn(
                f"{where}.target={self.target} is deprecated: passes take a weight format ({meaning}; in a recipe, "
                "leave both unset and the build's target chooses)",
                FutureWarning,
                stacklevel=2,
            )

    def format_name(self) -> str:
        """The format that runs: `format`, else the deprecated `target`'s, else the untargeted default."""
        if self.format is not None:
            return self.format
        if self.target is not None:
            return self._target_default(self.target, "pass")
        return choose_format(self, UNTARGETED_FORMATS, where="pass", whose="edgekit's defaults")

    def weight_format(self) -> WeightFormat:
        return weight_format(self.format_name())

    def _target_default(self, target: str, where: str) -> str:
        from edgekit.plugins import get_target

        try:
            plugin = get_target(target)
        except ConfigError as err:
            raise ConfigError(f"{where}.target: {err.reason}") from None
        accepted = getattr(plugin, "weight_formats", None) or UNTARGETED_FORMATS
        return choose_format(self, accepted, where=where, whose=f"target {target}")


def choose_format(config: WritesWeightFormat, accepted: Sequence[str], *, where: str, whose: str) -> str:
    """The first of `accepted` that `config` can write; else one line saying why not (with one candidate, its
    reason, naming the field at fault)."""
    refusals = {}
    for name in accepted:
        fmt = FORMATS.get(name) or weight_format(name, f"{where}.format")
        refusal = config.format_refusal(fmt)
        if refusal is None:
            return name
        refusals[name] = refusal
    if len(refusals) == 1:
        ((name, refusal),) = refusals.items()
        raise ConfigError(f"{where}.{refusal} ({whose} takes {name} only)")
    reasons = "; ".join(f"{n}: {r}" for n, r in refusals.items())
    raise ConfigError(f"{where}.format: none of the formats {whose} takes fits this pass ({reasons})")


def for_target(config: Any, target: str, accepted: Sequence[str], where: str):
    """`config` as built for `target`, which accepts the formats `accepted`: an unset `format` becomes the first
    of them the pass can write, a set one must be among them; the deprecated `target` field is dropped (the
    build's target chooses, as it always did). Validated again, so every refusal is one line naming the field."""
    if config.format is not None and config.format not in accepted:
        raise ConfigError(
            f"{where}.format: target {target} does not take {config.format} (it takes {', '.join(accepted)})"
        )
    chosen = config.format or choose_format(config, accepted, where=where, whose=f"target {target}")
    for field_name, extra in config.also_writes().items():
        if extra not in accepted:
            raise ConfigError(
                f"{where}.{field_name}: writes {extra}, which target {target} does not take "
                f"(it takes {', '.join(accepted)})"
            )
    values = {**config.to_dict(), "format": chosen, "target": None}
    return type(config).from_mapping(values, where=where)
