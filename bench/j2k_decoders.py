"""The JPEG 2000 decoders edgekit can use (pydicom's plugins: GDCM, pylibjpeg-openjpeg, Pillow), side by side on one
study's pixel data: wall time and CPU time per frame, alternated in rounds so every decoder sees the same background
load. Wall time is what a report waits alone; CPU time is what it costs when every core is busy (edgekitd under load,
where the ingest processes decode in parallel): a decoder that spreads one frame over threads answers sooner alone
and costs more CPU. GDCM picks its own thread count (one per online CPU); Pillow's OpenJPEG reads OPJ_NUM_THREADS,
which edgekit sets (edgekit/ingest/decode_threads.py), so Pillow is timed at one thread and at every CPU.

    python bench/j2k_decoders.py [--study models/samples/cr_chest/image.dcm] [--size 2048] [--rounds 7] [--frames 20]
                                 [--out FILE]

`--size` re-encodes the study's frame at a detector's size first. Prints a table (each figure the median over
rounds, and the ratio to GDCM, pydicom's first choice), writes JSON.
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
from pydicom.uid import JPEG2000Lossless

REPO = Path(__file__).resolve().parents[1]


def timed(decode, n: int) -> tuple[float, float]:
    """Milliseconds of wall and CPU time per decode over `n` decodes."""
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        decode()
    return (time.perf_counter() - w0) / n * 1e3, (time.process_time() - c0) / n * 1e3


def variants(plugins: list[str], cpus: int) -> list[tuple[str, str, int | None]]:
    """(label, plugin, OPJ_NUM_THREADS) to time: Pillow's OpenJPEG at one thread and at every CPU (edgekit sets it:
    every CPU for a study decoded alone, one each when the ingest processes are all busy); the others as they come."""
    out: list[tuple[str, str, int | None]] = []
    for p in plugins:
        if p == "pillow":
            out += [("pillow 1 thread", p, 1)] + ([(f"pillow {cpus} threads", p, cpus)] if cpus > 1 else [])
        else:
            out.append((p, p, None))
    return out


def resized(ds: pydicom.Dataset, size: int) -> pydicom.Dataset:
    """The study's frame scaled to size x size (bilinear, a little noise so the codec has detail to code) and
    encoded again, JPEG 2000 lossless: a detector-sized image from the sample."""
    from PIL import Image

    frame = ds.pixel_array.astype(np.float32)
    top = 2 ** int(ds.BitsStored) - 1
    big = np.asarray(Image.fromarray(frame).resize((size, size), Image.Resampling.BILINEAR))
    big = big + np.random.default_rng(0).integers(0, 8, big.shape)
    ds.Rows = ds.Columns = size
    ds.compress(JPEG2000Lossless, np.clip(big, 0, top).astype(np.uint16), encoding_plugin="pylibjpeg")
    return ds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--study", type=Path, default=REPO / "models" / "samples" / "cr_chest" / "image.dcm")
    ap.add_argument("--size", type=int, help="re-encode the frame at SIZE x SIZE first (a CR detector: 2048)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--frames", type=int, default=20, help="decodes per decoder per round")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "j2k_decoders.json")
    args = ap.parse_args()

    ds = pydicom.dcmread(args.study)
    if args.size:
        ds = resized(ds, args.size)
    ts = ds.file_meta.TransferSyntaxUID
    decoder = get_decoder(ts)
    plugins = list(decoder.available_plugins)
    if not plugins:
        raise SystemExit(f"{args.study}: no decoder for {ts.name} is installed")
    cpus = len(os.sched_getaffinity(0))
    runs = variants(plugins, cpus)
    reference = None
    for label, plugin, threads in runs:  # warm each, and check they agree (lossless: they must)
        _threads(threads)
        arr = decoder.as_array(ds, decoding_plugin=plugin)[0]
        reference = arr if reference is None else reference
        if not np.array_equal(arr, reference):
            raise SystemExit(f"{label} decodes {args.study} differently from {runs[0][0]}")
    walls: dict[str, list[float]] = {label: [] for label, _, _ in runs}
    cpu_ms: dict[str, list[float]] = {label: [] for label, _, _ in runs}
    for r in range(args.rounds):
        for label, plugin, threads in runs if r % 2 == 0 else reversed(runs):
            _threads(threads)
            wall, cpu = timed(lambda p=plugin: decoder.as_array(ds, decoding_plugin=p), args.frames)
            walls[label].append(wall)
            cpu_ms[label].append(cpu)
    rows = {
        label: {
            "plugin": plugin,
            "opj_num_threads": threads,
            "wall_ms": float(np.median(walls[label])),
            "cpu_ms": float(np.median(cpu_ms[label])),
        }
        for label, plugin, threads in runs
    }
    for r in rows.values():
        r["cpu_per_wall"] = r["cpu_ms"] / r["wall_ms"]
    ref = "gdcm" if "gdcm" in rows else runs[0][0]  # pydicom tries GDCM first for JPEG 2000 when it is installed
    first = rows[ref]
    result = {
        "study": str(args.study),
        "transfer_syntax": f"{ts.name} ({ts})",
        "size": f"{ds.Columns}x{ds.Rows}, {ds.BitsStored}-bit" + (" (re-encoded from the study)" if args.size else ""),
        "cpus": cpus,
        "rounds": args.rounds,
        "decodes_per_round": args.frames,
        "available": plugins,
        "ratios_to": ref,
        "decoders": rows,
    }
    head = f"{result['transfer_syntax']}, {result['size']}"
    print(f"{head}, {args.rounds} rounds of {args.frames} decodes, {cpus} CPUs")
    print(f"{'decoder':<20}{'wall ms':>9}{'CPU ms':>9}{'CPU/wall':>10}{'wall / ' + ref:>14}{'CPU / ' + ref:>13}")
    for label, r in rows.items():
        print(
            f"{label:<20}{r['wall_ms']:>9.2f}{r['cpu_ms']:>9.2f}{r['cpu_per_wall']:>10.2f}"
            f"{r['wall_ms'] / first['wall_ms']:>14.2f}{r['cpu_ms'] / first['cpu_ms']:>13.2f}"
        )
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


def _threads(threads: int | None) -> None:
    """OPJ_NUM_THREADS for the decodes that follow (this script has one thread); None: OpenJPEG's own default."""
    if threads is None:
        os.environ.pop("OPJ_NUM_THREADS", None)
    else:
        os.environ["OPJ_NUM_THREADS"] = str(threads)


if __name__ == "__main__":
    main()
