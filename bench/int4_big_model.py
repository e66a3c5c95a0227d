"""Peak memory and time of converting and INT4-quantizing a 1.2B-parameter LLaMA-style decoder, side by side.

The model is random-init and written *directly as bf16 safetensors shards* (one tensor at a time, like a real
Hugging Face download: `model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`), so no stage ever
holds the whole model. Shape: TinyLlama-1.1B's layer (hidden 2048, 32 heads, 4 KV heads, intermediate 5632,
vocab 32000, untied lm_head) with 24 layers instead of 22 -> 1.19B parameters.

Each stage runs in its own child process and reports its own peak RSS (`getrusage(RUSAGE_SELF).ru_maxrss`):
  write    - the bf16 shards
  convert  - `edgekit.hf.convert_hf` -> embed_tokens.onnx + decoder_model_merged.onnx (+ .onnx.data, fp32)
  int4     - `run_pipeline` with `int4:block=32,method=rtn` (cpu MatMulNBits), with the pipeline's numerical
             check against the fp32 graph on (the default: two ORT sessions, one after the other); `--no-check`
             measures the pass alone.
Ratios: peak RSS / fp32 weight bytes, INT4 size / fp32 size.

    python bench/int4_big_model.py [--layers 24] [--work /tmp/edgekit-int4-big] [--json bench/int4_big_model.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SHAPE = dict(hidden=2048, heads=32, kv_heads=4, intermediate=5632, vocab=32000)
SHARD_BYTES = 1_000_000_000


def tensor_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    h, hd = SHAPE["hidden"], SHAPE["hidden"] // SHAPE["heads"]
    kv, m, v = SHAPE["kv_heads"] * hd, SHAPE["intermediate"], SHAPE["vocab"]
    shapes = {"model.embed_tokens.weight": (v, h)}
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes.update(
            {
                f"{p}.input_layernorm.weight": (h,),
                f"{p}.self_attn.q_proj.weight": (h, h),
                f"{p}.self_attn.k_proj.weight": (kv, h),
                f"{p}.self_attn.v_proj.weight": (kv, h),
                f"{p}.self_attn.o_proj.weight": (h, h),
                f"{p}.post_attention_layernorm.weight": (h,),
                f"{p}.mlp.gate_proj.weight": (m, h),
                f"{p}.mlp.up_proj.weight": (m, h),
                f"{p}.mlp.down_proj.weight": (h, m),
            }
        )
    shapes.update({"model.norm.weight": (h,), "lm_head.weight": (v, h)})
    return shapes


def hf_config(layers: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": SHAPE["hidden"],
        "intermediate_size": SHAPE["intermediate"],
        "num_hidden_layers": layers,
        "num_attention_heads": SHAPE["heads"],
        "num_key_value_heads": SHAPE["kv_heads"],
        "vocab_size": SHAPE["vocab"],
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "torch_dtype": "bfloat16",
        "attention_bias": False,
        "mlp_bias": False,
    }


def random_bf16(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Norms 1, matrices uniform +-1/sqrt(fan_in) (embeddings N(0, 0.02)), truncated to bf16 bits."""
    if len(shape) == 1:
        w = np.ones(shape, np.float32)
    else:
        w = rng.random(shape, np.float32)
        w -= 0.5
        w *= 2.0 / np.sqrt(shape[1])
    return (w.view(np.uint32) >> 16).astype(np.uint16)


def write_shards(out: Path, layers: int, seed: int = 0) -> dict:
    """Sharded bf16 safetensors, written tensor by tensor (the header first, from the shapes alone)."""
    out.mkdir(parents=True, exist_ok=True)
    shapes = tensor_shapes(layers)
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        n = 2 * int(np.prod(shape))
        if size and size + n > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    rng = np.random.default_rng(seed)
    weight_map = {}
    for k, names in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for name in names:
            n = 2 * int(np.prod(shapes[name]))
            header[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [offset, offset + n]}
            offset += n
            weight_map[name] = fname
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        with open(out / fname, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            for name in names:
                random_bf16(shapes[name], rng).tofile(f)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(hf_config(layers), indent=2))
    params = sum(int(np.prod(s)) for s in shapes.values())
    return {"params": params, "shards": len(shards)}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------------------------------
