"""Study in, report out: the one path that the CLI, `edgekit eval` and the daemon all share.

ingest (DICOM or video) -> display values -> model input -> image features + prompt -> generation on the bundle's
target backend -> text -> structured findings. Each stage is timed so that latency figures say where time went.
A text model's bundle (a decoder alone, no vision graph: a report model reading structured findings or prior
reports) takes the same path from the prompt on (`Reporter.report_text`): layout, context budget, generation,
findings, timings and energy are shared, only the study is not there.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from edgekit.bundle import Bundle, load_bundle
from edgekit.engine import Cancelled, Engine, Request, make_controller
from edgekit.errors import BundleError, EdgekitError, StudyRequiredError, TextModelError
from edgekit.findings import parse_report
from edgekit.generate import GenerationOptions, GenerationResult, OnToken, request_options
from edgekit.ingest import IngestLimits, Study, load_study
from edgekit.plugins import load_backend
from edgekit.positions import PositionScheme
from edgekit.preprocess import PreprocessConfig, preprocess_frames, sample_indices
from edgekit.prompt import PromptLayout, context_positions, image_tokens, prompt_layout
from edgekit.target import RuntimeOptions

_SECTION = re.compile(r"\b(FINDINGS|IMPRESSION)\s*:\s*", re.IGNORECASE)


@dataclass
class Report:
    text: str
    findings_text: str
    impression: str
    findings: list[dict]
    negatives: list[str]
    modality: str
    study: str  # hashed study UID: safe to log
    model: str
    target: str
    stop_reason: str
    timings: dict = field(default_factory=dict)  # wall clock, ms per stage
    warnings: list[str] = field(default_factory=list)  # what ingest skipped or changed, and what was capped
    cost: dict = field(default_factory=dict)  # what the target measured or emulated (x1: cycles, energy), + source
    energy_j: float | None = None  # this report's energy, from the target (x1: emulated) or the reporter's meter
    energy_source: str | None = None  # measured:<sensor> | emulated:x1 | estimated:<model>; None: nothing measured
    frames: dict = field(default_factory=dict)  # {"used", "of", "model_frames"}: which of the input's frames it saw

    def to_dict(self) -> dict:
        return asdict(self)


def split_sections(text: str) -> tuple[str, str]:
    """(findings, impression) of a "FINDINGS: ... IMPRESSION: ..." report; the whole text is findings otherwise."""
    parts = _SECTION.split(text)
    sections = {parts[i].upper(): parts[i + 1].strip() for i in range(1, len(parts) - 1, 2)}
    if not sections:
        return text.strip(), ""
    return sections.get("FINDINGS", ""), sections.get("IMPRESSION", "")


def report_energy(cost: dict, window, share: float = 1.0) -> tuple[float | None, str | None]:
    """A target that emulates or measures its own device's energy (its cost says so: x1's emulator) is billed by
    it, not by a meter of the host that runs the emulator; otherwise the meter's window over generation, if any,
    times the report's `share` of it (`Timings.meter_share`): a host meter sees the whole machine, and eight
    reports decoding together would otherwise each be billed the other seven's part, a queued one the decoding of
    those ahead of it."""
    from edgekit.energy.emulated import energy_from_cost

    own = energy_from_cost(cost)
    if own is not None:
        return own.joules, own.source
    joules = getattr(window, "joules", None)
    return (float(joules) * share, window.source) if joules is not None else (None, None)


class EmptyPromptError(EdgekitError):
    """A text model asked for a report without a prompt: it has nothing else to read."""

    code = "empty_prompt"
    http_status = 422


class PromptTooLongError(EdgekitError):
    """A prompt that leaves the model no room to write the report."""

    code = "prompt_too_long"
    http_status = 422


@dataclass(frozen=True)
class ContextBudget:
    """How many positions the decoder has and how many the image takes: the prompt and the report share the rest."""

    positions: int | None  # None: the config does not say
    image_tokens: int

    @classmethod
    def of(cls, model_config: dict) -> ContextBudget:
        """From the bundle's config.json, through the one reader of both facts (`edgekit.prompt`)."""
        return cls(context_positions(model_config), image_tokens(model_config))

    def fit(self, prompt_tokens: int, options: GenerationOptions, warnings: list[str]) -> GenerationOptions:
        """Refuse a prompt with no room left for a report; lower max_new_tokens to what fits (and say so)."""
        if self.positions is None:
            return options
        room = self.positions - self.image_tokens - prompt_tokens
        if room < 1:
            image = f"{self.image_tokens} image tokens and " if self.image_tokens else ""
            raise PromptTooLongError(
                f"prompt is {prompt_tokens} tokens; this model's context of {self.positions} positions holds "
                f"{image}at most {self.positions - self.image_tokens - 1} prompt tokens with room for a report"
            )
        if options.max_new_tokens > room:
            warnings.append(
                f"max_new_tokens lowered from {options.max_new_tokens} to {room}: the prompt leaves {room} of "
                f"the model's {self.positions} positions"
            )
            return replace(options, max_new_tokens=room)
        return options


