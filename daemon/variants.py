"""Variants: the named bundles the daemon serves, loaded and warmed on demand, one of them active.

Switching loads and warms the new variant beside the old one before the active name moves, and a running report
keeps the `Reporter` it started with, so no request is dropped or served half by one and half by the other.
With no variant configured, the embedded default model is built once into the state directory and served.

Keep-alive (as Ollama's): a variant nobody has used for `keep_alive_s` is unloaded and loads again on the next
request that names it. The active variant is pinned, so readiness keeps meaning "a warm model answers now".
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgekit.bundle.signing import manifest_digest
from edgekit.errors import BundleError, ConfigError, EdgekitError

from .config import DaemonConfig, Variant
from .cpu_share import model_threads

if TYPE_CHECKING:
    from edgekit.bundle import Bundle
    from edgekit.energy.sampler import Sampler
    from edgekit.reporter import Reporter

log = logging.getLogger("edgekitd")

DEFAULT_VARIANT = "default"

Say = Callable[[str], None]


def _quiet(_message: str) -> None:
    pass


class UnknownVariantError(EdgekitError):
    code = "unknown_variant"
    http_status = 404


@dataclass
class Loaded:
    name: str
    reporter: Reporter
    load_ms: float
    warm_ms: float
    digest: str = ""  # its bundle's manifest sha256 when it was loaded (a switch under [trust] compares it)
    in_use: int = 0  # reports running on it now: never unloaded while > 0
    last_used: float = field(default_factory=time.monotonic)


def default_bundle(cfg: DaemonConfig, say: Say = _quiet) -> Path:
    """The embedded model's cpu bundle in the state dir, rebuilt only when the source weights changed."""
    from edgekit.build import build, default_model_dir
    from edgekit.bundle import load_bundle, sha256_file

    source = Path(cfg.default_model_dir) if cfg.default_model_dir else default_model_dir()
    out = Path(cfg.state_dir) / "bundles" / "default-cpu"
    weights = source / "model.safetensors"
    if not weights.is_file():
        raise BundleError("no variant is configured and the default model's weights are missing", weights)
    if (out / "manifest.json").is_file():
        try:
            if load_bundle(out).manifest.provenance.get("source_weights_sha256") == sha256_file(weights):
                return out
        except BundleError:
            log.warning("default bundle in the state dir is damaged; rebuilding it")
    say("building the default model for cpu")
    build("cpu", out, model_dir=source, parity=False, progress=lambda m: log.info("build: %s", m))
    return out


