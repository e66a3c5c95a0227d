"""A bundle rollout on a device under steady load (issue #31): edgekitd serving variant `a` from bundle A gets
bundle B, then a bad bundle C (its weights altered and the manifest written again: every checksum passes, its own
reference outputs do not), then a bundle D that passes its gate but is slow (about 7x the latency: a much larger
model of the same family), so it breaches the canary's p95 latency. Then `kill -9` at each rollout step.

Part 1, one daemon, two client threads through the whole run (one sending synchronous `POST /v1/reports`, one
alternating them with durable `POST /v1/jobs`, each paced at `--interval`): B must be committed, C refused at the
gate before any switch (no report ever served by it), D switched to and rolled back by its canary within the window.
Every request is recorded (time, status, the bundle that served it by its model name); every accepted job must
complete. The step times come from the slot state (`variants/a/state.json`, what `GET /v1/variants` shows), the
counts from `edgekitd_rollout_steps_total` on /metrics.

Part 2, for each failpoint (received, staged, gated, switched, committed): a fresh daemon serving A with
`EDGEKIT_FAILPOINT=<step>`, the same steady load (reports and jobs), B posted; the daemon SIGKILLs itself at that
step; it is restarted without the failpoint on the same state dir and must serve A (killed before the commit) or B
(killed after it), never anything half-written, and every job accepted (202) before the kill must complete. Requests
the client sent while the daemon was deliberately dead or restarting got an error (connection refused or reset, or
503 not_ready): they are counted apart as `refused_during_kill`, not as failed, since the client knows; a request
is "lost" only as an accepted job that never completes. Prints a timeline and tables, writes JSON.

    python bench/rollout.py [--interval 0.1] [--out bench/rollout.json]

Bundles are built here from random weights (A, B: the tests' tiny architecture, 16 new tokens; D: hidden 512, 10
layers), so it runs in about two minutes on two cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from edgekit.daemon.client import Client, study_files
from edgekit.daemon.testing import DaemonProcess, write_tiny_model

REPO = Path(__file__).resolve().parents[1]
STUDY = REPO / "models" / "samples" / "cr_chest" / "image.dcm"
FAILPOINTS = ("received", "staged", "gated", "switched", "committed")
PARTS = ("main", *FAILPOINTS)
NEW_TOKENS = 16
SLOW = dict(
    hidden=512,
    layers=10,
    heads=8,
    kv_heads=2,
    intermediate=1408,
    vision_hidden=128,
    vision_layers=3,
    vision_heads=4,
    vision_mlp=256,
)


# --- bundles ----------------------------------------------------------------------------------------------------------
def slow_model(out: Path, seed: int) -> Path:
    """A model directory of the same family as the tiny one, much larger (SLOW): it passes its own gate (its
    reference outputs are its own) but takes several times as long per report."""
    from safetensors.numpy import save_file

    from edgekit.export import random_weights
    from edgekit.export.model_config import ModelConfig

    model = write_tiny_model(out, seed=seed, max_new_tokens=NEW_TOKENS)
    cfg = dataclasses.replace(ModelConfig.load(model / "config.json"), **SLOW)
    save_file(random_weights(cfg, seed), str(model / "model.safetensors"))
    (model / "config.json").write_text(json.dumps(cfg.to_dict()))
    return model


def tampered(bundle_path: Path, work: Path, name: str) -> Path:
    """The bundle with its embedding table's rows shuffled (other weights) under a manifest written again, so every
    checksum passes (as tests/bundle_tamper.py makes it); renamed `name` so a report it served would show."""
    import onnx
    from onnx import numpy_helper

    from edgekit.bundle import load_bundle, write_bundle

    b = load_bundle(bundle_path)
    src = b.component("embed_tokens")
    model = onnx.load(str(src))
    table = max(model.graph.initializer, key=lambda t: int(np.prod(t.dims)))
    values = numpy_helper.to_array(table)
    table.CopyFrom(numpy_helper.from_array(values[np.random.default_rng(0).permutation(values.shape[0])], table.name))
    work.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(work / src.name))
    files = {r: b.component(r) for r in b.roles}
    files["embed_tokens"] = work / src.name
    m = b.manifest
    return write_bundle(work / "bundle", files, name=name, target=m.target, provenance=m.provenance, runtime=m.runtime)


def make_bundles(root: Path) -> dict[str, dict]:
    """A (a directory, the config's bundle), B and D (.ekb), C (B tampered, .ekb); each with its digest and name."""
    from edgekit.build import build
    from edgekit.bundle import load_bundle, pack_bundle

    out = {}
    t0 = time.perf_counter()
    a = build("cpu", root / "A", model_dir=write_tiny_model(root / "mA", seed=0, max_new_tokens=NEW_TOKENS),
              parity=False, name="bench-a").bundle  # fmt: skip
    b_dir = build("cpu", root / "B", model_dir=write_tiny_model(root / "mB", seed=5, max_new_tokens=NEW_TOKENS),
                  parity=False, name="bench-b").bundle  # fmt: skip
    d_dir = build("cpu", root / "D", model_dir=slow_model(root / "mD", seed=7), parity=False, name="bench-d").bundle
    c_dir = tampered(b_dir, root / "C", "bench-c")
    paths = {
        "A": a,
        "B": pack_bundle(b_dir, root / "B.ekb"),
        "C": pack_bundle(c_dir, root / "C.ekb"),
        "D": pack_bundle(d_dir, root / "D.ekb"),
    }
    for key, path in paths.items():
        bundle = load_bundle(path)
        out[key] = {"path": path, "digest": bundle.digest, "model": bundle.name}
    out["build_s"] = time.perf_counter() - t0  # type: ignore[assignment]
    return out


def write_config(root: Path, bundle_a: Path, args) -> Path:
    path = root / "edgekitd.toml"
    path.write_text(
        f"[rollout]\ncanary_reports = {args.canary_reports}\nmin_reports = {args.min_reports}\n"
        f"canary_s = {args.canary_s}\nmax_p95_ratio = {args.max_p95_ratio}\n"
        f'[[variants]]\nname = "a"\nbundle = "{bundle_a}"\n'
    )
    return path


# --- the steady load --------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Record:
    t0: float  # seconds since the run's start
    t1: float
    kind: str  # report | job
    status: int | None  # None: no HTTP answer (connection error)
    error: str | None = None  # the exception's type, or the answer's error code
    model: str | None = None  # the bundle that served it (the report's `model`: each bundle has its own name)
    job_id: str | None = None
    phase: str = ""  # the run's part: main | failpoint name


class Load:
    """Client threads sending to whichever daemon listens on `socket`, paced at `interval` each; thread 0 sends
    synchronous reports, thread 1 alternates reports and durable jobs. `pause()` waits until none is in flight."""

    def __init__(self, socket: Path, start: float, interval: float, threads: int = 2):
        self.client = Client(socket, timeout=120)
        self.start, self.interval = start, interval
        self.files = study_files(STUDY)
        self.records: list[Record] = []
        self.phase = "main"
        self._lock = threading.Lock()
        self._run = threading.Event()
        self._stop = threading.Event()
        self._busy = [False] * threads
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(threads)]

    def now(self) -> float:
        return time.time() - self.start

    def begin(self) -> None:
        for t in self._threads:
            t.start()

    def resume(self, phase: str) -> None:
        self.phase = phase
        self._run.set()

    def pause(self) -> None:
        self._run.clear()
        while any(self._busy):
            time.sleep(0.01)

    def stop(self) -> None:
        self.pause()
        self._stop.set()
        for t in self._threads:
            t.join(10)

    def send(self, kind: str) -> Record:
        """One `POST /v1/reports` (synchronous) or `POST /v1/jobs` (durable, 202), recorded."""
        rec = Record(self.now(), 0.0, kind, None, phase=self.phase)
        try:
            r = self.client.post_study(f"/v1/{kind}s", self.files, {"prompt": "Cough."})
            rec.status = r.status
            if r.status == 200 and kind == "report":
                rec.model = r.json().get("model")
            elif r.status == 202 and kind == "job":
                rec.job_id = r.json()["id"]
            else:
                rec.error = r.error_code
        except OSError as exc:
            rec.error = type(exc).__name__
        rec.t1 = self.now()
        with self._lock:
            self.records.append(rec)
        return rec

    def burst(self, n: int) -> threading.Thread:
        """`n` durable jobs back to back in a thread of their own (some still queued when a kill lands)."""
        t = threading.Thread(target=lambda: [self.send("job") for _ in range(n)], daemon=True)
        t.start()
        return t

    def _loop(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            if not self._run.wait(0.05):
                continue
            with self._lock:
                self._busy[i] = True
            if not self._run.is_set():  # paused between the wait and here
                self._busy[i] = False
                continue
            n += 1
            self.send("job" if i == 1 and n % 2 == 0 else "report")
            with self._lock:
                self._busy[i] = False
            time.sleep(self.interval)


def wait_jobs(client: Client, ids: list[str], timeout: float) -> dict[str, dict]:
    """Each job's final JSON (state succeeded or failed), or its last state when `timeout` ran out (or 'missing')."""
    out: dict[str, dict] = {}
    deadline = time.monotonic() + timeout
    todo = list(ids)
    while todo and time.monotonic() < deadline:
        left = []
        for j in todo:
            r = client.get(f"/v1/jobs/{j}")
            job = r.json() if r.status == 200 else {"state": "missing", "status": r.status}
            out[j] = job
            if job["state"] not in ("succeeded", "failed"):
                left.append(j)
        todo = left
        if todo:
            time.sleep(0.2)
    return out


def slot_state(state_dir: Path) -> dict:
    return json.loads((state_dir / "variants" / "a" / "state.json").read_text())


def rollout_counts(client: Client) -> dict[str, float]:
    text = client.get("/metrics").body.decode()
    pat = re.compile(r"^edgekitd_rollout_steps_total\{([^}]*)\}\s+(\S+)$")
    out = {}
    for line in text.splitlines():
        m = pat.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            out[f"{labels.get('variant')}/{labels.get('step')}"] = float(m.group(2))
    return out


def wait_phase(client: Client, phases: set[str], timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        slots = client.get("/v1/variants").json()["variants"][0]["slots"]
        if slots["phase"] in phases or time.monotonic() > deadline:
            return slots
        time.sleep(0.1)


# --- part 1: B, C, D under load ---------------------------------------------------------------------------------------
def main_run(root: Path, bundles: dict, args, timeline: list) -> dict:
    state = root / "state-main"
    config = write_config(root, bundles["A"]["path"], args)
    d = DaemonProcess(state, config=config).start(wait_ready=300)
    start = time.time()
    load = Load(d.socket, start, args.interval)

    def event(what: str, t: float | None = None) -> None:
        timeline.append((round(load.now() if t is None else t, 3), "main", what))

    out: dict = {}
    try:
        event("edgekitd ready, serving A; steady load starts")
        load.begin()
        load.resume("main")
        time.sleep(args.warm_s)  # A's own recent figures: the canary's latency baseline

        posts = {}
        for key in ("B", "C", "D"):
            event(f"POST /v1/variants/a/bundles ({key}: {bundles[key]['model']} {bundles[key]['digest'][:12]})")
            t = time.perf_counter()
            r = d.client.request(
                "POST",
                "/v1/variants/a/bundles",
                bundles[key]["path"].read_bytes(),
                {"Content-Type": "application/octet-stream"},
                timeout=300,
            )
            body = r.json()
            posts[key] = {"status": r.status, "seconds": time.perf_counter() - t, "body": body}
            event(f"  answered {r.status} {body.get('phase') or (body.get('error') or {}).get('code')}")
            if key == "B":
                slots = wait_phase(d.client, {"committed", "rolled_back"}, args.canary_s + 30)
                event(f"  B's canary ended: {slots['phase']}")
            elif key == "D" and r.status == 200:
                slots = wait_phase(d.client, {"committed", "rolled_back"}, args.canary_s + 30)
                event(f"  D's canary ended: {slots['phase']}")
            time.sleep(args.settle_s)
        load.pause()
        event("steady load paused")
        counts = rollout_counts(d.client)
        variants = d.client.get("/v1/variants").json()["variants"][0]
        jobs = [r.job_id for r in load.records if r.job_id]
        finished = wait_jobs(d.client, jobs, 120)
        event(f"{len(jobs)} accepted jobs waited for")
    finally:
        load.stop()
        d.stop()
    history = slot_state(state)["history"]
    for h in history:
        reason = f": {h['reason'][:90]}" if h.get("reason") else ""
        timeline.append((round(h["at"] - start, 3), "main", f"slot step {h['step']}{reason}"))

    def steps_of(i0: int, i1: int | None = None) -> list[dict]:
        return history[i0:i1]

    # the rollouts in order: B (staged ... committed), C (staged, gate_failed), D (staged ... rolled_back)
    starts = [i for i, h in enumerate(history) if h["step"] == "staged"]
    per = {k: steps_of(starts[i], starts[i + 1] if i + 1 < len(starts) else None) for i, k in enumerate("BCD")}
    served = [r for r in load.records if r.kind == "report" and r.model]

    def first_served(model: str) -> float | None:
        ts = [r.t1 for r in served if r.model == model]
        return min(ts) if ts else None

    def names(steps: list[dict]) -> list[str]:
        return [s["step"] for s in steps]

    def at(steps: list[dict], step: str) -> float | None:
        return next((s["at"] - start for s in steps if s["step"] == step), None)

    b_steps, c_steps, d_steps = per.get("B", []), per.get("C", []), per.get("D", [])
    d_switched, d_back = at(d_steps, "switched"), at(d_steps, "rolled_back")
    d_reason = next((s.get("reason", "") for s in d_steps if s["step"] == "rolled_back"), "")
    # the window's figures at the rollback: in the log line of the step (the slot history keeps the reason only)
    logged = re.findall(r"rollout a: rolled_back: canary: .* \((\{.*\})\)$", d.log.read_text(), re.M)
    d_window = json.loads(logged[-1]) if logged else None
    d_served = [r for r in served if r.model == bundles["D"]["model"]]
    main_jobs = job_summary(jobs, finished)
    out["B"] = {
        "post": posts["B"],
        "steps": names(b_steps),
        "committed": names(b_steps)[-1:] == ["committed"],
        "switched_at_s": at(b_steps, "switched"),
        "committed_at_s": at(b_steps, "committed"),
        "canary_s": None if at(b_steps, "committed") is None else at(b_steps, "committed") - at(b_steps, "switched"),
        "reports_served": sum(r.model == bundles["B"]["model"] for r in served),
    }
    out["C"] = {
        "post": posts["C"],
        "steps": names(c_steps),
        "refused_before_switch": posts["C"]["status"] == 422
        and names(c_steps) == ["staged", "gate_failed"]
        and not any(r.model == bundles["C"]["model"] for r in served),
        "code": (posts["C"]["body"].get("error") or {}).get("code"),
        "reason": (posts["C"]["body"].get("error") or {}).get("message"),
        "reports_served": sum(r.model == bundles["C"]["model"] for r in served),
    }
    out["D"] = {
        "post": posts["D"],
        "steps": names(d_steps),
        "rolled_back": names(d_steps)[-1:] == ["rolled_back"],
        "switched_at_s": d_switched,
        "rolled_back_at_s": d_back,
        "seconds_after_switch": None if d_back is None or d_switched is None else d_back - d_switched,
        "canary_window": {"reports": args.canary_reports, "seconds": args.canary_s},
        "window_at_rollback": d_window,
        "reports_in_window_at_rollback": d_window["reports"] if d_window else None,
        "within_window": bool(
            d_back is not None
            and d_switched is not None
            and d_back - d_switched < args.canary_s
            and d_window
            and d_window["reports"] < args.canary_reports
        ),
        "reason": d_reason,
        "reports_served": len(d_served),
        "jobs_served": main_jobs["served_by"].get(bundles["D"]["model"], 0),
        # started on D before the rollback, answered after it (a running report keeps the bundle it started on)
        "reports_by_D_answered_after_rollback": sum(d_back is not None and r.t1 > d_back for r in d_served),
        "latency_ms_served_by_D_p50": float(np.median([(r.t1 - r.t0) * 1e3 for r in d_served])) if d_served else None,
        "latency_ms_served_by_B_p50": float(
            np.median([(r.t1 - r.t0) * 1e3 for r in served if r.model == bundles["B"]["model"]])
        ),
    }
    for key in ("A", "B", "C", "D"):
        t = first_served(bundles[key]["model"])
        if t is not None:
            timeline.append((round(t, 3), "main", f"first report served by {key} ({bundles[key]['model']})"))
    after_d = [r.model for r in served if d_back is not None and r.t0 > d_back + 1.0]
    out["served_after_rollback"] = sorted(set(after_d))
    out["live_at_end"] = {"model": variants.get("model"), "digest": (variants["slots"]["live"] or {}).get("digest")}
    out["metrics_rollout_steps_total"] = counts
    out["requests"] = summarize(load.records, [])
    out["jobs"] = main_jobs
    return out


def summarize(records: list[Record], kill_windows: list[tuple[float, float]]) -> dict:
    """Sent, ok (2xx), refused during a deliberate kill (no answer, or 503 not_ready, while the daemon was being
    killed and restarted), and failed: any other non-2xx answer or connection error."""

    def in_kill(r: Record) -> bool:
        return any(a <= r.t0 <= b or a <= r.t1 <= b for a, b in kill_windows)

    ok = [r for r in records if r.status is not None and 200 <= r.status < 300]
    refused = [r for r in records if r not in ok and in_kill(r) and (r.status is None or r.error == "not_ready")]
    failed = [r for r in records if r not in ok and r not in refused]
    errors: dict[str, int] = {}
    for r in refused:
        errors[r.error or str(r.status)] = errors.get(r.error or str(r.status), 0) + 1
    return {
        "sent": len(records),
        "reports": sum(r.kind == "report" for r in records),
        "jobs_posted": sum(r.kind == "job" for r in records),
        "ok": len(ok),
        "refused_during_kill": len(refused),
        "refused_during_kill_by_error": errors,
        "failed": len(failed),
        "failed_detail": [dataclasses.asdict(r) for r in failed][:20],
        "served_by": {m: sum(r.model == m for r in ok) for m in sorted({r.model for r in ok if r.model})},
    }


def job_summary(ids: list[str], finished: dict[str, dict], killed_at: float | None = None) -> dict:
    """Accepted jobs and how they ended; with `killed_at` (epoch s), how many had finished before the kill and
    how many were finished by the restarted daemon."""
    jobs = [finished.get(j, {"state": "missing"}) for j in ids]
    states = [j["state"] for j in jobs]
    out = {
        "accepted": len(ids),
        "succeeded": states.count("succeeded"),
        "failed": states.count("failed"),
        "lost": len(ids) - states.count("succeeded") - states.count("failed"),
        "served_by": {},
    }
    for j in jobs:
        model = (j.get("report") or {}).get("model")
        if model:
            out["served_by"][model] = out["served_by"].get(model, 0) + 1
    if killed_at is not None:
        out["finished_before_kill"] = sum((j.get("finished") or 1e18) < killed_at for j in jobs)
        out["finished_after_restart"] = sum((j.get("finished") or 0) >= killed_at for j in jobs)
        out["retried_after_restart"] = sum((j.get("attempts") or 0) > 1 for j in jobs)
    return out


# --- part 2: kill -9 at each step -------------------------------------------------------------------------------------
def kill_run(root: Path, bundles: dict, args, timeline: list) -> dict:
    rows = {}
    a, b = bundles["A"], bundles["B"]
    for fp in FAILPOINTS:
        state = root / f"state-{fp}"
        config = root / f"edgekitd-{fp}.toml"
        config.write_text(
            # one report commits (so `committed` is reached at once); the canary's judgement is part 1's subject,
            # not this one's: one slow report, or one billed more energy (RAPL counts the whole shared package),
            # must not roll back instead of committing
            "[rollout]\ncanary_reports = 1\nmin_reports = 1\ncanary_s = 60\nmax_p95_ratio = 1000.0\n"
            "max_energy_ratio = 1000.0\n"
            f'[[variants]]\nname = "a"\nbundle = "{a["path"]}"\n'
        )
        d = DaemonProcess(state, config=config, env={"EDGEKIT_FAILPOINT": fp}).start(wait_ready=300)
        start = time.time()
        load = Load(d.socket, start, args.interval)

        def event(what: str, fp: str = fp, load: Load = load) -> None:
            timeline.append((round(load.now(), 3), fp, what))

        row: dict = {"failpoint": fp}
        again: DaemonProcess | None = None
        try:
            event(f"edgekitd ready, serving A, EDGEKIT_FAILPOINT={fp}; steady load starts")
            load.begin()
            load.resume(fp)
            time.sleep(args.kill_warm_s)
            kill_from = load.now()
            burst = load.burst(args.kill_jobs)
            event(f"{args.kill_jobs} durable jobs posted back to back, and at once POST /v1/variants/a/bundles (B)")
            try:
                r = d.client.request(
                    "POST",
                    "/v1/variants/a/bundles",
                    b["path"].read_bytes(),
                    {"Content-Type": "application/octet-stream"},
                    timeout=300,
                )
                row["post"] = f"{r.status} {r.json().get('phase') or r.error_code}"
            except OSError as exc:
                row["post"] = f"none: died ({type(exc).__name__})"
            event(f"  {row['post']}")
            try:
                row["exit_code"] = d.proc.wait(60)
            except subprocess.TimeoutExpired:  # the failpoint was never reached: say where the rollout ended
                slots = d.client.get("/v1/variants").json()["variants"][0]["slots"]
                row["exit_code"] = None
                last = slots["history"][-1]
                row["not_killed"] = f"still running after 60 s; the rollout's last step: {last}"
            killed_at = time.time()
            event(f"edgekitd exited with {row['exit_code']}")
            burst.join(60)
            d.kill()
            jobs_before = [r.job_id for r in load.records if r.job_id]
            again = DaemonProcess(state, config=config)
            t = time.perf_counter()
            again.start(wait_ready=300)
            row["restart_to_ready_s"] = time.perf_counter() - t
            kill_to = load.now()
            event(f"restarted without the failpoint: ready after {row['restart_to_ready_s']:.1f} s")
            time.sleep(args.kill_after_s)
            load.pause()
            variants = again.client.get("/v1/variants").json()["variants"][0]
            finished = wait_jobs(again.client, jobs_before, 120)
            recovered = again.client.get("/v2/health/ready").json().get("recovered_jobs")
        finally:
            load.stop()
            d.kill()
            if again is not None:
                again.stop()
        slots_dir = state / "variants" / "a" / "slots"
        names = sorted(p.name for p in slots_dir.iterdir()) if slots_dir.is_dir() else []
        expected = b if fp == "committed" else a
        live_digest = (variants["slots"]["live"] or {"digest": a["digest"]})["digest"]
        after = [r.model for r in load.records if r.kind == "report" and r.model and r.t0 > kill_to]
        row.update(
            {
                "phase_after_restart": variants["slots"]["phase"],
                "live_after_restart": live_digest,
                "expected": "B (committed)" if fp == "committed" else "A (the old bundle)",
                "served_after_restart": sorted(set(after)),
                "serves_expected": live_digest == expected["digest"] and set(after) == {expected["model"]},
                "incoming_files_left": [n for n in names if n.startswith(".incoming-")],
                "slot_files": names,
                "recovered_jobs_on_restart": recovered,
                "requests": summarize(load.records, [(kill_from, kill_to)]),
                "jobs": job_summary(jobs_before, finished, killed_at),
            }
        )
        row["ok"] = (
            row["exit_code"] == -9
            and row["serves_expected"]
            and not row["incoming_files_left"]
            and row["requests"]["failed"] == 0
            and row["jobs"]["lost"] == 0
            and row["jobs"]["failed"] == 0
        )
        rows[fp] = row
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interval", type=float, default=0.1, help="seconds between one thread's requests")
    ap.add_argument("--canary-reports", type=int, default=20)
    ap.add_argument("--min-reports", type=int, default=5)
    ap.add_argument("--canary-s", type=float, default=60.0)
    ap.add_argument("--max-p95-ratio", type=float, default=2.0)
    ap.add_argument("--warm-s", type=float, default=6.0, help="load on A before B is posted (the canary's baseline)")
    ap.add_argument("--settle-s", type=float, default=2.0, help="load after each step before the next")
    ap.add_argument("--kill-warm-s", type=float, default=1.5)
    ap.add_argument("--kill-after-s", type=float, default=2.0)
    ap.add_argument("--kill-jobs", type=int, default=8, help="jobs posted in a burst as each bundle is posted")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "rollout.json")
    args = ap.parse_args()
    timeline: list[tuple[float, str, str]] = []
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="edgekit-rollout-bench-") as tmp:
        root = Path(tmp)
        bundles = make_bundles(root)
        main = main_run(root, bundles, args, timeline)
        kills = kill_run(root, bundles, args, timeline)
    wall = time.perf_counter() - t_all
    total_requests = main["requests"]["sent"] + sum(r["requests"]["sent"] for r in kills.values())
    total_ok = main["requests"]["ok"] + sum(r["requests"]["ok"] for r in kills.values())
    total_failed = main["requests"]["failed"] + sum(r["requests"]["failed"] for r in kills.values())
    total_refused = sum(r["requests"]["refused_during_kill"] for r in kills.values())
    jobs_acc = main["jobs"]["accepted"] + sum(r["jobs"]["accepted"] for r in kills.values())
    jobs_ok = main["jobs"]["succeeded"] + sum(r["jobs"]["succeeded"] for r in kills.values())
    jobs_failed = main["jobs"]["failed"] + sum(r["jobs"]["failed"] for r in kills.values())
    jobs_lost = main["jobs"]["lost"] + sum(r["jobs"]["lost"] for r in kills.values())
    result = {
        "machine_note": "2-core shared CPU; tiny random-weights bundles (A, B), a 7x slower one (D)",
        "bundles": {k: {"model": v["model"], "digest": v["digest"]} for k, v in bundles.items() if k != "build_s"},
        "settings": {
            "canary_reports": args.canary_reports,
            "min_reports": args.min_reports,
            "canary_s": args.canary_s,
            "max_p95_ratio": args.max_p95_ratio,
            "interval_s": args.interval,
            "client_threads": 2,
        },
        "main": main,
        "kill9": kills,
        "totals": {
            "requests_sent": total_requests,
            "requests_ok": total_ok,
            "requests_failed": total_failed,
            "requests_refused_during_deliberate_kill": total_refused,
            "jobs_accepted": jobs_acc,
            "jobs_succeeded": jobs_ok,
            "jobs_failed": jobs_failed,
            "jobs_lost": jobs_lost,
            "definitions": {
                "failed": "a non-2xx answer, or no answer outside a deliberate kill/restart",
                "refused_during_deliberate_kill": "no answer (connection refused/reset) or 503 not_ready while the "
                "daemon was killed by its failpoint and restarted: the client got an error and can retry",
                "lost": "a job accepted (202) that never reached succeeded or failed",
            },
        },
        "timeline": [
            {"t_s": t, "part": p, "event": e} for t, p, e in sorted(timeline, key=lambda x: (PARTS.index(x[1]), x[0]))
        ],
        "wall_s": wall,
    }
    print("timeline (t in s since each daemon was ready)")
    part = None
    for row in result["timeline"]:
        if row["part"] != part:
            part = row["part"]
            print(f"-- {part}")
        print(f"{row['t_s']:>8.2f}  {row['event']}")
    b, c, dd = main["B"], main["C"], main["D"]
    print()
    print(f"{'check':<38}result")
    print(
        f"{'B committed':<38}{'yes' if b['committed'] else 'NO'} (steps {', '.join(b['steps'])}; canary "
        f"{b['canary_s'] or float('nan'):.2f} s)"
    )
    print(
        f"{'C refused before the switch':<38}{'yes' if c['refused_before_switch'] else 'NO'} "
        f"({c['post']['status']} {c['code']}; steps {', '.join(c['steps'])}; reports served by C: "
        f"{c['reports_served']})"
    )
    print(f"{'  reason':<38}{c['reason']}")
    secs = dd["seconds_after_switch"]
    print(
        f"{'D rolled back within the window':<38}{'yes' if dd['rolled_back'] and dd['within_window'] else 'NO'} "
        f"({'?' if secs is None else f'{secs:.2f} s'} after the switch, after "
        f"{dd['reports_in_window_at_rollback']} reports; window {args.canary_reports} reports or {args.canary_s:.0f} s)"
    )
    print(f"{'  reason':<38}{dd['reason'][:110]}")
    if dd["window_at_rollback"]:
        print(f"{'  the window at the rollback':<38}{json.dumps(dd['window_at_rollback'])[:110]}")
    print(
        f"{'  p50 latency (client) B / D':<38}{dd['latency_ms_served_by_B_p50']:.0f} ms / "
        f"{dd['latency_ms_served_by_D_p50'] or float('nan'):.0f} ms ({dd['reports_served']} reports and "
        f"{dd['jobs_served']} jobs served by D; {dd['reports_by_D_answered_after_rollback']} answered after the "
        "rollback)"
    )
    print(f"{'served after the rollback':<38}{', '.join(main['served_after_rollback'])}")
    print(f"{'edgekitd_rollout_steps_total':<38}{main['metrics_rollout_steps_total']}")
    r = main["requests"]
    print(
        f"{'main: requests sent / ok / failed':<38}{r['sent']} / {r['ok']} / {r['failed']} (served by {r['served_by']})"
    )
    j = main["jobs"]
    print(
        f"{'main: jobs accepted / done / lost':<38}{j['accepted']} / {j['succeeded']} (+{j['failed']} failed) / "
        f"{j['lost']} (served by {j['served_by']})"
    )
    print()
    print(
        f"{'kill -9 at':<11}{'exit':>5}  {'POST B answered':<26}{'phase after':<13}{'serves':<9}{'sent':>5}{'ok':>5}"
        f"{'refused*':>9}{'failed':>7}{'jobs':>6}{'done<kill':>10}{'done>restart':>13}{'lost':>5}  ok"
    )
    for fp, row in kills.items():
        q, jj = row["requests"], row["jobs"]
        print(
            f"{fp:<11}{str(row['exit_code']):>5}  {row['post'][:25]:<26}{row['phase_after_restart']:<13}"
            f"{','.join(row['served_after_restart'])[:8]:<9}{q['sent']:>5}{q['ok']:>5}{q['refused_during_kill']:>9}"
            f"{q['failed']:>7}{jj['accepted']:>6}{jj['finished_before_kill']:>10}{jj['finished_after_restart']:>13}"
            f"{jj['lost']:>5}  {'yes' if row['ok'] else 'NO'}"
        )
    print(
        "* refused: no answer (connection refused/reset) or 503 not_ready while the daemon was deliberately "
        "killed and restarted"
    )
    t = result["totals"]
    print(
        f"\nwhole run: {t['requests_sent']} requests, {t['requests_ok']} ok, {t['requests_failed']} failed, "
        f"{t['requests_refused_during_deliberate_kill']} refused during the deliberate kills; jobs "
        f"{t['jobs_accepted']} accepted, {t['jobs_succeeded']} succeeded, {t['jobs_failed']} failed, "
        f"{t['jobs_lost']} lost; {wall:.0f} s"
    )
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
