"""edgekitd's configuration: one TOML file, every key with a default, command-line overrides on top.

Kept apart from the server so that tests, the bench script and SIGHUP reloads read config the same way. The
commented example with every key is `packaging/edgekitd.toml`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from edgekit.bundle.minisign import PublicKey
from edgekit.compat import tomllib
from edgekit.errors import ConfigError, EdgekitError

from .dicom_config import SECTIONS as DICOM_SECTIONS
from .dicom_config import DicomSettings, read_sections
from .policy import Constraints, PolicySettings
from .telemetry import TelemetrySettings, read_settings

DEFAULT_CONFIG_PATH = Path("/etc/edgekit/edgekitd.toml")
DEFAULT_STATE_DIR = Path("/var/lib/edgekit")
DEFAULT_SOCKET = Path("/run/edgekit/edgekitd.sock")


@dataclass(frozen=True)
class Variant:
    """A named bundle the daemon can serve, with the run settings it loads with (`RuntimeOptions.settings`: for
    x1, the DSS target): one bundle may be two variants, dense and sparse, and the policy picks between them."""

    name: str
    bundle: Path
    settings: dict[str, Any] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class PrecisionGate:
    """[precision_gate], off unless configured: a study whose display entropy is below `entropy_below` bits is
    reported by `variant` (the higher-precision one) instead of the variant serving now. The seed's rule; on the
    default model it gains nothing (bench/precision_gate.py), which is why it is off by default."""

    variant: str
    entropy_below: float = 4.2


@dataclass(frozen=True)
class RolloutSettings:
    """[rollout]: the canary window, its thresholds, the quality gate and the drop folder."""

    canary_reports: int = 20
    canary_s: float = 600.0
    min_reports: int = 5  # reports in the window before its error rate and p95 are judged
    max_error_rate: float = 0.2
    max_p95_ratio: float = 2.0  # against the previous bundle's recent p95
    max_energy_ratio: float = 1.5  # mean energy per report against the previous bundle's (same meter)
    min_delivery_rate: float = 0.8  # SR deliveries delivered / (delivered + dead letters) in the window
    gate_split: Path | None = None  # a held-out split (edgekit data synth's layout) the new bundle must pass
    gate_min_f1: float = 0.0
    gate_limit: int = 8
    drop_dir: Path | None = None
    max_bundle_bytes: int = 8 * 1024**3  # a bundle uploaded to POST /v1/variants/{name}/bundles
    profile: Path | None = None  # the canary's energy baseline: a new bundle's `edgekit pareto` point; [policy]'s


@dataclass(frozen=True)
class DaemonConfig:
    state_dir: Path = DEFAULT_STATE_DIR
    socket: Path = DEFAULT_SOCKET
    socket_mode: int = 0o660
    socket_group: str | None = None
    tcp_enabled: bool = False
    tcp_host: str = "127.0.0.1"
    tcp_port: int = 8471
    tcp_token_file: Path | None = None  # the bearer token TCP clients must send; required when tcp is on
    variants: tuple[Variant, ...] = ()
    active_variant: str | None = None
    default_model_dir: Path | None = None  # source weights of the embedded default model (None: the packaged ones)
    keep_alive_s: float = 300.0  # idle non-active variants unload after this long (< 0: never), as Ollama's 5 min
    threads: int | None = None  # ONNX Runtime intra-op threads per loaded variant (None: cpu_share.model_threads)
    ort_spinning: bool = False  # ONNX Runtime's pool threads spin between runs (its own default; cpu_share.py)
    workers: int = 8  # reports in progress at once: ingest and preprocessing overlap, generation batches
    # Processes that decode studies off the server's GIL (0: the daemon's threads; None: half the physical cores, 2-4)
    ingest_processes: int | None = None
    max_queue: int = 16
    # The token engine per loaded variant (edgekit.engine): rows decoding together, their KV budget, the batch
    # controller (fixed | bandwidth | latency) and its target, the prefill chunk (None: whole prompts)
    max_batch: int = 8
    kv_budget_bytes: int | None = None
    batch_controller: str = "fixed"
    latency_target_ms: float = 50.0
    prefill_chunk: int | None = None
    retry_after_s: int = 5
    sync_timeout_s: float = 300.0
    drain_timeout_s: float = 30.0
    job_retention_s: float = 7 * 24 * 3600.0
    max_attempts: int = 3  # a job or received study started this many times without finishing is quarantined
    max_upload_bytes: int = 512 * 1024 * 1024
    max_files: int = 4000
    max_frames: int = 4000
    max_pixels: int = 4096 * 4096
    video_max_frames: int = 64
    # One pool for the studies in memory (being decoded, or ingested and waiting for a worker): see memory.py
    ingest_memory_bytes: int = 1024**3
    video_max_source_frames: int = 200_000
    video_decode_timeout_s: float = 120.0
    ingest_timeout_s: float = 300.0  # wall time one study's decode may take in its worker process; then killed
    # Slow or stalled clients (middleware.Guard): request bodies being read at once, the time a body may take to
    # start and the rate it must keep after that; connections in all (uvicorn's limit_concurrency)
    max_uploads: int = 32
    body_timeout_s: float = 10.0
    min_body_rate: int = 64 * 1024
    max_connections: int = 1024
    min_free_bytes: int = 256 * 1024 * 1024  # state dir free space below which uploads get 507, readiness 503
    max_new_tokens_limit: int = 512
    log_level: str = "info"
    # [policy]: None = no policy, the active variant changes only when told (PUT /v1/variants/active)
    policy: PolicySettings | None = None
    policy_profile: Path | None = None  # the `edgekit pareto` profile of the configured variants (pareto.json)
    policy_tick_s: float = 1.0
    signals_root: Path = Path("/")  # where /sys, /etc are read from (a fixture tree in tests)
    precision_gate: PrecisionGate | None = None
    # [trust] public_keys: the minisign keys a variant's bundle must be signed by (several while keys rotate); empty:
    # bundles load unsigned. A bundle that is unsigned, tampered or signed by another key is refused on every load
    # and every switch (edgekit.bundle.signing).
    trusted_keys: tuple[PublicKey, ...] = ()
    # [rollout]: a new bundle for a variant is staged, gated, switched to and watched (daemon/rollout.py)
    rollout: RolloutSettings = RolloutSettings()
    # [dicom], [dimse], [delivery], [[destinations]]: DICOM networking (dicom_config.py)
    dicom: DicomSettings = DicomSettings()
    # [telemetry]: OpenTelemetry traces by OTLP/HTTP, off by default (daemon/telemetry.py, docs/telemetry.md)
    telemetry: TelemetrySettings = TelemetrySettings()
    source: Path | None = None  # the file this was read from (None: defaults only)

    def variant(self, name: str) -> Variant | None:
        return next((v for v in self.variants if v.name == name), None)


# TOML section.key -> DaemonConfig field, with the type each must have.
_KEYS: dict[tuple[str, str], tuple[str, type | tuple[type, ...]]] = {
    ("daemon", "state_dir"): ("state_dir", str),
    ("daemon", "log_level"): ("log_level", str),
    ("daemon", "threads"): ("threads", int),
    ("daemon", "ort_spinning"): ("ort_spinning", bool),
    ("listen", "socket"): ("socket", str),
    ("listen", "socket_mode"): ("socket_mode", (int, str)),
    ("listen", "socket_group"): ("socket_group", str),
    ("listen", "tcp"): ("tcp_enabled", bool),
    ("listen", "tcp_host"): ("tcp_host", str),
    ("listen", "tcp_port"): ("tcp_port", int),
    ("listen", "tcp_token_file"): ("tcp_token_file", str),
    ("scheduler", "workers"): ("workers", int),
    ("scheduler", "ingest_processes"): ("ingest_processes", int),
    ("scheduler", "max_queue"): ("max_queue", int),
    ("engine", "max_batch"): ("max_batch", int),
    ("engine", "kv_budget_bytes"): ("kv_budget_bytes", int),
    ("engine", "controller"): ("batch_controller", str),
    ("engine", "latency_target_ms"): ("latency_target_ms", (int, float)),
    ("engine", "prefill_chunk"): ("prefill_chunk", int),
    ("scheduler", "retry_after_s"): ("retry_after_s", int),
    ("scheduler", "sync_timeout_s"): ("sync_timeout_s", (int, float)),
    ("scheduler", "drain_timeout_s"): ("drain_timeout_s", (int, float)),
    ("jobs", "retention_s"): ("job_retention_s", (int, float)),
    ("jobs", "max_attempts"): ("max_attempts", int),
    ("limits", "max_upload_bytes"): ("max_upload_bytes", int),
    ("limits", "ingest_memory_bytes"): ("ingest_memory_bytes", int),
    ("limits", "video_max_source_frames"): ("video_max_source_frames", int),
    ("limits", "video_decode_timeout_s"): ("video_decode_timeout_s", (int, float)),
    ("limits", "ingest_timeout_s"): ("ingest_timeout_s", (int, float)),
    ("limits", "max_uploads"): ("max_uploads", int),
    ("limits", "body_timeout_s"): ("body_timeout_s", (int, float)),
    ("limits", "min_body_rate"): ("min_body_rate", int),
    ("limits", "max_connections"): ("max_connections", int),
    ("limits", "min_free_bytes"): ("min_free_bytes", int),
    ("limits", "max_files"): ("max_files", int),
    ("limits", "max_frames"): ("max_frames", int),
    ("limits", "max_pixels"): ("max_pixels", int),
    ("limits", "video_max_frames"): ("video_max_frames", int),
    ("limits", "max_new_tokens"): ("max_new_tokens_limit", int),
    ("models", "active"): ("active_variant", str),
    ("models", "default_model_dir"): ("default_model_dir", str),
    ("models", "keep_alive_s"): ("keep_alive_s", (int, float)),
}
_PATHS = {"state_dir", "socket", "tcp_token_file", "default_model_dir", "policy_profile", "signals_root"}
# [policy] keys: those of PolicySettings and its Constraints, plus where the profile and the signals are.
_POLICY_CONSTRAINTS = ("power_budget_w", "energy_budget_j", "quality_floor_f1", "latency_slo_ms")
_POLICY_NUMBERS = ("window_s", "margin", "balanced_f1_slack", "battery_low_pct", "thermal_margin_c")
_POSITIVE = {
    "max_attempts",
    "ingest_memory_bytes",
    "video_max_source_frames",
    "max_uploads",
    "min_body_rate",
    "max_connections",
    "workers",
    "max_queue",
    "max_batch",
    "max_upload_bytes",
    "max_files",
    "max_frames",
    "max_pixels",
    "video_max_frames",
    "max_new_tokens_limit",
    "retry_after_s",
}
_LOG_LEVELS = {"debug", "info", "warning", "error"}


def load_config(path: str | os.PathLike | None = None, overrides: dict[str, Any] | None = None) -> DaemonConfig:
    """Defaults <- the TOML file (if `path` is None, the default path when it exists) <- `overrides` by field name."""
    values: dict[str, Any] = {}
    source = None
    if path is not None or DEFAULT_CONFIG_PATH.is_file():
        source = Path(path) if path is not None else DEFAULT_CONFIG_PATH
        values = _read_toml(source)
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key not in {f.name for f in fields(DaemonConfig)}:
            raise ConfigError(f"unknown setting {key!r}")
        values[key] = Path(value) if key in _PATHS else value
    cfg = replace(DaemonConfig(), **values, source=source)
    if cfg.rollout.profile is None and cfg.policy_profile is not None:  # the canary's energy: the policy's profile
        cfg = replace(cfg, rollout=replace(cfg.rollout, profile=cfg.policy_profile))
    _check(cfg, source)
    return cfg


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError("config file not found", path) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"not valid TOML ({exc})", path) from None
    out: dict[str, Any] = {}
    dicom = read_sections(data, path, _resolve)
    if dicom is not None:
        out["dicom"] = dicom
    for section, table in data.items():
        if section in DICOM_SECTIONS:
            continue
        if section == "variants":
            out["variants"] = _variants(table, path)
            continue
        if section == "policy":
            out.update(_policy(table, path))
            continue
        if section == "precision_gate":
            out["precision_gate"] = _precision_gate(table, path)
            continue
        if section == "trust":
            out["trusted_keys"] = _trust(table, path)
            continue
        if section == "rollout":
            out["rollout"] = _rollout(table, path)
            continue
        if section == "telemetry":
            out["telemetry"] = read_settings(table, path)
            continue
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}] must be a table", path)
        for key, value in table.items():
            spec = _KEYS.get((section, key))
            if spec is None:
                raise ConfigError(f"unknown key {section}.{key}", path)
            name, kind = spec
            if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
                raise ConfigError(f"{section}.{key} has the wrong type ({type(value).__name__})", path)
            if name == "socket_mode":
                value = _mode(value, path)
            out[name] = _resolve(Path(value), path) if name in _PATHS else value
    return out


def _variants(table: Any, path: Path) -> tuple[Variant, ...]:
    if not isinstance(table, list):
        raise ConfigError("variants must be an array of tables: [[variants]] name = ..., bundle = ...", path)
    out = []
    for i, item in enumerate(table):
        if (
            not isinstance(item, dict)
            or set(item) - {"name", "bundle", "settings"}
            or not all(isinstance(item.get(k), str) and item.get(k) for k in ("name", "bundle"))
        ):
            raise ConfigError(
                f"variants[{i}] needs a string name and a string bundle (and optionally a settings table)", path
            )
        settings = item.get("settings", {})
        if not isinstance(settings, dict) or not all(isinstance(v, (str, int, float, bool)) for v in settings.values()):
            raise ConfigError(
                f"variants[{i}].settings must be a table of scalars, e.g. settings = {{ sparsity_target = 0.38 }}",
                path,
            )
        out.append(Variant(item["name"], _resolve(Path(item["bundle"]), path), dict(settings)))
    return tuple(out)


def _policy(table: Any, path: Path) -> dict[str, Any]:
    """[policy]: the settings of `policy.PolicySettings` (checked there), the profile, the tick and signals root."""
    if not isinstance(table, dict):
        raise ConfigError("[policy] must be a table", path)
    known = {*_POLICY_CONSTRAINTS, *_POLICY_NUMBERS, "mode", "fixed", "queue_high", "allow_overrides", "profile"}
    known |= {"tick_s", "signals_root"}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"unknown key policy.{unknown[0]} (known: {', '.join(sorted(known))})", path)
    kinds = {"mode": str, "fixed": str, "profile": str, "signals_root": str, "allow_overrides": bool, "queue_high": int}
    for key, value in table.items():
        kind = kinds.get(key, (int, float))
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ConfigError(f"policy.{key} has the wrong type ({type(value).__name__})", path)
    if "profile" not in table:
        raise ConfigError("[policy] needs profile = the `edgekit pareto` pareto.json of the variants", path)
    settings = PolicySettings(
        mode=table.get("mode", "balanced"),
        constraints=Constraints(**{k: float(table[k]) for k in _POLICY_CONSTRAINTS if k in table}),
        fixed=table.get("fixed"),
        **{k: float(table[k]) for k in _POLICY_NUMBERS if k in table},
        queue_high=table.get("queue_high", 4),
        allow_overrides=table.get("allow_overrides", True),
    )
    settings.check(path)
    out: dict[str, Any] = {"policy": settings, "policy_profile": _resolve(Path(table["profile"]), path)}
    if "tick_s" in table:
        out["policy_tick_s"] = float(table["tick_s"])
    if "signals_root" in table:
        out["signals_root"] = _resolve(Path(table["signals_root"]), path)
    return out


def _trust(table: Any, path: Path) -> tuple[PublicKey, ...]:
    """[trust] public_keys = ["release.pub", "RWQ..."]: minisign public key files (relative to this file) or keys."""
    from edgekit.bundle.signing import read_public_keys

    if not isinstance(table, dict):
        raise ConfigError("[trust] must be a table", path)
    unknown = sorted(set(table) - {"public_keys"})
    if unknown:
        raise ConfigError(f"unknown key trust.{unknown[0]} (known: public_keys)", path)
    keys = table.get("public_keys", [])
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise ConfigError("trust.public_keys must be a list of .pub files or minisign keys (RW...)", path)
    try:
        return tuple(read_public_keys(keys, base=path.parent))
    except EdgekitError as err:
        raise ConfigError(f"trust.public_keys: {err}", path) from None


def _rollout(table: Any, path: Path) -> RolloutSettings:
    """[rollout]: RolloutSettings' fields by name; paths relative to this file; every number checked."""
    if not isinstance(table, dict):
        raise ConfigError("[rollout] must be a table", path)
    known = {f.name: f for f in fields(RolloutSettings)}
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key not in known:
            raise ConfigError(f"unknown key rollout.{key} (known: {', '.join(known)})", path)
        if key in ("gate_split", "drop_dir", "profile"):
            if not isinstance(value, str):
                raise ConfigError(f"rollout.{key} must be a path", path)
            values[key] = _resolve(Path(value), path)
            continue
        whole = key in ("canary_reports", "min_reports", "gate_limit", "max_bundle_bytes")
        ok = isinstance(value, int) if whole else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok or not math.isfinite(value) or value < (1 if whole else 0):
            kind = "a whole number >= 1" if whole else "a number >= 0"
            raise ConfigError(f"rollout.{key} must be {kind}, got {value!r}", path)
        values[key] = value
    return RolloutSettings(**values)