@dataclass(frozen=True)
class FittedPrompt:
    """A prompt tokenised and fitted to the context once: what `Reporter.fit_prompt` makes and `report` or
    `report_text` take instead of doing it again (the daemon fits a request's prompt when it admits it)."""

    modality: str
    prompt: str
    layout: PromptLayout
    options: GenerationOptions  # with the bundle's stop token, capped to what the context leaves
    warnings: tuple[str, ...] = ()


class Reporter:
    """A loaded bundle ready to write reports. Loading is the expensive part; reuse one per process."""

    def __init__(
        self,
        bundle: Bundle,
        *,
        threads: int | None = None,
        backend=None,
        runtime: RuntimeOptions | None = None,
        meter=None,
        limits: IngestLimits | None = None,
        max_batch: int = 8,
        kv_budget_bytes: int | None = None,
        controller: str = "fixed",
        latency_target_s: float = 0.05,
        prefill_chunk: int | None = None,
    ):
        """`backend` defaults to the bundle target's run side with `runtime` (or just `threads`). `meter` (an
        `edgekit.energy` sampler: `window()` gives a context whose `.joules` and `.source` are set on exit) bills
        each report's energy where the target does not emulate its own; `limits` bound what ingest reads.
        Reports from several threads decode together in one engine (`edgekit.engine`: up to `max_batch` rows,
        within `kv_budget_bytes` of KV cache, sized by the `controller` named, whole prompts or `prefill_chunk`
        tokens per step)."""
        from tokenizers import Tokenizer

        self.bundle = bundle
        self.meter = meter
        self.limits = limits
        if backend is None:
            backend = load_backend(bundle, runtime if runtime is not None else RuntimeOptions(threads=threads))
        self.backend = backend
        self.tokenizer = Tokenizer.from_file(str(bundle.component("tokenizer")))
        self.generation_config = json.loads(bundle.component("generation_config").read_text())
        # a text model's bundle has no image preprocessing (nor vision graph)
        self.preprocess_config = (
            None if self.is_text else PreprocessConfig.load(bundle.component("preprocessor_config"))
        )
        config_path = bundle.component("model_config")
        model_config = json.loads(config_path.read_text())
        self.context = ContextBudget.of(model_config)
        if self.is_text and self.context.image_tokens:
            raise BundleError(
                f"the model takes images ({self.context.image_tokens} positions each) but the bundle has no vision "
                "graph",
                config_path,
            )
        # the decoder's kind of position_ids (M-RoPE: Qwen2-VL)
        self.positions = PositionScheme.of(model_config, config_path)
        self.engine = Engine(
            self.backend,
            positions=self.positions,
            max_batch=max_batch,
            kv_budget_bytes=kv_budget_bytes,
            controller=make_controller(controller, max_batch, self.backend, latency_target_s),
            prefill_chunk=prefill_chunk,
            image_tokens=self.context.image_tokens,
        ).start()

    @property
    def is_text(self) -> bool:
        """A text model's bundle: reports come from `report_text(prompt)`, never from a study."""
        return self.bundle.is_text

    def close(self) -> None:
        """Let the reports in flight finish and stop the engine's thread."""
        self.engine.close()

    def generate(
        self, pixels, ids: np.ndarray, options: GenerationOptions, on_token=None, image_slot: int = 0, cancel=None
    ) -> tuple[GenerationResult, dict]:
        """One sequence through the engine, beside whatever other threads are generating: its result and what
        the target billed it. `cancel` (a threading.Event) ends it at the next step: `Cancelled` is raised."""
        result = self.engine.submit(Request(ids, options, pixels, image_slot, on_token, cancel)).result()
        if result.stop_reason == "cancelled":
            raise Cancelled("the report was cancelled before it finished")
        return result, result.cost

    @classmethod
    def from_bundle(cls, path: str | Path | Bundle, **kw) -> Reporter:
        return cls(path if isinstance(path, Bundle) else load_bundle(path), **kw)

    def warm(self) -> float:
        """One short generation on a blank study, so the first real request does not pay for lazy initialisation
        (sessions, kernels, caches); its milliseconds. The blank study bills no energy: no meter runs. A text model
        warms on a prompt alone."""
        meter, self.meter = self.meter, None
        t0 = time.perf_counter()
        try:
            if self.is_text:
                self.report_text("warm-up", GenerationOptions(max_new_tokens=2))
            else:
                size = self.image_config.image_size
                frames = np.zeros((1, size, size), np.float32)
                study = Study(frames, modality="CT", uid_hash="uid:warmup", source="dicom")
                self.report(study, "warm-up", GenerationOptions(max_new_tokens=2))
        finally:
            self.meter = meter
        return (time.perf_counter() - t0) * 1e3

    @property
    def image_config(self) -> PreprocessConfig:
        """The bundle's image preprocessing; a text model's bundle has none (`TextModelError`)."""
        if self.preprocess_config is None:
            raise TextModelError("this bundle is a text model (no vision graph): it takes no images")
        return self.preprocess_config

    @property
    def default_options(self) -> GenerationOptions:
        return self.options()

    def options(
        self,
        *,
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> GenerationOptions:
        """The request's choices over the bundle's generation config (`edgekit.generate.request_options`)."""
        return request_options(
            self.generation_config, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed
        )

    def prompt(self, modality: str, prompt: str) -> PromptLayout:
        """The prompt's text tokens and where the image goes among them (the bundle's template says)."""
        return prompt_layout(self.tokenizer, self.generation_config, modality, prompt)

    def prompt_ids(self, modality: str, prompt: str) -> np.ndarray:
        return np.asarray([self.prompt(modality, prompt).ids], dtype=np.int64)

    def model_frames(self, study: Study) -> int:
        """Frames the vision encoder sees: the model's own count, or fewer for a video sampled with a lower
        `video_max_frames` (frame skipping, as the daemon's policy or `edgekit pareto --video-max-frames` asks).
        The encoder pools across frames (mean and standard deviation), so it takes any count, and fewer cost
        less; a study with fewer frames than the count has them repeated, as in training. A study of one frame
        (a radiograph, one slice) is seen once: repeated, its mean is the frame and its deviation 0, as alone
        (features within 2.4e-7 of the repeated ones on the cr_chest sample; 5.2 -> 0.8 ms of encoder on cpu)."""
        if study.num_frames == 1:
            return 1
        count = self.image_config.num_frames
        cap = study.meta.get("video_max_frames") if study.source == "video" else None
        return min(count, int(cap)) if cap else count

    def pixel_values(self, study: Study) -> np.ndarray:
        cfg = self.image_config
        count = self.model_frames(study)
        return preprocess_frames(study.frames, cfg if count == cfg.num_frames else replace(cfg, num_frames=count))[None]

    def frames_used(self, study: Study, warnings: list[str]) -> dict:
        """Which of the input's frames the model saw, so no frame is dropped silently; frame skipping also warns."""
        count = self.model_frames(study)
        total = int(study.meta.get("source_frames") or study.num_frames)
        used = len(set(sample_indices(study.num_frames, count).tolist()))
        if count < self.image_config.num_frames and used < total:
            warnings.append(
                f"frame skipping: the model saw {used} of the video's {total} frames (video_max_frames = "
                f"{study.meta['video_max_frames']}; without skipping it takes {self.image_config.num_frames})"
            )
        return {"used": used, "of": total, "model_frames": count}

    def fit_prompt(self, modality: str, prompt: str, options: GenerationOptions | None = None) -> FittedPrompt:
        """The prompt's tokens and the options fitted to the context (`prompt_too_long` when it cannot fit)."""
        layout = self.prompt(modality, prompt)
        warnings: list[str] = []
        opts = options or self.default_options
        if not opts.stop_token_ids:  # a copy: the caller's options stay as they were
            opts = replace(opts, stop_token_ids=[self.generation_config["eos_token_id"]])
        return FittedPrompt(
            modality, prompt, layout, self.context.fit(len(layout.ids), opts, warnings), tuple(warnings)
        )

    def _fitted(
        self, modality: str, prompt: str, options: GenerationOptions | None, fitted: FittedPrompt | None
    ) -> FittedPrompt:
        """`fitted` when it is this prompt's (modality and text), else fitted here."""
        if fitted is not None and (fitted.modality, fitted.prompt) == (modality, prompt):
            return fitted
        return self.fit_prompt(modality, prompt, options)

    def report(
        self,
        study: Study | str | Path,
        prompt: str = "",
        options: GenerationOptions | None = None,
        on_token: OnToken | None = None,
        cancel=None,
        fitted: FittedPrompt | None = None,
    ) -> Report:
        """`on_token(token_id, index)` sees each report token as it is generated (the daemon streams them);
        setting `cancel` (a threading.Event) ends the report at the engine's next step (`Cancelled`); `fitted`:
        the prompt already fitted (`fit_prompt`), its options used in place of `options`."""
        if self.is_text:
            raise TextModelError("this bundle is a text model (no vision graph): it writes reports from a prompt alone")
        t0 = time.perf_counter()
        if not isinstance(study, Study):
            study = load_study(study, limits=self.limits)
        t1 = time.perf_counter()
        fit = self._fitted(study.modality, prompt, options, fitted)
        warnings = [*study.warnings, *fit.warnings]
        pixels = self.pixel_values(study)
        frames = self.frames_used(study, warnings)
        timings = {"ingest_ms": study.ingest_ms}
        if study.ingest_wait_ms is not None:
            timings["ingest_wait_ms"] = study.ingest_wait_ms
        report = self._write(fit.layout, fit.options, pixels, warnings, on_token, cancel, timings, t0, t1)
        return replace(report, modality=study.modality, study=study.uid_hash, frames=frames)

    def report_text(
        self,
        prompt: str,
        options: GenerationOptions | None = None,
        on_token: OnToken | None = None,
        cancel=None,
        fitted: FittedPrompt | None = None,
    ) -> Report:
        """A text model's report of `prompt` (structured findings, a prior report, a question): as `report`, with
        no study (`modality`, `study` and `frames` are empty)."""
        if not self.is_text:
            raise StudyRequiredError("this bundle is a vision-language model: it writes reports of a study")
        if not prompt.strip():
            raise EmptyPromptError("a text model writes its report from the prompt, and the prompt is empty")
        t0 = time.perf_counter()
        fit = self._fitted("", prompt, options, fitted)
        return self._write(fit.layout, fit.options, None, list(fit.warnings), on_token, cancel, {}, t0, t0)

    def _write(
        self, layout: PromptLayout, opts, pixels, warnings: list[str], on_token, cancel, before: dict, t0, t1
    ) -> Report:
        """Generate (image features from `pixels`, or text only when None), then decode, parse and time the
        report; `before` holds the timings of what came before the prompt (a study's ingest)."""
        ids = np.asarray([layout.ids], dtype=np.int64)
        t2 = time.perf_counter()
        window = self.meter.window() if self.meter is not None else contextlib.nullcontext()
        with window:
            result, cost = self.generate(pixels, ids, opts, on_token, layout.image_slot, cancel)
        t3 = time.perf_counter()
        energy_j, energy_source = report_energy(cost, window, result.timings.meter_share)
        text = self.tokenizer.decode([int(t) for t in result.token_ids], skip_special_tokens=True).strip()
        findings_text, impression = split_sections(text)
        parsed = parse_report(text)
        timings = {
            **before,
            "preprocess_ms": (t2 - t1) * 1e3,
            **{k: v for k, v in asdict(result.timings).items()},
            "generate_ms": (t3 - t2) * 1e3,
            "total_ms": (t3 - t0) * 1e3,
            "new_tokens": len(result.token_ids),
        }
        return Report(
            text=text,
            findings_text=findings_text,
            impression=impression,
            findings=[asdict(f) for f in parsed.findings],
            negatives=list(parsed.negatives),
            modality="",
            study="",
            model=self.bundle.name,
            target=self.bundle.target,
            stop_reason=result.stop_reason,
            timings=timings,
            warnings=warnings,
            cost=cost,
            energy_j=energy_j,
            energy_source=energy_source,
        )
