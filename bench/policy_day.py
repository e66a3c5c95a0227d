"""edgekitd's energy-quality policy through a scripted day, against always serving the best variant.

Four x1 variants of the default model (FP16, INT8, INT4, INT4 with 38% of heads pruned) are profiled with
`edgekit pareto`; edgekitd serves them under a `[policy]` whose signals come from a fixture sysfs tree laid out as
on a Jetson Orin Nano (INA3221 rails, thermal zones) plus a battery, which the script edits as the day goes:

1. the power budget lowered, then raised again (`PUT /v1/policy`);
2. the battery unplugged and draining from 80% to 10%, then back on the charger;
3. a thermal zone warming past its passive trip point, then cooling;
4. a load burst (8 reports at once), then calm.

Reports are the studies' DICOM and, where a study has one, its cine clip as MP4: a profiled INT4 point with frame
skipping (`video_max_frames = 4`) may serve those, and each such report must say so.

The day repeats until the policy has switched at least `--switches` times, with reports sent all along, then
the same studies are sent with the policy fixed at the best variant. Energy per report is the X1 cost model's
(`emulated:x1`), so the two runs compare like with like. The day is compressed: a 2 s window stands for the
policy's 300 s default. A last phase oscillates the load faster than a 3 s window and counts the switches.

    python bench/policy_day.py                  # ~100 switches
    python bench/policy_day.py --switches 20 --profile-limit 20
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table

from edgekit.daemon.policy import best_quality
from edgekit.daemon.testing import DaemonProcess
from edgekit.eval.finding_metrics import prf, score_study
from edgekit.eval.runner import default_test_split, load_split
from edgekit.findings import Finding
from edgekit.pareto import read_profile

sys.path.insert(0, str(Path(__file__).parent))
from pareto_front import fresh_bundle  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "sysfs" / "orin_nano"
VARIANTS = {"fp16": "fp16", "int8": "int8", "int4": None}
CAPS = (40, 28)  # report-length caps profiled on the INT4 variant: cheaper points, which may cost findings
FRAMES = 4  # frame skipping profiled on the INT4 variant: video clips at 4 of the model's 8 frames
HWMON = "sys/bus/i2c/drivers/ina3221/1-0040/hwmon/hwmon1"
ZONE = "sys/class/thermal/thermal_zone0"


class Board:
    """The fixture tree the daemon reads its signals from; the day writes it as a device's kernel would."""

    def __init__(self, root: Path):
        self.root = root
        shutil.copytree(FIXTURE, root)
        self.battery(80, charging=True)

    def _write(self, rel: str, text: str) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")

    def battery(self, percent: int, *, charging: bool) -> None:
        self._write("sys/class/power_supply/BAT0/type", "Battery")
        self._write("sys/class/power_supply/BAT0/capacity", str(percent))
        self._write("sys/class/power_supply/BAT0/status", "Charging" if charging else "Discharging")
        self._write("sys/class/power_supply/AC/type", "Mains")
        self._write("sys/class/power_supply/AC/online", "1" if charging else "0")

    def temperature(self, celsius: float) -> None:
        self._write(f"{ZONE}/temp", str(int(celsius * 1000)))

    def trip_c(self) -> float:
        return int((self.root / ZONE / "trip_point_0_temp").read_text()) / 1000


def _bundles(cache: Path) -> dict[str, Path]:
    """The variants' x1 bundles in `cache`, (re)built as `fresh_bundle` says."""
    return {name: fresh_bundle("x1", cache / f"radreport-tiny-x1-{name}", recipe) for name, recipe in VARIANTS.items()}


def _profile(bundles: dict[str, Path], out: Path, data: Path, limit: int) -> Path:
    """Every variant at its own report length, and the INT4 one at each of CAPS, with frame skipping (FRAMES), and
    with both, as `edgekit pareto` measures them (called as a library to mix grids per bundle)."""
    from edgekit.bundle import load_bundle
    from edgekit.pareto.configs import expand
    from edgekit.pareto.energy import describe_meter
    from edgekit.pareto.run import run_pareto

    loaded = {name: load_bundle(path) for name, path in bundles.items()}
    configs = expand(list(loaded.values()), {}) + expand([loaded["int4"]], {"max_new_tokens": list(CAPS)})
    configs += expand([loaded["int4"]], {"video_max_frames": [FRAMES]})
    configs += expand([loaded["int4"]], {"max_new_tokens": [CAPS[0]], "video_max_frames": [FRAMES]})
    meter = describe_meter(None)
    run_pareto(configs, out, data, split={"name": "test", "count": limit}, limit=limit, meter=meter["name"],
               meters=[meter])  # fmt: skip
    return out / "pareto.json"


