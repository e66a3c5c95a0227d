"""Reading LoRA adapters saved by PEFT (`adapter_config.json` + `adapter_model.safetensors`) without torch.

Why our own reader: merging on the edge toolchain must not need PyTorch, and PEFT's own loader fails late (at
`load_state_dict`) with messages that name PEFT's internal keys. Here every problem with the adapter *files* is
found up front and reported together; whether the modules fit a given model is `edgekit.passes.lora`'s job.

What a PEFT adapter holds, per target module `M` (keys are `base_model.model.<M>.lora_A.weight`, shape (r, in),
and `...lora_B.weight`, shape (out, r)): the update is `delta_W = scaling * B @ A` in the (out, in) layout of
`nn.Linear`, with `scaling = alpha / r`, or `alpha / sqrt(r)` under rsLoRA. `rank_pattern` / `alpha_pattern`
override r and alpha for modules whose name ends in a pattern (PEFT's `get_pattern_key` rule, reproduced here).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgekit.errors import ConfigError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")
# Features whose merge is not W + s * B @ A: refusing is better than merging them wrongly.
_UNSUPPORTED_FLAGS = ("use_dora", "use_qalora", "lora_bias")


class AdapterError(ConfigError):
    """A LoRA adapter that cannot be read or does not fit the model; `problems` lists every reason."""

    code = "invalid_adapter"

    def __init__(self, reason: str, path=None, problems: list[str] | None = None):
        self.problems = list(problems or [])
        if self.problems:
            reason = f"{reason}: " + "; ".join(self.problems)
        super().__init__(reason, path)


@dataclass(frozen=True)
class LoraModule:
    """One adapted module: `A` (r, in), `B` (out, r), and its scaling. `delta()` is (out, in)."""

    name: str  # module path in the base model, e.g. `model.layers.0.self_attn.q_proj`
    A: np.ndarray
    B: np.ndarray
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.A.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in) of the weight this module adapts."""
        return int(self.B.shape[0]), int(self.A.shape[1])

    def delta(self) -> np.ndarray:
        """scaling * B @ A, computed in float64 so merges agree with PEFT's float32 to rounding."""
        return (self.scaling * (self.B.astype(np.float64) @ self.A.astype(np.float64))).astype(np.float32)


@dataclass(frozen=True)
class PeftAdapter:
    path: Path
    r: int
    lora_alpha: float
    use_rslora: bool
    fan_in_fan_out: bool
    target_modules: list[str] | str | None
    modules: dict[str, LoraModule] = field(default_factory=dict)

    def targets(self, module: str) -> bool:
        """PEFT's rule: a regex string must match the whole name; a list entry matches the name or its last parts."""
        t = self.target_modules
        if t is None:
            return True
        if isinstance(t, str):
            return re.fullmatch(t, module) is not None
        return any(module == k or module.endswith("." + k) for k in t)


def pattern_value(patterns: dict, module: str, default):
    """PEFT's `get_pattern_key`: the first pattern `p` with `re.match(rf"(.*\\.)?({p})$", module)` wins."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def lora_scaling(alpha: float, r: int, rslora: bool) -> float:
    return alpha / math.sqrt(r) if rslora else alpha / r


def _read_config(path: Path) -> dict:
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file():
        raise AdapterError(f"{CONFIG_FILE} not found", path)
    try:
        cfg = json.loads(cfg_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterError(f"not valid JSON ({exc.__class__.__name__})", cfg_path) from exc
    if not isinstance(cfg, dict):
        raise AdapterError("expected a JSON object", cfg_path)
    problems = []
    if cfg.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type is {cfg.get('peft_type')!r}, only LORA adapters can be merged")
    for flag in _UNSUPPORTED_FLAGS:
        if cfg.get(flag):
            problems.append(f"{flag} is set; its merge is not W + scale * B @ A and is not supported")
    r = cfg.get("r")
    if not isinstance(r, int) or r <= 0:
        problems.append(f"r must be a positive integer, not {r!r}")
    if not isinstance(cfg.get("lora_alpha", r), (int, float)):
        problems.append(f"lora_alpha must be a number, not {cfg.get('lora_alpha')!r}")
    tm = cfg.get("target_modules")
    if tm is not None and not isinstance(tm, (str, list)):
        problems.append(f"target_modules must be a list or a regex string, not {type(tm).__name__}")
    if isinstance(tm, str):
        try:
            re.compile(tm)
        except re.error as exc:
            problems.append(f"target_modules is not a valid regex ({exc})")
    if problems:
        raise AdapterError("unsupported adapter config", cfg_path, problems)
    return cfg


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    w_path = path / WEIGHTS_FILE
    if not w_path.is_file():
        raise AdapterError(f"{WEIGHTS_FILE} not found (adapter_model.bin is not read: it is a pickle)", path)
    try:
        return load_file(str(w_path))
    except Exception as exc:  # safetensors raises its own types for truncated or foreign files
        raise AdapterError(f"not a readable safetensors file ({type(exc).__name__})", w_path) from exc


def read_peft_adapter(path: str | Path) -> PeftAdapter:
    """Read and check one PEFT LoRA adapter directory. Raises `AdapterError` listing every problem found."""
    path = Path(path)
    if not path.is_dir():
        raise AdapterError("adapter directory not found", path)
    cfg = _read_config(path)
    tensors = _read_tensors(path)
    r, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    rslora = bool(cfg.get("use_rslora", False))
    tm = cfg.get("target_modules")
    adapter = PeftAdapter(
        path=path,
        r=r,
        lora_alpha=alpha,
        use_rslora=rslora,
        fan_in_fan_out=bool(cfg.get("fan_in_fan_out", False)),
        target_modules=sorted(tm) if isinstance(tm, list) else tm,
    )

    pairs: dict[str, dict[str, np.ndarray]] = {}
    problems = []
    for key, value in tensors.items():
        name = key[len(_PREFIX) :] if key.startswith(_PREFIX) else key
        m = _KEY.match(name)
        if m is None:
            problems.append(
                f"{key}: not a lora_A/lora_B weight (embedding LoRA, biases and modules_to_save are not supported)"
            )
            continue
        pairs.setdefault(m["module"], {})[m["ab"]] = value
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            problems.append(f"{module}: lora_{'B' if 'A' in ab else 'A'} is missing")
            continue
        A, B = ab["A"], ab["B"]
        if A.ndim != 2 or B.ndim != 2:
            problems.append(f"{module}: LoRA weights must be 2-D (Linear), got A {A.shape} and B {B.shape}")
            continue
        mod_r = int(pattern_value(rank_pattern, module, r))
        if A.shape[0] != mod_r or B.shape[1] != mod_r:
            problems.append(
                f"{module}: rank is {mod_r} by the config but A is {tuple(A.shape)} and B is {tuple(B.shape)}"
            )
            continue
        if not adapter.targets(module):
            problems.append(f"{module}: not matched by target_modules {tm!r}")
            continue
        mod_alpha = float(pattern_value(alpha_pattern, module, alpha))
        adapter.modules[module] = LoraModule(
            module, np.asarray(A, np.float32), np.asarray(B, np.float32), lora_scaling(mod_alpha, mod_r, rslora)
        )
    if problems:
        raise AdapterError("adapter weights are inconsistent", path / WEIGHTS_FILE, problems)
    if not adapter.modules:
        raise AdapterError("the adapter holds no LoRA weights", path / WEIGHTS_FILE)
    return adapter
