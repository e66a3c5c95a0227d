"""The report runner: what a model worker does with one `Work` the queue hands it.

It holds the pinned variant for the whole report (the registry will not unload it meanwhile), ingests a recovered
job's study, merges the options with that variant's defaults, streams text deltas, and records the outcome: the
job's state in the store, the future a synchronous caller awaits, the metrics and one log line. Logs carry the
error code and the hashed study id only, never a reason (reasons can name files) or the prompt.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from edgekit.errors import EdgekitError, StudyRequiredError, TextModelError

from . import telemetry, trace_spans
from .intake import Ingestor
from .jobs import JobStore
from .metrics import Metrics
from .options import generation_options
from .streams import token_sink
from .variants import Loaded, VariantRegistry
from .work import Work

log = logging.getLogger("edgekitd")

RECENT_REPORTS = 50


class ReportRunner:
    def __init__(self, registry: VariantRegistry, store: JobStore, metrics: Metrics, ingestor: Ingestor):
        self.registry, self.store, self.metrics, self.ingestor = registry, store, metrics, ingestor
        self.recent_ms: deque[float] = deque(maxlen=RECENT_REPORTS)  # the policy's "recent p95" reads these
        # each report's outcome for the rollouts' canary windows: (variant, ok, total_ms, energy_j, energy_source,
        # the digest of the bundle that wrote it: a report begun before a switch is not the new bundle's)
        self.observe: Callable[[str, bool, float | None, float | None, str | None, str | None], None] | None = None
        # the policy's point serving a variant now, for the report's trace (None: no policy, or another's point)
        self.point_of: Callable[[str], str | None] | None = None

    def __call__(self, work: Work) -> None:
        started = time.perf_counter()
        traces: list[Callable[[], None]] = []  # the report's spans, recorded once its caller has the answer
        if work.job_id:
            self.store.mark_running(work.job_id)
        try:
            with self.registry.hold(work.variant) as loaded:
                out = self._report(work, loaded, traces)
            if work.job_id:
                self.store.finish(work.job_id, result=out)
            work.future.set_result(out)
            for record in traces:
                record()
        except EdgekitError as err:
            self.metrics.reports.labels(self._label(work), err.code).inc()
            if err.http_status >= 500:  # the model's fault, not the request's: the canary counts it
                self._observe(work, False)
            log.info("report %s failed: %s", work.job_id or "sync", err.code)
            trace_spans.record_failure(work, err, started=started)
            if work.job_id:
                self.store.finish(work.job_id, error={**err.to_json(), "status": err.http_status})
            work.future.set_exception(err)
        except Exception as exc:  # a bug: keep the traceback in the log, give the client a stable code
            self.metrics.reports.labels(self._label(work), "internal_error").inc()
            self._observe(work, False)
            log.exception("report %s crashed", work.job_id or "sync")
            trace_spans.record_failure(work, exc, started=started)
            if work.job_id:
                self.store.finish(
                    work.job_id, error={"code": "internal_error", "message": type(exc).__name__, "status": 500}
                )
            work.future.set_exception(exc)
        finally:
            work.study = None  # its frames are the bulk of the work's memory: gone with the pool's reservation
            if work.reservation is not None:
                work.reservation.release()
            if work.stream is not None:
                work.stream.close()  # after an error too: readers then see the job's final state
            if work.cleanup is not None:
                shutil.rmtree(work.cleanup, ignore_errors=True)

    def _observe(self, work: Work, ok: bool, total_ms: float | None = None, energy_j: float | None = None) -> None:
        if self.observe is not None and work.variant in self.registry.specs:
            self.observe(work.variant, ok, total_ms, energy_j, None, None)

    def _label(self, work: Work) -> str:
        """A metrics label only once the name is known to be configured (clients choose the name)."""
        return work.variant if work.variant in self.registry.specs else "-"

    def _report(self, work: Work, loaded: Loaded, traces: list[Callable[[], None]]) -> dict[str, Any]:
        t0 = time.perf_counter()
        variant, reporter = loaded.name, loaded.reporter
        has_study = work.study is not None or work.study_path is not None
        if reporter.is_text and has_study:  # a received study, or a job whose variant became a text model
            raise TextModelError(f"variant {variant!r} is a text model: it cannot report on a study")
        ingested = None
        if not reporter.is_text and work.study is None:  # a recovered job: ingested here, held like any other
            if work.study_path is None:  # a prompt alone, for a job whose variant became a vision-language model
                raise StudyRequiredError(f"variant {variant!r} is a vision-language model: it reports on a study")
            work.study, work.reservation = self.ingestor.load(work.study_path, force=True)
            ingested = (t0, time.perf_counter())
        # the prompt as admitted, when this same reporter fitted it; else the options merged and fitted here
        fitted = work.fitted.prompt if work.fitted is not None and work.fitted.reporter is reporter else None
        opts = fitted.options if fitted is not None else generation_options(work.options, reporter.generation_config)
        on_token = finish = None
        if work.stream is not None:
            on_token, finish = token_sink(reporter.tokenizer, work.stream)
        called = time.perf_counter()
        if reporter.is_text:
            report = reporter.report_text(work.prompt, opts, on_token=on_token, cancel=work.cancel, fitted=fitted)
        else:
            report = reporter.report(
                work.study, work.prompt, opts, on_token=on_token, cancel=work.cancel, fitted=fitted
            )
        new_tokens = report.timings.get("new_tokens", 0)
        out = {**report.to_dict(), "variant": variant}
        if work.routing:
            out["routing"] = work.routing
        out["timings"]["queue_ms"] = (t0 - work.accepted) * 1e3
        self.metrics.reports.labels(variant, "ok").inc()
        self.metrics.tokens.labels(variant).inc(new_tokens)
        self.metrics.report_latency.labels(variant).observe(time.perf_counter() - t0)
        self.recent_ms.append(out["timings"]["total_ms"] + out["timings"]["queue_ms"])
        if report.energy_j is not None:
            self.metrics.energy.labels(variant, report.energy_source).inc(report.energy_j)
        if self.observe is not None:
            timings = out["timings"]
            self.observe(variant, True, timings["total_ms"], report.energy_j, report.energy_source, loaded.digest)
        log.info(
            "report %s variant=%s study=%s tokens=%d total_ms=%.0f",
            work.job_id or "sync",
            variant,
            report.study,
            new_tokens,
            out["timings"]["total_ms"],
        )
        if telemetry.enabled():
            traces.append(lambda: self._trace(work, report, reporter, fitted, opts, t0, called, ingested))
        if finish is not None:
            finish(report.text)  # the last delta (if any) and done, before the job reads as finished
        return out

    def _trace(self, work: Work, report, reporter, fitted, opts, started, called, ingested) -> None:
        """The report's spans (trace_spans.record_report), with its prompt's tokens and the image's; a failure here
        costs the trace, never the report."""
        try:
            layout = fitted.layout if fitted is not None else reporter.prompt(report.modality, work.prompt)
            trace_spans.record_report(
                work,
                report,
                started=started,
                called=called,
                ingested=ingested,
                max_tokens=opts.max_new_tokens,
                input_tokens=len(layout.ids) + (0 if reporter.is_text else reporter.context.image_tokens),
                point=self.point_of(work.variant) if self.point_of is not None else None,
            )
        except Exception as exc:  # noqa: BLE001 - tracing is never the report's failure
            log.warning("telemetry: report %s not traced (%s)", work.job_id or "sync", type(exc).__name__)