def _f1(records: list[tuple[dict, str, dict]]) -> float:
    tp = fp = fn = 0.0
    for study, _, report in records:
        truth = [Finding(**f) for f in study["findings"]]
        predicted = [Finding(**f) for f in report["findings"]]
        s = score_study(truth, study["negatives"], predicted, report["negatives"])
        tp, fp, fn = tp + s.tp, fp + s.fp, fn + s.fn
    return prf(tp, fp, fn)[2]


def _inputs(studies: list[dict]) -> list[tuple[dict, str]]:
    """Each study's DICOM, and its cine clip as MP4 where it has one (what frame skipping acts on)."""
    return [(s, rel) for s in studies for rel in (s["path"], s.get("video_path")) if rel]


class Driver:
    """Sends the inputs (study, file) round-robin, one at a time, and records every answer."""

    def __init__(self, d: DaemonProcess, data: Path, inputs: list[tuple[dict, str]]):
        self.d, self.data, self.inputs = d, data, inputs
        self.i = 0
        self.records: list[tuple[dict, str, dict]] = []
        self.failed: list[str] = []
        self._lock = threading.Lock()

    def one(self) -> None:
        with self._lock:
            study, rel = self.inputs[self.i % len(self.inputs)]
            self.i += 1
        r = self.d.client.report(self.data / rel, study.get("indication", ""))
        with self._lock:
            if r.status == 200:
                self.records.append((study, rel, r.json()))
            else:
                self.failed.append(f"{r.status} {r.body[:120]!r}")

    def burst(self, n: int) -> None:
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(lambda _: self.one(), range(n)))


def _switches(d: DaemonProcess) -> int:
    text = d.client.get("/metrics").body.decode()
    return int(sum(float(v) for v in re.findall(r"^edgekit_policy_switches_total\{[^}]*\} (\S+)", text, re.M)))