def _precision_gate(table: Any, path: Path) -> PrecisionGate:
    if not isinstance(table, dict):
        raise ConfigError("[precision_gate] must be a table", path)
    unknown = sorted(set(table) - {"variant", "entropy_below"})
    if unknown:
        raise ConfigError(f"unknown key precision_gate.{unknown[0]} (known: entropy_below, variant)", path)
    variant, below = table.get("variant"), table.get("entropy_below", PrecisionGate.entropy_below)
    if not isinstance(variant, str) or not variant:
        raise ConfigError("precision_gate.variant must name the higher-precision variant", path)
    if isinstance(below, bool) or not isinstance(below, (int, float)) or not 0 < below <= 8:
        raise ConfigError(f"precision_gate.entropy_below must be in (0, 8] bits, got {below!r}", path)
    return PrecisionGate(variant, float(below))


def _resolve(value: Path, config_path: Path) -> Path:
    """Relative paths in a config file are relative to the file, as a reader of the file would expect."""
    return value if value.is_absolute() else (config_path.parent / value).resolve()


def _mode(value: object, path: Path) -> int:
    """`listen.socket_mode`, its type checked against `_KEYS` (int or str): an int as is, a string read as octal."""
    if isinstance(value, int):
        return value
    try:
        return int(str(value), 8)
    except ValueError:
        raise ConfigError(f'listen.socket_mode must be octal like "0660", got {value!r}', path) from None


