"""What edgekitd's idle unloading frees: the resident memory of the daemon with a second variant loaded, then after
that variant has been idle for `keep_alive_s` (the seed unloads a session's KV cache after 8 s idle).

The daemon serves the default model's cpu bundle as its active variant and an x1 bundle as the second one; one
report on the second loads it; the daemon's RSS (VmRSS of its process, /proc) is read before, while loaded, and
after the keep-alive unloads it. The active variant always stays loaded (readiness means a warm model). Per-report
KV caches are not kept between reports here: each report's cache is freed when it ends, so there is no session
cache to unload.

    python bench/idle_unload.py                 # keep_alive_s = 8
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from edgekit.build import build
from edgekit.daemon.testing import DaemonProcess

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "models" / "samples" / "cr_chest" / "image.dcm"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def loaded(d: DaemonProcess) -> dict[str, bool]:
    return {v["name"]: v["loaded"] for v in d.client.get("/v1/variants").json()["variants"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep-alive", type=float, default=8.0)
    ap.add_argument("--cache", type=Path, default=Path("out/idle-bundles"))
    ap.add_argument("--json", type=Path, default=Path("out/idle_unload.json"))
    args = ap.parse_args()
    cache = args.cache.resolve()
    bundles = {"cpu": cache / "radreport-tiny-cpu", "x1": cache / "radreport-tiny-x1"}
    for target, path in bundles.items():
        if not (path / "manifest.json").is_file():
            build(target, path, parity=False)
    root = Path(tempfile.mkdtemp(prefix="edgekit-idle-"))
    config = root / "edgekitd.toml"
    lines = ["[models]", 'active = "cpu"', f"keep_alive_s = {args.keep_alive}"]
    for name, path in bundles.items():
        lines += ["[[variants]]", f'name = "{name}"', f'bundle = "{path}"']
    config.write_text("\n".join(lines) + "\n")
    with DaemonProcess(root / "state", config=config).start(wait_ready=300) as d:
        pid = d.proc.pid
        d.client.report(SAMPLE)
        before = rss_mib(pid)
        assert d.client.report(SAMPLE, variant="x1").status == 200
        with_second = rss_mib(pid)
        t0 = time.monotonic()
        while loaded(d)["x1"] and time.monotonic() - t0 < args.keep_alive * 4:
            time.sleep(0.25)
        unloaded_after = time.monotonic() - t0
        time.sleep(1.0)
        after = rss_mib(pid)
        still = loaded(d)
    freed = with_second - after
    result = {
        "keep_alive_s": args.keep_alive,
        "rss_mib": {"active only": before, "second variant loaded": with_second, "after idle unload": after},
        "second_variant_mib": with_second - before,
        "freed_mib": freed,
        "freed_share_of_second": freed / (with_second - before) if with_second > before else None,
        "freed_share_of_total": freed / with_second,
        "unloaded_after_s": round(unloaded_after, 2),
        "loaded_at_end": still,
        "source": "VmRSS of the edgekitd process (/proc/PID/status)",
    }
    table = Table(title=f"edgekitd idle unload (keep_alive_s = {args.keep_alive:g})")
    for col in ("state", "RSS MiB"):
        table.add_column(col)
    for k, v in result["rss_mib"].items():
        table.add_row(k, f"{v:.0f}")
    Console().print(table)
    Console().print(
        f"freed {freed:.0f} MiB = {result['freed_share_of_total']:.0%} of the daemon's RSS "
        f"({(result['freed_share_of_second'] or 0):.0%} of what the second variant took), "
        f"{unloaded_after:.1f} s after its last report; still loaded: {still}"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return 0 if not still["x1"] and still["cpu"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