def _config(root: Path, bundles: dict[str, Path], floor: float, window_s: float) -> Path:
    lines = ["[models]", 'active = "fp16"', "keep_alive_s = -1", "[scheduler]", "max_queue = 64"]
    for name, path in bundles.items():
        lines += ["[[variants]]", f'name = "{name}"', f'bundle = "{path}"']
    lines += ["[policy]", f'profile = "{root / "pareto.json"}"', f'signals_root = "{root / "sysfs"}"']
    lines += ['mode = "performance"', f"quality_floor_f1 = {floor}", "tick_s = 0.1", f"window_s = {window_s}"]
    path = root / "edgekitd.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--switches", type=int, default=100)
    ap.add_argument("--profile-limit", type=int, default=60)
    ap.add_argument("--max-phases", type=int, default=60)
    ap.add_argument("--floor-below-best", type=float, default=0.02, help="quality floor: best F1 minus this")
    ap.add_argument("--studies", type=int, default=40)
    ap.add_argument("--cache", type=Path, default=Path("out/policy-bundles"))
    ap.add_argument("--json", type=Path, default=Path("out/policy_day.json"))
    args = ap.parse_args()

    t_start = time.perf_counter()
    data = default_test_split()
    studies = load_split(data)[: args.studies]
    args.cache = args.cache.resolve()
    bundles = _bundles(args.cache)
    root = Path(tempfile.mkdtemp(prefix="edgekit-policy-day-"))
    shutil.copy(_profile(bundles, args.cache / "profile", data, args.profile_limit), root / "pareto.json")
    profile = read_profile(root / "pareto.json")
    points = {p.id.removeprefix("radreport-tiny-x1-"): p for p in profile.points}
    # The baseline: the variant a deployment serves without a policy, its reference precision (FP16), and the
    # profile's best-quality point (ties broken by energy); the policy is compared with both.
    reference = points["fp16"]
    best = max(points.values(), key=best_quality)  # DICOM and video F1, as the policy
    floor = round(best.lowest_f1 - args.floor_below_best, 3)
    board = Board(root / "sysfs")
    window_s = 2.0

    with DaemonProcess(root / "state", config=_config(root, bundles, floor, window_s)).start(wait_ready=600) as d:
        drive = Driver(d, data, _inputs(studies))
        high = max(p.power_w for p in points.values())

        def settle(seconds: float) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                drive.one()

        phases = 0
        while _switches(d) < args.switches and phases < args.max_phases:
            if phases == 3 and _switches(d) == 0:
                break  # the front has nothing to trade (one point dominates): say so below, do not loop
            phases += 1
            d.client.put_json("/v1/policy", {"power_budget_w": round(high * 0.5, 3)})  # budget halved
            settle(0.5)
            d.client.put_json("/v1/policy", {"power_budget_w": None})  # and lifted
            settle(window_s * 1.3)
            board.battery(25, charging=False)  # unplugged, below the battery floor
            settle(0.5)
            board.battery(90, charging=True)
            settle(window_s * 1.3)
            board.temperature(board.trip_c() + 1)  # past the passive trip point
            settle(0.5)
            board.temperature(45)
            settle(window_s * 1.3)
            drive.burst(8)  # load burst
            settle(window_s * 1.3)
        day_switches = _switches(d)
        day = list(drive.records)
        day_failed = list(drive.failed)

        # the same studies, always on one point: the reference precision, and the profile's best
        baselines = {}
        for label, point in (("always FP16", reference), ("always best-F1 point", best)):
            if point.id in {b["point"] for b in baselines.values()}:
                baselines[label] = next(b for b in baselines.values() if b["point"] == point.id)
                continue
            d.client.put_json("/v1/policy", {"mode": "fixed", "fixed": point.id})
            # greedy reports are deterministic: each distinct study once, counted as often as the day sent it
            sent = {(s["id"], rel): (s, rel) for s, rel, _ in day}
            base = Driver(d, data, list(sent.values()))
            for _ in sent:
                base.one()
            by_input = {(s["id"], rel): (s, rel, r) for s, rel, r in base.records}
            records = [by_input[s["id"], rel] for s, rel, _ in day if (s["id"], rel) in by_input]
            baselines[label] = {"point": point.id, "records": records, "failed": base.failed}

        # oscillating load, faster than a 3 s window
        # (no quality floor here, so a burst has a faster point to step down to: the report-length caps)
        d.client.put_json("/v1/policy", {"mode": "performance", "window_s": 3.0, "quality_floor_f1": None})
        settle(1.0)
        before, t0 = _switches(d), time.monotonic()
        while time.monotonic() - t0 < 15:
            drive.burst(6)
            settle(0.5)
        osc_switches, osc_s = _switches(d) - before, time.monotonic() - t0

    def energy(records):
        return sum(r["energy_j"] for _, _, r in records) / len(records)

    served: dict[str, int] = {}
    for _, _, r in day:
        served[r["variant"]] = served.get(r["variant"], 0) + 1
    videos = [r for s, rel, r in day if rel == s.get("video_path")]
    skipped = [r for r in videos if r["frames"]["model_frames"] < 8]
    policy_e, policy_f1 = energy(day), _f1(day)
    compared = {
        label: {
            "point": b["point"],
            "energy_j_per_report": energy(b["records"]),
            "finding_f1": _f1(b["records"]),
            "failed": len(b["failed"]),
            "energy_saving": 1 - policy_e / energy(b["records"]),
            "f1_drop_points": (_f1(b["records"]) - policy_f1) * 100,
        }
        for label, b in baselines.items()
    }
    failed = len(day_failed) + sum(c["failed"] for c in compared.values())
    result = {
        "variants": {
            k: {"f1": p.f1, "video_f1": p.video_f1, "energy_j": p.energy_j, "power_w": p.power_w}
            for k, p in points.items()
        },
        "profile": {"split": profile.split, "energy_source": profile.points[0].energy_source},
        "quality_floor_f1": floor,
        "phases": phases,
        "switches": day_switches,
        "reports": len(day),
        "failed": failed,
        "failures": day_failed[:5],
        "served_by_variant": served,
        "video_reports": len(videos),
        "video_reports_frame_skipped": len(skipped),
        "frame_skipping_warned": all(any("frame skipping" in w for w in r["warnings"]) for r in skipped),
        "policy": {"energy_j_per_report": policy_e, "finding_f1": policy_f1},
        "baselines": compared,
        "energy_source": day[0][2]["energy_source"],
        "oscillating_load": {
            "window_s": 3.0,
            "seconds": round(osc_s, 1),
            "switches": osc_switches,
            "quality_floor_f1": None,
        },
        "window_s": window_s,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    table = Table(title=f"edgekitd policy: a scripted day ({len(day)} reports) vs always one point, same studies")
    for col in ("run", "point", "J / report (emulated:x1)", "policy's energy", "finding F1", "policy's F1"):
        table.add_column(col)
    table.add_row("policy", "(switching)", f"{policy_e:.4g}", "", f"{policy_f1:.3f}", "")
    for label, c in compared.items():
        table.add_row(label, c["point"], f"{c['energy_j_per_report']:.4g}",
                      f"{policy_e / c['energy_j_per_report']:.2f}x ({c['energy_saving']:.0%} less)",
                      f"{c['finding_f1']:.3f}", f"{-c['f1_drop_points']:+.1f} points")  # fmt: skip
    Console().print(table)
    Console().print(
        f"{day_switches} switches over {phases} scripted cycles, {failed} failed requests; oscillating load "
        f"(3 s window): {osc_switches} switches in {osc_s:.0f} s; served by variant: {served}; "
        f"{len(skipped)} of {len(videos)} video reports frame-skipped"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    vs_reference = compared["always FP16"]
    ok = (
        vs_reference["energy_saving"] >= 0.30
        and vs_reference["f1_drop_points"] <= 2.0
        and failed == 0
        and result["frame_skipping_warned"]
        and day_switches >= args.switches
        and osc_switches <= osc_s / 3.0 + 1
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