class VariantRegistry:
    """Ollama's scheduler, in its own words: load on demand, count references, keep alive, unload. Nothing else
    touches a loaded variant's lifetime; a report borrows one through `hold`."""

    def __init__(self, cfg: DaemonConfig, say: Say = _quiet, on_change: Callable[[set[str]], None] | None = None):
        self._say = say
        self.on_change = on_change
        self._lock = threading.RLock()
        self._loading: dict[str, threading.Lock] = {}
        self.loaded: dict[str, Loaded] = {}
        self.specs: dict[str, Variant] = {}
        self.configured: dict[str, Variant] = {}
        self.installed: dict[str, Path] = {}  # variants serving a rollout's slot instead of the config's bundle
        self._text: dict[str, bool] = {}  # whether a variant's bundle is a text model's, read from its manifest
        self.row_caps: dict[str, int] = {}  # the policy's batch size per variant, applied whenever it is loaded
        self.active = ""
        self.threads = 1
        # the energy meter each report is billed by (edgekit.energy), where the target has none
        self.meter: Sampler | None = None
        self.keep_alive_s = 0.0
        self.configure(cfg)

    def configure(self, cfg: DaemonConfig) -> None:
        """(Re)read the variant list; loaded variants that are still listed stay loaded."""
        self.threads = model_threads(cfg)
        self.spinning = cfg.ort_spinning
        self.engine = cfg  # the [engine] settings each loaded variant's token engine takes
        self.state_dir = Path(cfg.state_dir)  # where a target keeps what it builds on the device (orin: engines)
        self.keep_alive_s = cfg.keep_alive_s
        self.trusted_keys = list(cfg.trusted_keys)
        specs = {v.name: v for v in cfg.variants}
        if not specs:
            specs = {DEFAULT_VARIANT: Variant(DEFAULT_VARIANT, default_bundle(cfg, self._say))}
        with self._lock:
            self.configured = dict(specs)  # the bundles the config names; a rollout's slot replaces one (install)
            specs = {n: replace(v, bundle=self.installed[n]) if n in self.installed else v for n, v in specs.items()}
            self.specs = specs
            self._text.clear()  # a reload may point a name at another bundle
            dropped = [name for name in self.loaded if name not in specs]
            for name in dropped:
                del self.loaded[name]
            if dropped:
                self._on_change()
            if cfg.active_variant in specs:
                self.active = cfg.active_variant  # the config file wins on reload
            elif self.active not in specs:
                self.active = next(iter(specs))

    def check(self, name: str) -> str:
        """`name` if it is configured, else the `unknown_variant` error (routes ask before reading an upload)."""
        with self._lock:
            if name not in self.specs:
                raise UnknownVariantError(f"unknown variant {name!r} (known: {', '.join(sorted(self.specs))})")
            return name

    def is_text(self, name: str) -> bool:
        """Whether variant `name` (configured: `check`) is a text model's bundle, which writes reports from a prompt
        alone: known without loading it (its manifest says), so a request is routed before its upload is read."""
        from edgekit import names
        from edgekit.bundle import peek_manifest

        with self._lock:
            if name in self.loaded:
                return self.loaded[name].reporter.is_text
            if name not in self._text:
                self._text[name] = names.VISION not in peek_manifest(self.specs[name].bundle).components
            return self._text[name]

    def get(self, name: str | None = None, *, hold: bool = False) -> Loaded:
        """The loaded variant `name` (default: the active one), loading and warming it first if needed.
        `hold`: count it in use (under the same lock that unloading takes), to be given back by `release`."""
        with self._lock:
            name = self.check(name or self.active)
            if name in self.loaded:
                return self._touch(self.loaded[name], hold)
            gate = self._loading.setdefault(name, threading.Lock())
        with gate:  # one load per variant; other variants keep serving meanwhile
            with self._lock:
                if name in self.loaded:
                    return self._touch(self.loaded[name], hold)
                spec = self.specs[name]
            loaded = self._load(spec)
            with self._lock:
                self._serve(name, loaded)
                return self._touch(loaded, hold)

    def peek(self, name: str) -> Loaded | None:
        """The variant `name` if it is loaded now, without loading, touching or holding it (checks only)."""
        with self._lock:
            return self.loaded.get(name)

    @staticmethod
    def _touch(loaded: Loaded, hold: bool) -> Loaded:
        loaded.last_used = time.monotonic()
        loaded.in_use += hold
        return loaded

    def release(self, loaded: Loaded) -> None:
        with self._lock:
            loaded.in_use -= 1
            loaded.last_used = time.monotonic()

    @contextlib.contextmanager
    def hold(self, name: str | None = None) -> Iterator[Loaded]:
        """The variant for one report: loaded on demand, kept loaded until the report is done."""
        loaded = self.get(name, hold=True)
        try:
            yield loaded
        finally:
            self.release(loaded)

    def unload_idle(self, now: float | None = None) -> list[str]:
        """Unload variants idle for the keep-alive (never the active one, never one in use); their names."""
        if self.keep_alive_s < 0:
            return []
        now = time.monotonic() if now is None else now
        with self._lock:
            idle = [
                name
                for name, item in self.loaded.items()
                if name != self.active and item.in_use == 0 and now - item.last_used >= self.keep_alive_s
            ]
            for name in idle:
                del self.loaded[name]  # a report that still holds its Reporter keeps it alive until it ends
            if idle:
                self._on_change()
        for name in idle:
            log.info("variant %s unloaded after %.0f s idle", name, self.keep_alive_s)
        return idle

    def cap_rows(self, name: str, rows: int | None) -> Loaded | None:
        """Cap variant `name`'s engine at `rows` decoding together (None: its configured `max_batch`), now if it is
        loaded and whenever it is loaded later, so a variant loaded between policy ticks starts with the cap."""
        if rows is not None and rows < 1:
            raise ConfigError(f"a row cap must be >= 1, got {rows} (variant {name!r})")
        with self._lock:
            if rows is None:
                self.row_caps.pop(name, None)
            else:
                self.row_caps[name] = rows
            loaded = self.loaded.get(name)
            if loaded is not None and loaded.reporter.engine.row_cap != rows:
                loaded.reporter.engine.cap_rows(rows)
                self._on_change()
        return loaded

    def _serve(self, name: str, loaded: Loaded) -> None:
        """`loaded` serves variant `name` from now on (the caller holds the lock), with the policy's cap at that
        moment: a tick while it loaded (seconds of warming, a rollout's gate) may have changed it."""
        loaded.reporter.engine.cap_rows(self.row_caps.get(name))
        self.loaded[name] = loaded
        self._on_change()

    def _on_change(self) -> None:
        """Hook for metrics: called under the lock whenever the set of loaded variants or a loaded engine's row cap
        changes."""
        if self.on_change is not None:
            self.on_change(set(self.loaded))

    def _check_trust(self, spec: Variant) -> None:
        """With [trust] keys, the variant's bundle must be signed by one of them (edgekit.bundle.signing): checked
        before every load and every switch; a refusal names the bundle file and the reason."""
        if not self.trusted_keys:
            return
        from edgekit.bundle.signing import verify_signature

        try:
            signed = verify_signature(spec.bundle, self.trusted_keys)
        except EdgekitError as err:
            log.warning("variant %s refused: %s", spec.name, err)
            raise
        log.info("variant %s: %s signed by key %s", spec.name, spec.bundle.name, signed.key_id)

    def _load(self, spec: Variant, verified: Bundle | None = None) -> Loaded:
        from edgekit.reporter import Reporter
        from edgekit.target import RuntimeOptions

        self._check_trust(spec)
        self._say(f"loading variant {spec.name}")
        t0 = time.perf_counter()
        digest = manifest_digest(spec.bundle)  # before the load reads it: a change after this one reloads it
        runtime = RuntimeOptions(
            threads=self.threads,
            spin_between_runs=self.spinning,
            state_dir=self.state_dir,
            settings=dict(spec.settings),
        )
        e = self.engine
        reporter = Reporter.from_bundle(
            verified or spec.bundle,  # a bundle the caller has just checked file by file is not hashed again
            runtime=runtime,
            meter=self.meter,
            max_batch=e.max_batch,
            kv_budget_bytes=e.kv_budget_bytes,
            controller=e.batch_controller,
            latency_target_s=e.latency_target_ms / 1e3,
            prefill_chunk=e.prefill_chunk,
        )
        reporter.engine.cap_rows(self.row_caps.get(spec.name))  # warmed as it will serve (`_serve` sets it again)
        load_ms = (time.perf_counter() - t0) * 1e3
        self._say(f"warming variant {spec.name}")
        warm_ms = reporter.warm()
        log.info("variant %s loaded in %.0f ms, warmed in %.0f ms", spec.name, load_ms, warm_ms)
        return Loaded(spec.name, reporter, load_ms, warm_ms, digest)

    def activate(self, name: str) -> Loaded:
        """Load and warm `name` beside the current one, then make it active. With [trust] keys a variant that is
        already loaded is checked again, and loaded afresh (every file checked) if its bundle changed on disk."""
        self.recheck(name)
        with self.hold(name) as loaded, self._lock:  # held: the keep-alive cannot unload it before it is active
            self.active = name
        return loaded

    def recheck(self, name: str) -> None:
        """Before a switch to `name`: its signature again, and a reload if its manifest is not the loaded one."""
        with self._lock:
            spec, loaded = self.specs.get(self.check(name)), self.loaded.get(name)
        if not self.trusted_keys or loaded is None or spec is None:
            return
        self._check_trust(spec)
        if manifest_digest(spec.bundle) != loaded.digest:
            log.warning("variant %s: its bundle changed on disk since it was loaded; loading it again", name)
            with self._lock:
                if self.loaded.get(name) is loaded:
                    del self.loaded[name]
                    self._on_change()

    def load_slot(self, name: str, bundle: Path, verified: Bundle | None = None) -> Loaded:
        """Variant `name`'s settings over another bundle, loaded and warmed beside the serving one (a rollout's
        gate); nothing routes to it until `install`. `verified`: that bundle as `load_bundle` just gave it."""
        return self._load(replace(self.specs[name], bundle=bundle), verified)

    def install(self, name: str, bundle: Path | None, loaded: Loaded | None = None) -> None:
        """Serve `bundle` (None: the config's own) as variant `name` from now on: `loaded` if the caller loaded it,
        else loaded on the next request. Reports running keep the Reporter they hold."""
        with self._lock:
            if bundle is None:
                self.installed.pop(name, None)
            else:
                self.installed[name] = bundle
            self.specs[name] = replace(self.configured[name], bundle=bundle or self.configured[name].bundle)
            self._text.pop(name, None)
            if loaded is not None:
                self._serve(name, loaded)
            else:
                self.loaded.pop(name, None)
                self._on_change()

    def _is_loading(self, name: str) -> bool:
        gate = self._loading.get(name)
        return gate is not None and gate.locked() and name not in self.loaded

    def rows_max(self) -> dict[str, int]:
        """Each loaded variant's engine's row limit now (`Engine.rows_max`)."""
        with self._lock:
            return {name: item.reporter.engine.rows_max for name, item in self.loaded.items()}

    def describe(self) -> list[dict[str, Any]]:
        with self._lock:
            out = []
            for name, spec in sorted(self.specs.items()):
                item = {
                    "name": name,
                    "bundle": str(spec.bundle),
                    "active": name == self.active,
                    "loaded": name in self.loaded,
                    "loading": self._is_loading(name),
                    "settings": dict(spec.settings),
                }
                if name in self.loaded:
                    r = self.loaded[name].reporter
                    item.update(
                        model=r.bundle.name,
                        target=r.bundle.target,
                        load_ms=round(self.loaded[name].load_ms, 1),
                        warm_ms=round(self.loaded[name].warm_ms, 1),
                        in_use=self.loaded[name].in_use,
                        idle_s=round(time.monotonic() - self.loaded[name].last_used, 1),
                    )
                out.append(item)
            return out
