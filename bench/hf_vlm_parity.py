"""Hugging Face VLM import parity: edgekit's graphs (ONNX Runtime CPU) against transformers on random-init models
built from configs (nothing downloaded), per family at two sizes, plus the memory of one 2B-class import.

Per family and size: 100 cases of a random grey image (the vision graph's size) and the model's chat template around
8 random tokens, the image where the template's image token stands (as a bundle serves it, and as transformers'
processor lays it out); greedy tokens from transformers' `generate()` (12 new tokens) against edgekit's
`generate()` on the converted graphs, and the prefill logits (max |error| / max |logit|), measured by the build's
own `edgekit.hf.parity`. Export time and peak RSS are of `convert_hf` alone, in a
child process (VmHWM of that process; the peak after its imports beside it). The 2B-class run (`--big`)
builds a LLaVA of ~2.0B parameters (a CLIP-L/14-336-sized tower + a 2048-wide, 24-layer LLaMA) in float16, saves
it sharded, and converts it in a child process: its peak RSS is the figure that says tensors are streamed (the
float32 graphs alone are ~8 GB); `--big-qwen` does the same for Qwen2-VL-2B's whole geometry at a 448 px side.

    python bench/hf_vlm_parity.py                  # 8 configurations x 2 sizes x 100 cases
    python bench/hf_vlm_parity.py --cases 10 --big # and the 2B-class memory run
    python bench/hf_vlm_parity.py --only split     # the configurations whose name holds "split"
    python bench/hf_vlm_parity.py --only none --geometry  # SmolVLM-256M's 4x4 split geometry, 4 cases
    python bench/hf_vlm_parity.py --only none --next-geometry  # llava-v1.6's 672 px anyres geometry, 4 cases
    python bench/hf_vlm_parity.py --only qwen2  # Qwen2-VL and Qwen2.5-VL at a fixed side (tiny 56, medium 112 px)
    python bench/hf_vlm_parity.py --only none --qwen-geometry --big-qwen  # Qwen2-VL-2B's widths; a whole 2B
Writes out/bench/hf_vlm_parity.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the random-init model factory

from hf_vlm_factory import (  # noqa: E402
    make_idefics3,
    make_llava,
    make_llava_next,
    make_llava_next_geometry,
    make_qwen2_vl,
    make_qwen2_vl_geometry,
    make_smolvlm_geometry,
    qwen2_vl_2b_config,
    save_qwen2_vl_serving,
)

SIZES = ("tiny", "medium")  # the factory's sizes: ~0.13M and ~17M parameters
CONFIGS = {
    "llava (CLIP + LLaMA)": lambda p, size: make_llava(p, size, tower="clip", text="llama"),
    "llava (SigLIP + Qwen2)": lambda p, size: make_llava(p, size, tower="siglip", text="qwen2"),
    "idefics3": lambda p, size: make_idefics3(p, size, family="idefics3"),
    "smolvlm": lambda p, size: make_idefics3(p, size, family="smolvlm"),
    # the processor's image splitting: the frame cut into 2 x 2 tiles + the global image (5 tower inputs)
    "idefics3 split 2x2": lambda p, size: make_idefics3(p, size, family="idefics3", tiles=2),
    "smolvlm split 2x2": lambda p, size: make_idefics3(p, size, family="smolvlm", tiles=2),
    # anyres at the frame's square pinpoint: 2 x 2 crops + the base image (5 tower inputs), image_newline per row
    "llava_next (CLIP + LLaMA) 2x2": lambda p, size: make_llava_next(p, size, tower="clip", text="llama", tiles=2),
    "llava_next (SigLIP + Qwen2) 2x2": lambda p, size: make_llava_next(
        p, size, tower="siglip", text="qwen2", tiles=2, vision_feature_select_strategy="full"
    ),
    # one fixed square side (min_pixels = max_pixels), M-RoPE positions (3, batch, seq) from edgekit.positions
    "qwen2_vl (fixed 56/112 px, M-RoPE)": lambda p, size: make_qwen2_vl(p, size),
    # + windowed vision attention: windows of 3 x 3 merge units over 4 x 4 (uneven), full attention in the last block
    "qwen2_5_vl (fixed 56/112 px, M-RoPE, windows)": lambda p, size: make_qwen2_vl(
        p, size, family="qwen2_5_vl", window=3 * 2 * (7 if size == "tiny" else 14)
    ),
}
CHILD = r"""
import json, re, sys, time
from edgekit.hf import convert_hf
# VmHWM: this process's peak RSS since exec (ru_maxrss would carry the parent's peak across fork + exec)
rss = lambda: int(re.search(r"VmHWM:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) / 1024
imported = rss()
t0 = time.perf_counter()
r = convert_hf(sys.argv[1], sys.argv[2])
print(json.dumps({"seconds": time.perf_counter() - t0, "peak_rss_mb": rss(), "rss_after_imports_mb": imported}))
"""


def convert_in_child(hf: Path, out: Path) -> dict:
    """convert_hf in a fresh process: its wall time and the process's peak RSS (nothing else lives there)."""
    res = subprocess.run([sys.executable, "-c", CHILD, str(hf), str(out)], capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def parity(vlm, onnx_dir: Path, cases: int, new_tokens: int) -> dict:
    """The build's own parity measurement (`edgekit.hf.parity`), at `cases` cases: the prompt as a bundle serves
    it (the model's chat template around 8 random tokens, the image where the template's image token stands)."""
    from edgekit.hf import SafetensorsCheckpoint, read_hf_config
    from edgekit.hf.parity import measure_hf_parity
    from edgekit.hf.vlm import vlm_spec

    # the spec the child's conversion used, without converting again (as edgekit build reads it)
    spec = vlm_spec(read_hf_config(vlm.path), vlm.path, SafetensorsCheckpoint(vlm.path).entries)
    got = measure_hf_parity(onnx_dir, vlm.path, spec, samples=cases, new_tokens=new_tokens)
    params = sum(p.numel() for p in vlm.model.parameters())
    return {
        "cases": cases,
        "greedy_identical": got["greedy_identical"],
        "max_rel_logit_error": got["max_rel_logit_error"],
        "params": params,
    }


def save_float16_random(model_class, cfg, out: Path) -> int:
    """A random-init model (std 0.02) built on the meta device and saved as float16 shards, as a 2B-class
    checkpoint is published, without a float32 copy in memory; its parameter count."""
    import torch

    torch.set_default_dtype(torch.float16)
    try:
        with torch.device("meta"):
            model = model_class(cfg)
        model = model.to_empty(device="cpu")
    finally:
        torch.set_default_dtype(torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out, max_shard_size="2GB")
    return params


def big_run(root: Path) -> dict:
    """A ~2B random-init LLaVA, float16 shards, converted in a child process."""
    import transformers as tf

    vcfg = tf.CLIPVisionConfig(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16, image_size=336
    )
    vcfg.patch_size = 14
    tcfg = tf.LlamaConfig(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=8,
        vocab_size=32064,
    )
    cfg = tf.LlavaConfig(vision_config=vcfg, text_config=tcfg, image_token_id=32000)
    t0 = time.perf_counter()
    params = save_float16_random(tf.LlavaForConditionalGeneration, cfg, root / "hf")
    made = time.perf_counter() - t0
    stats = convert_in_child(root / "hf", root / "onnx")
    on_disk = sum(f.stat().st_size for f in (root / "onnx").iterdir())
    return {"params": params, "make_seconds": made, **stats, "onnx_bytes": on_disk, "checkpoint": "float16 shards"}


def big_qwen_run(root: Path) -> dict:
    """Qwen2-VL-2B's whole geometry (2.2B parameters: a 1280-wide 32-block vision tower, a 1536-wide 28-layer
    Qwen2, vocab 151936, tied), float16 shards, the processor pinned to 448 px, converted in a child process."""
    import transformers as tf

    cfg, proc = qwen2_vl_2b_config(448)
    t0 = time.perf_counter()
    params = save_float16_random(tf.Qwen2VLForConditionalGeneration, cfg, root / "hf")
    save_qwen2_vl_serving(root / "hf", proc)
    made = time.perf_counter() - t0
    stats = convert_in_child(root / "hf", root / "onnx")
    on_disk = sum(f.stat().st_size for f in (root / "onnx").iterdir())
    return {"params": params, "make_seconds": made, **stats, "onnx_bytes": on_disk, "checkpoint": "float16 shards"}


def qwen_geometry_run(root: Path, cases: int, new_tokens: int, family: str = "qwen2_vl") -> dict:
    """Qwen2-VL-2B's widths and vocab at a 448 px fixed side (256 image tokens), one layer per side; Qwen2.5-VL-3B's
    with two vision blocks (one in 4 x 4-unit windows, one over the whole image) and one text layer."""
    vlm = make_qwen2_vl_geometry(root / "hf", family=family)
    stats = convert_in_child(root / "hf", root / "onnx")
    name = "qwen2_vl (2B geometry, 1+1 layers)" if family == "qwen2_vl" else "qwen2_5_vl (3B geometry, 2+1 layers)"
    return {"family": name, "size": "448 px", **stats, **parity(vlm, root / "onnx", cases, new_tokens)}


def geometry_run(root: Path, cases: int, new_tokens: int) -> dict:
    """SmolVLM-256M's split geometry (2048 px frame, 4 x 4 tiles of 512 + the global image, 17 x 64 image
    tokens, real widths and vocab), one layer per side: the span and its parity at full size."""
    vlm = make_smolvlm_geometry(root / "hf")
    stats = convert_in_child(root / "hf", root / "onnx")
    return {
        "family": "smolvlm split 4x4 (256M geometry, 1+1 layers)",
        "size": "2048 px",
        **stats,
        **parity(vlm, root / "onnx", cases, new_tokens),
    }


def next_geometry_run(root: Path, cases: int, new_tokens: int) -> dict:
    """llava-v1.6's anyres geometry (a 672 px frame, 2 x 2 crops of 336 + the base image through a CLIP-L/14-336
    tower, a span of 2928 tokens, vocab 32064), two tower layers and a 1024-wide one-layer LLaMA."""
    vlm = make_llava_next_geometry(root / "hf")
    stats = convert_in_child(root / "hf", root / "onnx")
    return {
        "family": "llava_next 2x2 (v1.6 geometry, 2+1 layers)",
        "size": "672 px",
        **stats,
        **parity(vlm, root / "onnx", cases, new_tokens),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=100)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--big", action="store_true", help="also the 2B-class memory run (~4 GB + ~8 GB of disk)")
    ap.add_argument("--geometry", action="store_true", help="also SmolVLM-256M's 4x4 split at full size")
    ap.add_argument("--next-geometry", action="store_true", help="also llava-v1.6's 672 px anyres at full size")
    ap.add_argument(
        "--qwen-geometry", action="store_true", help="also Qwen2-VL-2B's and Qwen2.5-VL-3B's widths at 448 px, 4 cases"
    )
    ap.add_argument("--big-qwen", action="store_true", help="also the memory run of a whole Qwen2-VL-2B (~13 GB disk)")
    ap.add_argument("--only", default="", help="run only the configurations whose name contains this")
    ap.add_argument("--out", type=Path, default=Path("out/bench/hf_vlm_parity.json"))
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)  # both sides on one thread: a fair pair, and no oversubscription of a shared box
    rows = []
    with tempfile.TemporaryDirectory(prefix="hf-vlm-parity-") as tmp:
        for name, make in ((n, m) for n, m in CONFIGS.items() if args.only in n):
            for size in SIZES:
                root = Path(tmp) / f"{name.split()[0]}-{size}-{len(rows)}"
                vlm = make(root / "hf", size)
                row = {"family": name, "size": size, **convert_in_child(root / "hf", root / "onnx")}
                row.update(parity(vlm, root / "onnx", args.cases, args.new_tokens))
                rows.append(row)
                print(f"  {name} {size}: done", file=sys.stderr)
                shutil.rmtree(root, ignore_errors=True)
        if args.geometry:
            rows.append(geometry_run(Path(tmp) / "geometry", min(args.cases, 4), args.new_tokens))
        if args.next_geometry:
            rows.append(next_geometry_run(Path(tmp) / "next-geometry", min(args.cases, 4), args.new_tokens))
        if args.qwen_geometry:
            for fam in ("qwen2_vl", "qwen2_5_vl"):
                rows.append(qwen_geometry_run(Path(tmp) / f"{fam}-geometry", min(args.cases, 4), args.new_tokens, fam))
        big = big_run(Path(tmp) / "big") if args.big else None
        big_qwen = big_qwen_run(Path(tmp) / "big-qwen") if args.big_qwen else None
    import transformers

    result = {
        "rows": rows,
        "big": big,
        "big_qwen": big_qwen,
        "source": f"transformers {transformers.__version__} / torch {torch.__version__} (float32) vs ONNX Runtime CPU "
        f"on the converted graphs; random-init models from configs; {args.cases} cases per row, "
        f"{args.new_tokens} greedy tokens; export time and peak RSS of convert_hf in a child process",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("| family | size | params | greedy identical | max rel logit error | export s | peak RSS MB |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['family']} | {r['size']} | {r['params'] / 1e6:.2f}M | {r['greedy_identical']:.0%} "
            f"| {r['max_rel_logit_error']:.1e} | {r['seconds']:.2f} "
            f"| {r['peak_rss_mb']:.0f} ({r['rss_after_imports_mb']:.0f}) |"
        )
    if big:
        print(
            f"\n2B-class llava ({big['params'] / 1e9:.2f}B params, {big['checkpoint']}): "
            f"export {big['seconds']:.0f} s, peak RSS {big['peak_rss_mb']:.0f} MB "
            f"({big['rss_after_imports_mb']:.0f} MB after imports), "
            f"ONNX {big['onnx_bytes'] / 1e9:.1f} GB"
        )
    if big_qwen:
        b = big_qwen
        print(
            f"\n2B-class qwen2_vl ({b['params'] / 1e9:.2f}B params, {b['checkpoint']}, 448 px): export "
            f"{b['seconds']:.0f} s, peak RSS {b['peak_rss_mb']:.0f} MB ({b['rss_after_imports_mb']:.0f} MB after "
            f"imports), ONNX {b['onnx_bytes'] / 1e9:.1f} GB"
        )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
