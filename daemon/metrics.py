"""Prometheus metrics, in a registry of the daemon's own so tests and several apps in one process do not clash."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
WAIT_BUCKETS = (0.001, 0.0025, 0.005, *LATENCY_BUCKETS)  # a wait that is often none at all


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "edgekitd_requests", "HTTP requests by route and outcome (status code)", ["route", "status"], registry=r
        )
        self.request_latency = Histogram(
            "edgekitd_request_latency_seconds",
            "HTTP request latency by route",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("edgekitd_queue_depth", "Reports waiting for a model worker", registry=r)
        self.running = Gauge("edgekitd_running", "Reports being generated now", registry=r)
        self.rejected = Counter("edgekitd_rejected", "Requests refused because the queue was full", registry=r)
        self.rejected_uploads = Counter(
            "edgekitd_rejected_uploads", "Uploads refused because limits.max_uploads bodies were being read", registry=r
        )
        self.slow_bodies = Counter(
            "edgekitd_slow_bodies", "Requests cut off for a body slower than limits.min_body_rate", registry=r
        )
        self.reports = Counter("edgekitd_reports", "Reports by variant and outcome", ["variant", "outcome"], registry=r)
        self.tokens = Counter("edgekitd_generated_tokens", "Generated tokens by variant", ["variant"], registry=r)
        self.queue_wait = Histogram(
            "edgekitd_queue_wait_seconds", "Time from accepted to started", buckets=LATENCY_BUCKETS, registry=r
        )
        self.report_latency = Histogram(
            "edgekitd_report_latency_seconds",
            "Study-to-report time by variant",
            ["variant"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

        self.ingest_wait = Histogram(
            "edgekitd_ingest_wait_seconds",
            "Time a decoded study waited for an ingest thread and a busy ingest process ([scheduler] ingest_processes)",
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.ingest_memory = Gauge(
            "edgekitd_ingest_memory_bytes",
            "Bytes of studies in memory (being decoded or waiting for a worker), of limits.ingest_memory_bytes",
            registry=r,
        )
        self.quarantined = Counter(
            "edgekitd_quarantined",
            "Jobs and received studies started limits.max_attempts times without finishing, failed as quarantined",
            ["kind"],
            registry=r,
        )

        self.variant_loaded = Gauge(
            "edgekitd_variant_loaded", "1 while a variant is loaded (keep-alive unloads)", ["variant"], registry=r
        )
        # the energy-quality policy (names as the design card gives them)
        self.policy_switches = Counter(
            "edgekit_policy_switches", "Variant switches the policy made", ["from", "to", "reason"], registry=r
        )
        self.power = Gauge("edgekit_power_watts", "Power the meters read now", ["rail", "source"], registry=r)
        self.rollout_steps = Counter(
            "edgekitd_rollout_steps",
            "Steps of bundle rollouts by variant: staged, gated, gate_failed, switched, committed, rolled_back",
            ["variant", "step"],
            registry=r,
        )
        self.energy = Counter(
            "edgekit_energy_joules", "Energy of the reports served, by variant", ["variant", "source"], registry=r
        )
        self.precision_gate = Counter(
            "edgekit_precision_gate", "Studies the precision gate judged, by route", ["route"], registry=r
        )
        self.active_variant = Gauge(
            "edgekit_active_variant", "1 for the variant new work goes to", ["variant"], registry=r
        )
        self.engine_rows = Gauge(
            "edgekitd_engine_rows_max",
            "Rows a loaded variant's engine may decode together now: the served point's batch size, else max_batch",
            ["variant"],
            registry=r,
        )
        self._engine_rows_named: set[str] = set()
        self._engine_rows_lock = threading.Lock()
        self.policy_broken = Gauge(
            "edgekit_policy_constraint_broken",
            "1 while no profiled point meets this constraint",
            ["constraint"],
            registry=r,
        )

        # DICOM networking: instances in (STOW-RS, C-STORE), studies completed, deliveries out
        self.dicom_instances = Counter(
            "edgekitd_dicom_instances",
            "Received DICOM instances by route (stow, dimse) and outcome (stored, or the failure reason in hex)",
            ["via", "outcome"],
            registry=r,
        )
        self.dicom_studies = Counter(
            "edgekitd_dicom_studies", "Received studies handed over as jobs, by outcome", ["outcome"], registry=r
        )
        self.dicom_associations = Counter(
            "edgekitd_dicom_associations", "DIMSE associations by outcome (accepted, rejected)", ["outcome"], registry=r
        )
        self.deliveries = Counter(
            "edgekitd_deliveries",
            "Delivery attempts by destination and outcome (delivered, retry, dead, skipped)",
            ["destination", "outcome"],
            registry=r,
        )
        self.deliveries_now = Gauge(
            "edgekitd_deliveries_state", "Deliveries in the store by state (dead = dead letters)", ["state"], registry=r
        )
        self.delivery_latency = Histogram(
            "edgekitd_delivery_latency_seconds",
            "Time from a report finished to its delivery",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def set_loaded(self, loaded: set[str], known: set[str]) -> None:
        for name in known:
            self.variant_loaded.labels(name).set(1 if name in loaded else 0)

    def set_active(self, active: str, known: set[str]) -> None:
        for name in known:
            self.active_variant.labels(name).set(1 if name == active else 0)

    def set_engine_rows(self, rows: dict[str, int]) -> None:
        """Each loaded variant's row limit; a variant no longer loaded has no engine, so its series goes."""
        with self._engine_rows_lock:
            for name in self._engine_rows_named - rows.keys():
                self.engine_rows.remove(name)
            for name, n in rows.items():
                self.engine_rows.labels(name).set(n)
            self._engine_rows_named = set(rows)

    def set_broken(self, broken: tuple[str, ...]) -> None:
        for name in ("power_budget_w", "energy_budget_j", "quality_floor_f1", "latency_slo_ms"):
            self.policy_broken.labels(name).set(1 if name in broken else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
