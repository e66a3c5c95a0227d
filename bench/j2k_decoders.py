"""The JPEG 2000 decoders edgekit can use (pydicom's plugins: GDCM, pylibjpeg-openjpeg, Pillow), side by side on one
study's pixel data: wall time and CPU time per frame, alternated in rounds so every decoder sees the same background
load. Wall time is what a report waits alone; CPU time is what it costs when every core is busy (edgekitd under load,
where the ingest processes decode in parallel): a decoder that spreads one frame over threads answers sooner alone
and costs more CPU.

    python bench/j2k_decoders.py [--study models/samples/cr_chest/image.dcm] [--rounds 7] [--frames 20] [--out FILE]

Prints a table (each figure the median over rounds, and the ratio to GDCM, pydicom's first choice), writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import pydicom
from pydicom.pixels.decoders.base import get_decoder

REPO = Path(__file__).resolve().parents[1]


def timed(decode, n: int) -> tuple[float, float]:
    """Milliseconds of wall and CPU time per decode over `n` decodes."""
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        decode()
    return (time.perf_counter() - w0) / n * 1e3, (time.process_time() - c0) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--study", type=Path, default=REPO / "models" / "samples" / "cr_chest" / "image.dcm")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--frames", type=int, default=20, help="decodes per decoder per round")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "j2k_decoders.json")
    args = ap.parse_args()

    ds = pydicom.dcmread(args.study)
    ts = ds.file_meta.TransferSyntaxUID
    decoder = get_decoder(ts)
    plugins = list(decoder.available_plugins)
    if not plugins:
        raise SystemExit(f"{args.study}: no decoder for {ts.name} is installed")
    reference = None
    for plugin in plugins:  # warm each, and check they agree (lossless: they must)
        arr = decoder.as_array(ds, decoding_plugin=plugin)[0]
        reference = arr if reference is None else reference
        if not np.array_equal(arr, reference):
            raise SystemExit(f"{plugin} decodes {args.study} differently from {plugins[0]}")
    walls: dict[str, list[float]] = {p: [] for p in plugins}
    cpus: dict[str, list[float]] = {p: [] for p in plugins}
    for r in range(args.rounds):
        for plugin in plugins if r % 2 == 0 else reversed(plugins):
            wall, cpu = timed(lambda p=plugin: decoder.as_array(ds, decoding_plugin=p), args.frames)
            walls[plugin].append(wall)
            cpus[plugin].append(cpu)
    rows = {
        p: {"wall_ms": float(np.median(walls[p])), "cpu_ms": float(np.median(cpus[p])), "cpu_per_wall": 0.0}
        for p in plugins
    }
    for r in rows.values():
        r["cpu_per_wall"] = r["cpu_ms"] / r["wall_ms"]
    ref = "gdcm" if "gdcm" in rows else plugins[0]  # pydicom tries GDCM first for JPEG 2000 when it is installed
    first = rows[ref]
    result = {
        "study": str(args.study),
        "transfer_syntax": f"{ts.name} ({ts})",
        "size": f"{ds.Columns}x{ds.Rows}, {ds.BitsStored}-bit",
        "cpus": os.cpu_count(),
        "rounds": args.rounds,
        "decodes_per_round": args.frames,
        "available": plugins,
        "ratios_to": ref,
        "decoders": rows,
    }
    head = f"{result['transfer_syntax']}, {result['size']}"
    print(f"{head}, {args.rounds} rounds of {args.frames} decodes, {result['cpus']} CPUs")
    print(f"{'decoder':<12}{'wall ms':>9}{'CPU ms':>9}{'CPU/wall':>10}{'wall / ' + ref:>14}{'CPU / ' + ref:>13}")
    for p, r in rows.items():
        print(
            f"{p:<12}{r['wall_ms']:>9.2f}{r['cpu_ms']:>9.2f}{r['cpu_per_wall']:>10.2f}"
            f"{r['wall_ms'] / first['wall_ms']:>14.2f}{r['cpu_ms'] / first['cpu_ms']:>13.2f}"
        )
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