def _check(cfg: DaemonConfig, path: Path | None) -> None:
    for name in _POSITIVE:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}", path)
    for name in ("kv_budget_bytes", "prefill_chunk"):
        value = getattr(cfg, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"engine.{name} must be a positive integer, got {value!r}", path)
    from edgekit.engine.control import CONTROLLERS

    if cfg.batch_controller not in CONTROLLERS:
        known = ", ".join(CONTROLLERS)
        raise ConfigError(f"engine.controller must be one of {known}, got {cfg.batch_controller!r}", path)
    if not (math.isfinite(cfg.latency_target_ms) and cfg.latency_target_ms > 0):
        raise ConfigError(f"engine.latency_target_ms must be > 0, got {cfg.latency_target_ms!r}", path)
    if cfg.threads is not None and cfg.threads < 1:
        raise ConfigError(f"threads must be >= 1, got {cfg.threads}", path)
    value = cfg.ingest_processes
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ConfigError(f"scheduler.ingest_processes must be a whole number >= 0, got {value!r}", path)
    if isinstance(cfg.min_free_bytes, bool) or not isinstance(cfg.min_free_bytes, int) or cfg.min_free_bytes < 0:
        raise ConfigError(f"min_free_bytes must be a whole number of bytes >= 0, got {cfg.min_free_bytes!r}", path)
    for name in (
        "sync_timeout_s",
        "drain_timeout_s",
        "job_retention_s",
        "video_decode_timeout_s",
        "ingest_timeout_s",
        "body_timeout_s",
    ):
        if not getattr(cfg, name) > 0:
            raise ConfigError(f"{name} must be > 0", path)
    if not (math.isfinite(cfg.policy_tick_s) and cfg.policy_tick_s > 0):
        raise ConfigError(f"policy.tick_s must be > 0 seconds, got {cfg.policy_tick_s!r}", path)
    if not math.isfinite(cfg.keep_alive_s):
        raise ConfigError(
            f"keep_alive_s must be a number of seconds (negative: never unload), got {cfg.keep_alive_s!r}", path
        )
    if not 0 <= cfg.socket_mode <= 0o777:
        raise ConfigError(f"socket_mode must be within 0o000..0o777, got {oct(cfg.socket_mode)}", path)
    from edgekit.generate import MAX_NEW_TOKENS

    if cfg.max_new_tokens_limit > MAX_NEW_TOKENS:
        raise ConfigError(f"max_new_tokens_limit must be <= {MAX_NEW_TOKENS}, got {cfg.max_new_tokens_limit}", path)
    if not 0 < cfg.tcp_port < 65536:
        raise ConfigError(f"tcp_port must be 1..65535, got {cfg.tcp_port}", path)
    if cfg.tcp_enabled and cfg.tcp_token_file is None:
        raise ConfigError("listen.tcp = true needs listen.tcp_token_file (TCP clients must send a bearer token)", path)
    if cfg.log_level not in _LOG_LEVELS:
        raise ConfigError(f"log_level must be one of {sorted(_LOG_LEVELS)}, got {cfg.log_level!r}", path)
    names = [v.name for v in cfg.variants]
    if len(set(names)) != len(names):
        raise ConfigError("variant names must be unique", path)
    if cfg.active_variant is not None and cfg.variants and cfg.active_variant not in names:
        raise ConfigError(f"models.active names an unknown variant {cfg.active_variant!r}", path)
    if cfg.precision_gate is not None and cfg.precision_gate.variant not in names:
        raise ConfigError(f"precision_gate.variant names an unknown variant {cfg.precision_gate.variant!r}", path)


