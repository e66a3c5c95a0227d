"""What traces cost: edgekitd with `[telemetry]` on (exporting by OTLP/HTTP to a receiver on loopback) against the
same daemon with it off, at concurrency 1, side by side in one run.

Two daemons serve the same bundle (radreport-tiny's architecture, random weights; `--tiny`: the small test model, the
worst case for the ratio); each round sends one synchronous `POST /v1/reports` to each, in turn, so both see the same
background load. The overhead is p50(on) / p50(off) - 1 (issue #31 asks for at most 3%). Prints a table, writes JSON.

    python bench/telemetry_overhead.py [--requests 40] [--tiny] [--out bench/telemetry_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

from edgekit.daemon.client import study_files
from edgekit.daemon.testing import DaemonProcess, write_tiny_model

REPO = Path(__file__).resolve().parents[1]
STUDY = REPO / "models" / "samples" / "cr_chest" / "image.dcm"


def receiver() -> tuple[ThreadingHTTPServer, list[int]]:
    """An OTLP/HTTP endpoint that takes every export (200) and counts the bytes."""
    got: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            got.append(len(self.rfile.read(int(self.headers.get("Content-Length", 0)))))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "telemetry_overhead.json")
    args = ap.parse_args()
    server, exports = receiver()
    files = study_files(STUDY)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = write_tiny_model(root / "model", full_size=not args.tiny, max_new_tokens=96)
        daemons = {}
        for name, text in (
            ("off", ""),
            ("on", f'[telemetry]\nenabled = true\nendpoint = "http://127.0.0.1:{server.server_address[1]}"\n'),
        ):
            (root / f"{name}.toml").write_text(text)
            daemons[name] = DaemonProcess(root / name, model, config=root / f"{name}.toml").start(wait_ready=300)
        try:
            for d in daemons.values():  # warm: first requests pay for lazy initialisation
                for _ in range(3):
                    assert d.client.post_study("/v1/reports", files).status == 200
            latency: dict[str, list[float]] = {name: [] for name in daemons}
            for i in range(args.requests):
                order = list(daemons) if i % 2 == 0 else list(reversed(daemons))
                for name in order:
                    t0 = time.perf_counter()
                    reply = daemons[name].client.post_study("/v1/reports", files)
                    latency[name].append(time.perf_counter() - t0)
                    assert reply.status == 200, reply.body[:200]
            time.sleep(6)  # the last batch exported
        finally:
            for d in daemons.values():
                d.stop()
    server.shutdown()
    out = {
        name: {"p50_ms": float(np.percentile(v, 50) * 1e3), "p95_ms": float(np.percentile(v, 95) * 1e3), "n": len(v)}
        for name, v in latency.items()
    }
    out["overhead_p50"] = out["on"]["p50_ms"] / out["off"]["p50_ms"] - 1
    out["exports"] = {"requests": len(exports), "bytes": sum(exports)}
    out["model"] = "tiny" if args.tiny else "radreport-tiny architecture"
    print(f"{'telemetry':10s} {'p50 ms':>9s} {'p95 ms':>9s}")
    for name in ("off", "on"):
        print(f"{name:10s} {out[name]['p50_ms']:9.1f} {out[name]['p95_ms']:9.1f}")
    print(f"overhead at c=1, p50: {out['overhead_p50'] * 100:+.1f}%  ({len(exports)} OTLP exports, {sum(exports)} B)")
    args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
