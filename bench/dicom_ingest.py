"""DICOM networking end to end against a real PACS: 50 studies by C-STORE into edgekitd's SCP, reports delivered to
Orthanc by edgekitd itself, beside the same kind of studies through `POST /v1/jobs` with the glue an integrator
writes today (poll the job, fetch its SR, STOW-RS it to the PACS). Side by side in one run, in alternating blocks
so both paths see the same background load.

Per path: throughput (studies per minute over the blocks' wall time), time to SR-in-PACS per study (p50/p95: from
the first byte sent to the SR visible in Orthanc's index; a jobs block submits its studies at once, so they queue)
and the time to send one study (storescu's run; one POST /v1/jobs). The C-STORE path's time includes the quiet period
(`--quiet`, 1 s here; 10 s by default in edgekitd), which is shown beside it and subtracted in its own column.

    python bench/dicom_ingest.py [--studies 50] [--block 10] [--quiet 1.0] [--full-size] [--out FILE]

Needs Debian's orthanc, orthanc-dicomweb and dcmtk. The model is a random-weights one (`--full-size`:
radreport-tiny's real architecture; default: the tests' tiny one, so the figures are mostly the networking path).
Each study is the CT sample (14 RLE instances) with new UIDs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from importlib.resources import files
from pathlib import Path

import numpy as np
import pydicom

from edgekit.daemon.client import study_files
from edgekit.daemon.testing import DaemonProcess, write_tiny_model
from edgekit.daemon.testing_pacs import Orthanc, free_port, missing, tool

CT = sorted(Path(str(files("edgekit.models") / "samples" / "ct_chest")).glob("*.dcm"))


def make_studies(root: Path, n: int) -> list[tuple[str, Path]]:
    """`n` copies of the CT sample as studies of their own: (StudyInstanceUID, folder)."""
    sources = [pydicom.dcmread(p) for p in CT]
    out = []
    for i in range(n):
        study, series = pydicom.uid.generate_uid(), pydicom.uid.generate_uid()
        folder = root / f"study{i:03d}"
        folder.mkdir(parents=True)
        for j, ds in enumerate(sources):
            ds.StudyInstanceUID, ds.SeriesInstanceUID = study, series
            ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID = pydicom.uid.generate_uid()
            ds.save_as(folder / f"IM{j:04d}.dcm", enforce_file_format=True)
        out.append((study, folder))
    return out


class SrWatch:
    """When each study's SR first shows in Orthanc's index (polling /tools/find every 50 ms in a thread)."""

    def __init__(self, pacs: Orthanc):
        self.pacs, self.seen, self._stop = pacs, {}, threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                found = self.pacs.post(
                    "/tools/find", {"Level": "Study", "Query": {"ModalitiesInStudy": "SR"}, "Expand": True}
                )
            except OSError:
                found = []
            now = time.perf_counter()
            for study in found:
                self.seen.setdefault(study["MainDicomTags"]["StudyInstanceUID"], now)
            time.sleep(0.05)

    def wait(self, uids: list[str], timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(u in self.seen for u in uids):
                return
            time.sleep(0.02)
        raise TimeoutError(f"{sum(u not in self.seen for u in uids)} SRs never reached the PACS")

    def stop(self) -> None:
        self._stop.set()


def stow_to(pacs: Orthanc, data: bytes) -> None:
    boundary = uuid.uuid4().hex
    body = (
        f"--{boundary}\r\nContent-Type: application/dicom\r\n\r\n".encode() + data + f"\r\n--{boundary}--\r\n".encode()
    )
    req = urllib.request.Request(
        pacs.dicomweb + "/studies",
        data=body,
        method="POST",
        headers={"Content-Type": f'multipart/related; type="application/dicom"; boundary={boundary}'},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200, resp.status


def cstore_block(d: DaemonProcess, block: list[tuple[str, Path]], starts: dict, sends: dict) -> None:
    for uid, folder in block:
        starts[uid] = time.perf_counter()
        cmd = [tool("storescu"), "-xr", "-aet", "MODALITY", "-aec", "EDGEKIT", "127.0.0.1", str(d.scp_port)]
        sent = subprocess.run(cmd + [str(p) for p in sorted(folder.glob("*.dcm"))], capture_output=True, timeout=120)
        if sent.returncode != 0:
            raise RuntimeError(sent.stderr.decode()[-1000:])
        sends[uid] = time.perf_counter() - starts[uid]


def jobs_block(d: DaemonProcess, pacs: Orthanc, block: list[tuple[str, Path]], starts: dict, sends: dict) -> None:
    """Today's glue: POST /v1/jobs, then (in one thread, as the daemon's delivery worker is one) poll each job,
    fetch its SR and STOW-RS it to the PACS."""
    ids = []
    for uid, folder in block:
        starts[uid] = time.perf_counter()
        r = d.client.post_study("/v1/jobs", study_files(folder))
        assert r.status == 202, r.body[:300]
        sends[uid] = time.perf_counter() - starts[uid]
        ids.append(r.json()["id"])
    for job_id in ids:
        while True:
            state = d.client.get(f"/v1/jobs/{job_id}").json()["state"]
            if state in ("succeeded", "failed"):
                break
            time.sleep(0.02)
        assert state == "succeeded", state
        stow_to(pacs, d.client.get(f"/v1/jobs/{job_id}/sr").body)


def summarise(starts: dict, sends: dict, seen: dict, wall_s: float, quiet_s: float) -> dict:
    lat = np.array([seen[u] - starts[u] for u in starts])
    send = np.array(list(sends.values()))
    return {
        "send_p50_s": float(np.percentile(send, 50)),
        "send_p95_s": float(np.percentile(send, 95)),
        "studies": len(lat),
        "instances": len(lat) * len(CT),
        "wall_s": wall_s,
        "throughput_studies_per_min": len(lat) / wall_s * 60,
        "time_to_sr_p50_s": float(np.percentile(lat, 50)),
        "time_to_sr_p95_s": float(np.percentile(lat, 95)),
        "quiet_period_s": quiet_s,
        "time_to_sr_p50_less_quiet_s": float(np.percentile(lat, 50)) - quiet_s,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--studies", type=int, default=50, help="studies per path")
    p.add_argument("--block", type=int, default=10, help="studies per alternating block")
    p.add_argument("--quiet", type=float, default=1.0, help="edgekitd's dicom.quiet_period_s for the C-STORE path")
    p.add_argument("--full-size", action="store_true", help="radreport-tiny's architecture (random weights)")
    p.add_argument("--out", type=Path, default=Path("bench/dicom_ingest.json"))
    args = p.parse_args(argv)
    why = missing("Orthanc", "dicomweb-plugin", "storescu")
    if why:
        print(f"dicom_ingest: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="edgekit-dicom-bench-") as tmp:
        root = Path(tmp)
        studies_a = make_studies(root / "a", args.studies)
        studies_b = make_studies(root / "b", args.studies)
        scp_port = free_port()
        pacs = Orthanc(root / "orthanc", modalities={"edgekit": ("EDGEKIT", "127.0.0.1", scp_port)}).start()
        config = root / "edgekitd.toml"
        config.write_text(
            f"[scheduler]\nmax_queue = {args.studies + 8}\n[dicom]\nquiet_period_s = {args.quiet}\n"
            f'[dimse]\nenabled = true\nport = {scp_port}\n[[dimse.allowed]]\nae_title = "MODALITY"\n'
            f'[[destinations]]\nname = "pacs"\nkind = "stow"\nurl = "{pacs.dicomweb}"\n'
        )
        model = write_tiny_model(root / "model", full_size=args.full_size)
        d = DaemonProcess(root / "state", model, config=config).start()
        d.scp_port = scp_port
        watch = SrWatch(pacs)
        starts_a: dict[str, float] = {}
        starts_b: dict[str, float] = {}
        sends_a: dict[str, float] = {}
        sends_b: dict[str, float] = {}
        wall = {"a": 0.0, "b": 0.0}
        try:
            for i in range(0, args.studies, args.block):
                t0 = time.perf_counter()
                block = studies_a[i : i + args.block]
                cstore_block(d, block, starts_a, sends_a)
                watch.wait([u for u, _ in block])
                wall["a"] += time.perf_counter() - t0
                t0 = time.perf_counter()
                block = studies_b[i : i + args.block]
                jobs_block(d, pacs, block, starts_b, sends_b)
                watch.wait([u for u, _ in block])
                wall["b"] += time.perf_counter() - t0
                print(f"  block {i // args.block + 1}: {i + len(block)} studies per path", file=sys.stderr)
            jobs = d.client.get("/v1/jobs?limit=1000").json()["jobs"]
            delivered = sum(1 for j in jobs for x in j.get("deliveries", []) if x["state"] == "delivered")
        finally:
            watch.stop()
            d.stop()
            pacs.stop()
    a = summarise(starts_a, sends_a, watch.seen, wall["a"], args.quiet)
    b = summarise(starts_b, sends_b, watch.seen, wall["b"], 0.0)
    result = {
        "model": "radreport-tiny architecture, random weights" if args.full_size else "tiny test model, random weights",
        "pacs": "Orthanc (Debian) + DICOMweb plugin, loopback",
        "sender": "DCMTK storescu, one association per study (C-STORE path); edgekit.daemon.client (jobs path)",
        "cstore_edgekitd_delivers": a,
        "post_jobs_with_glue": b,
        "deliveries_delivered": delivered,
        "ratios": {
            "throughput_cstore_over_jobs": a["throughput_studies_per_min"] / b["throughput_studies_per_min"],
            "p50_cstore_over_jobs": a["time_to_sr_p50_s"] / b["time_to_sr_p50_s"],
            "p95_cstore_over_jobs": a["time_to_sr_p95_s"] / b["time_to_sr_p95_s"],
            "p50_less_quiet_cstore_over_jobs": a["time_to_sr_p50_less_quiet_s"] / b["time_to_sr_p50_s"],
            "send_p50_cstore_over_jobs": a["send_p50_s"] / b["send_p50_s"],
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\n{args.studies} studies per path x {len(CT)} CT instances; quiet period {args.quiet} s; {result['model']}")
    print(f"{'path':<34}{'studies/min':>12}{'SR p50 s':>10}{'SR p95 s':>10}{'p50-quiet s':>12}{'send p50 s':>12}")
    for name, r in (("C-STORE -> edgekitd delivers", a), ("POST /v1/jobs + glue STOW-RS", b)):
        print(
            f"{name:<34}{r['throughput_studies_per_min']:>12.1f}{r['time_to_sr_p50_s']:>10.2f}"
            f"{r['time_to_sr_p95_s']:>10.2f}{r['time_to_sr_p50_less_quiet_s']:>12.2f}{r['send_p50_s']:>12.2f}"
        )
    ratios = result["ratios"]
    print(
        f"{'ratio C-STORE / jobs':<34}{ratios['throughput_cstore_over_jobs']:>12.2f}"
        f"{ratios['p50_cstore_over_jobs']:>10.2f}{ratios['p95_cstore_over_jobs']:>10.2f}"
        f"{ratios['p50_less_quiet_cstore_over_jobs']:>12.2f}{ratios['send_p50_cstore_over_jobs']:>12.2f}"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