def check_files(cfg: DaemonConfig) -> None:
    """What `--check-config` adds to parsing: every variant's bundle and the default model's weights are there,
    and with [trust] keys every bundle is signed by one of them.

    Cheap checks only (a bundle is a directory with a manifest, or an .ekb file); the daemon verifies checksums when
    it loads a variant. Not part of `load_config`, which a reload and the tests call on configs whose bundles are
    built later."""
    for v in cfg.variants:
        if v.bundle.is_dir():
            if not (v.bundle / "manifest.json").is_file():
                raise ConfigError(f"variant {v.name!r}: not a bundle (no manifest.json)", v.bundle)
        elif not v.bundle.is_file():
            raise ConfigError(f"variant {v.name!r}: no such bundle (directory or .ekb file)", v.bundle)
        if cfg.trusted_keys:  # [trust]: signed by a trusted key (the files are checked when it loads)
            from edgekit.bundle.signing import verify_signature

            try:
                verify_signature(v.bundle, list(cfg.trusted_keys))
            except EdgekitError as err:
                raise ConfigError(f"variant {v.name!r}: {err.reason}", v.bundle) from None
    if not cfg.variants and cfg.default_model_dir is not None:
        weights = cfg.default_model_dir / "model.safetensors"
        if not weights.is_file():
            raise ConfigError("no variant is configured and the default model's weights are missing", weights)


def read_token(cfg: DaemonConfig) -> str | None:
    """The TCP bearer token, read from its file (kept out of the config so the config can be world-readable)."""
    if not cfg.tcp_enabled or cfg.tcp_token_file is None:
        return None
    try:
        token = cfg.tcp_token_file.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the TCP token file ({exc.strerror})", cfg.tcp_token_file) from None
    if len(token) < 16:
        raise ConfigError("the TCP token must be at least 16 characters", cfg.tcp_token_file)
    return token