def stage(name: str, args: argparse.Namespace) -> dict:
    """Runs inside the child process."""
    work = Path(args.work)
    start = time.perf_counter()
    extra: dict = {}
    if name == "write":
        shutil.rmtree(work / "hf", ignore_errors=True)
        extra = write_shards(work / "hf", args.layers)
    elif name == "convert":
        from edgekit.hf import convert_hf

        shutil.rmtree(work / "onnx", ignore_errors=True)
        convert_hf(work / "hf", work / "onnx")
    elif name == "int4":
        from edgekit.passes import make_pass, run_pipeline

        shutil.rmtree(work / "int4", ignore_errors=True)
        res = run_pipeline(
            work / "onnx",
            work / "int4",
            [make_pass("int4:block=32,method=rtn")],
            check=not args.no_check,
            check_samples=2,
        )
        rep = res.reports[0]
        worst = rep.worst("logits")
        extra = {
            "matmuls": rep.notes.get("matmuls"),
            "pass_seconds": round(rep.seconds, 1),
            "logits_rel_l2": None if worst is None else round(worst.rel_l2, 4),
            "check_skipped": rep.notes.get("check_skipped"),
        }
    seconds = time.perf_counter() - start
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"stage": name, "seconds": round(seconds, 1), "peak_rss_gib": round(peak_kb / 1024**2, 2), **extra}


def run_child(name: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--stage", name, "--work", args.work, "--layers", str(args.layers)]
    if args.no_check:
        cmd.append("--no-check")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"stage {name} failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--work", default="/tmp/edgekit-int4-big")
    ap.add_argument("--no-check", action="store_true", help="run the INT4 pipeline without its numerical check")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (shards and graphs)")
    ap.add_argument("--json", default="bench/int4_big_model.json")
    ap.add_argument("--stage", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stage:
        print(json.dumps(stage(args.stage, args)))
        return

    work = Path(args.work)
    rows = [run_child(s, args) for s in ("write", "convert", "int4")]
    params = rows[0]["params"]
    sizes = {
        "hf_bf16": dir_bytes(work / "hf"),
        "onnx_fp32": dir_bytes(work / "onnx"),
        "onnx_int4": dir_bytes(work / "int4"),
    }
    fp32_gb = sizes["onnx_fp32"] / 1e9
    result = {
        "params": params,
        "layers": args.layers,
        "shape": SHAPE,
        "check": not args.no_check,
        "stages": rows,
        "bytes": sizes,
        "ratios": {
            "int4_over_fp32_size": round(sizes["onnx_int4"] / sizes["onnx_fp32"], 3),
            **{f"{r['stage']}_peak_rss_over_fp32": round(r["peak_rss_gib"] * 1.073741824 / fp32_gb, 3) for r in rows},
        },
        "machine": {
            "cpus": __import__("os").cpu_count(),
            "mem_gb": round(
                __import__("os").sysconf("SC_PAGE_SIZE") * __import__("os").sysconf("SC_PHYS_PAGES") / 1024**3, 1
            ),
        },
        "source": "bench/int4_big_model.py: one child process per stage, ru_maxrss of that child",
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(
        f"random-init LLaMA-style decoder, {params / 1e9:.2f}B parameters, {args.layers} layers "
        f"(machine: {result['machine']['cpus']} CPUs, {result['machine']['mem_gb']} GiB)"
    )
    print(f"{'stage':<10}{'wall s':>9}{'peak RSS GiB':>14}{'RSS/fp32 size':>15}")
    for r in rows:
        print(
            f"{r['stage']:<10}{r['seconds']:>9}{r['peak_rss_gib']:>14}"
            f"{result['ratios'][r['stage'] + '_peak_rss_over_fp32']:>15}"
        )
    print(
        f"sizes: bf16 shards {sizes['hf_bf16'] / 1e9:.2f} GB, ONNX fp32 {fp32_gb:.2f} GB, "
        f"INT4 {sizes['onnx_int4'] / 1e9:.2f} GB (x{result['ratios']['int4_over_fp32_size']} of fp32)"
    )
    q = rows[2]
    print(
        f"int4: {q.get('matmuls')}, pass alone {q.get('pass_seconds')} s, logits rel L2 vs fp32 "
        f"{q.get('logits_rel_l2')}{' (' + q['check_skipped'] + ')' if q.get('check_skipped') else ''}"
    )
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
