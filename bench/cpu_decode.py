"""Decode speed of the cpu target's two run sides, side by side in one run: the portable decoder served by
`CpuBackend` (the engine pads rows of different lengths into one batch, `PastKVSlots`, and every step's Concat
copies each row's whole KV cache) against the fused decoder served by `CpuSlotBackend` (`targets/cpu/fused.py`:
GroupQueryAttention over one KV buffer per layer bound in place, packed QKV, fused norms, MatMulNBits at
accuracy_level 4).

Models (made here, nothing downloaded; cached under `--work`):
- `radreport`: radreport-tiny's trained weights, exported, the `int4` recipe (RTN, block 128 / 64 where K needs
  it, LM head at 8 bits, INT4 embedding table);
- `smollm`: a random-init LLaMA of SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads, 3 KV heads, intermediate
  1536, vocab 49152, tied embeddings, rope_theta 100000), made by transformers from a config (torch seed 0) and
  saved with `save_pretrained`, then `edgekit convert` and `edgekit optimize --pass int4:block=32,method=rtn`
  (their library calls: `convert_hf`, `run_pipeline`).
The fused decoder is each model's portable decoder lowered by `FuseCpuDecoder` with the defaults the cpu build
ships. `--variants` adds lowerings with one default changed (`acc0`: accuracy_level 0, `nopack`: q/k/v apart,
`nonorm`: RMSNorm left decomposed) for the measurements behind those defaults, and `single`: the fused decoder
with the engine making one backend call per step (`greedy_run_steps=1`) instead of its multi-step greedy runs,
timed in pairs with the default engine on the same backend after the others (`engine_pairs`).

Timing: `--threads` intra-op threads (2; `--no-spin`: their spinning stopped at the end of each run, as edgekitd
runs them), a 32-token prompt per row (row r: other ids), 128 new tokens, greedy, no
stop tokens, through the engine (`Engine`, one request per row, `max_batch` = the batch), each token stamped as
the engine chooses it (`on_token`). Decode tok/s at batch B = tokens chosen while all B rows decode / seconds of
that stretch (from every row having its first token to the first row having its last: rows whose prefill the
engine could not share start apart), as bench/decode_vs_genai.py defines it; at batch 1, tokens after the
first / seconds after the first. Each configuration runs once to warm up, then `--repeats` times, the
configurations interleaved (A B C, then C B A, ...) so load from other processes falls on all alike; the table
gives each configuration's median and the median over repeats of its rate over the portable decoder's rate in the
same repeat (what to read on a shared machine), and the JSON every repeat. Greedy agreement: the share of
generated tokens equal to the portable decoder's (random-init SmolLM2 has flat logits, where int8 activations flip
near-ties and a row then diverges; radreport-tiny is trained). Logit error: the largest |fused - portable| over
the largest |portable| on a teacher-forced prompt + 8 greedy steps.

    python bench/cpu_decode.py [--only radreport|smollm] [--batches 1 8] [--repeats 3] [--threads 2] [--no-spin]
                               [--variants acc0 nopack nonorm] [--work out/cpu_decode] [--json bench/cpu_decode.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from edgekit import names
from edgekit.engine import Engine, Request
from edgekit.generate import GenerationOptions
from edgekit.ort import CpuBackend
from edgekit.positions import for_rank
from edgekit.targets.cpu.fused import FuseCpuDecoder
from edgekit.targets.cpu.slots import CpuSlotBackend

VARIANTS = {
    "fused": {},
    "acc0": {"accuracy_level": 0},
    "nopack": {"pack_qkv": False},
    "nonorm": {"fuse_norms": False},
}
ENGINE_OPTIONS = {"single": {"greedy_run_steps": 1}}  # the fused decoder, the engine's options changed
SMOLLM2 = dict(  # SmolLM2-135M's shape as transformers' LlamaConfig takes it (bench/decode_vs_genai.py too)
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    initializer_range=0.02,
)


# models -----------------------------------------------------------------------------------------------------
def radreport_graphs(work: Path) -> tuple[Path, int]:
    from edgekit.build import default_model_dir
    from edgekit.export import export_default
    from edgekit.passes import run_pipeline
    from edgekit.passes.recipe import load_recipe

    out = work / "radreport-int4"
    if not (out / names.DECODER).is_file():
        export_default(default_model_dir(), work / "radreport-fp32")
        run_pipeline(work / "radreport-fp32", out, load_recipe("int4").passes, check=False, overwrite=True)
    return out, 588


def smollm_graphs(work: Path) -> tuple[Path, int]:
    from edgekit.hf import convert_hf
    from edgekit.passes import make_pass, run_pipeline

    out = work / "smollm2-135m-int4"
    if not (out / names.DECODER).is_file():
        import torch
        import transformers

        hf = work / "smollm2-135m-hf"
        if not (hf / "config.json").is_file():
            torch.manual_seed(0)
            transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOLLM2)).eval().save_pretrained(hf)
        convert_hf(hf, work / "smollm2-135m-fp32")
        passes = [make_pass("int4:block=32,method=rtn")]
        run_pipeline(work / "smollm2-135m-fp32", out, passes, check=False, overwrite=True)
    return out, SMOLLM2["vocab_size"]


MODELS = {"radreport": radreport_graphs, "smollm": smollm_graphs}


def lower(graphs: Path, variant: str) -> Path:
    path = graphs / f"decoder_cpu.{variant}.onnx"
    model = ir.load(graphs / names.DECODER)
    FuseCpuDecoder(**VARIANTS[variant])(model)
    ir.save(model, path)
    return path


def backend(graphs: Path, variant: str, decoders: dict, threads: int, rows: int, spin: bool = True):
    if variant == "portable":
        return CpuBackend(
            None, graphs / names.EMBED_TOKENS, graphs / names.DECODER, intra_op_threads=threads, spin_between_runs=spin
        )
    return CpuSlotBackend(
        decoders[variant],
        graphs / names.EMBED_TOKENS,
        None,
        max_rows=rows,
        intra_op_threads=threads,
        spin_between_runs=spin,
    )


# measuring --------------------------------------------------------------------------------------------------
def decode_rate(be, batch: int, vocab: int, prompt: int, new: int, **options) -> tuple[float, list[list[int]]]:
    """Decode tok/s of `batch` requests through the engine (`options`: the engine's), and their tokens."""
    rng = np.random.default_rng(batch)
    stamps: list[list[float]] = [[] for _ in range(batch)]
    engine = Engine(be, max_batch=batch, **options)
    opts = GenerationOptions(max_new_tokens=new, stop_token_ids=[])
    tickets = [
        engine.submit(
            Request(
                rng.integers(5, vocab, prompt), opts, on_token=lambda _t, _i, s=stamps[r]: s.append(time.perf_counter())
            )
        )
        for r in range(batch)
    ]
    engine.run()
    if batch == 1:
        s = stamps[0]
        rate = (len(s) - 1) / (s[-1] - s[0])
    else:
        start, end = max(s[0] for s in stamps), min(s[-1] for s in stamps)
        rate = sum(start < t <= end for s in stamps for t in s) / (end - start)
    return rate, [t.result().token_ids for t in tickets]


def logit_error(graphs: Path, fused: Path, vocab: int, prompt: int = 32, steps: int = 8) -> float:
    """max |fused - portable| / max |portable| over a prompt and teacher-forced greedy steps."""
    port = CpuBackend(None, graphs / names.EMBED_TOKENS, graphs / names.DECODER, intra_op_threads=2)
    cand = CpuSlotBackend(fused, graphs / names.EMBED_TOKENS, None, max_rows=1, intra_op_threads=2)
    rank = 3 if cand.signature.mrope else 2
    x = port.embed(np.random.default_rng(0).integers(5, vocab, (1, prompt)))
    want, past = port.decode(x, np.ones((1, prompt), np.int64), for_rank(np.arange(prompt)[None], rank), None)
    got = cand.prefill(0, x, for_rank(np.arange(prompt)[None], rank))
    err, scale = 0.0, 0.0
    for i in range(steps + 1):
        err, scale = max(err, float(np.abs(want[0, -1] - got).max())), max(scale, float(np.abs(want[0, -1]).max()))
        if i == steps:
            break
        x = port.embed(np.array([[int(want[0, -1].argmax())]]))
        p = for_rank(np.array([[prompt + i]]), rank)
        want, past = port.decode(x, np.ones((1, prompt + i + 1), np.int64), p, past)
        got = cand.step([0], x, p)[0]
    return err / scale


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    return float(np.mean([np.mean(np.asarray(x) == np.asarray(y)) for x, y in zip(a, b)]))


def run(args) -> dict:
    lowerings = ["portable", "fused", *(v for v in args.variants if v in VARIANTS)]
    engine_variants = [v for v in args.variants if v in ENGINE_OPTIONS]
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    results = {"machine": machine(args.threads), "settings": settings, "models": {}}
    for model in args.only or list(MODELS):
        graphs, vocab = MODELS[model](args.work)
        decoders = {v: lower(graphs, v) for v in lowerings if v != "portable"}
        rows = max(args.batches)
        backends = {v: backend(graphs, v, decoders, args.threads, rows, not args.no_spin) for v in lowerings}
        out = results["models"][model] = {
            "graphs": str(graphs),
            "decoder_bytes": sum(p.stat().st_size for p in graphs.glob("decoder_model_merged.onnx*")),
            "logit_error": {v: logit_error(graphs, decoders[v], vocab) for v in decoders},
            "batches": {},
        }
        for batch in args.batches:
            rates, tokens = alternated({v: (backends[v], {}) for v in lowerings}, batch, vocab, args)
            out["batches"][str(batch)] = {
                "tok_s": rates,
                "median": {v: statistics.median(r) for v, r in rates.items()},
                # each repeat's rate over the portable decoder's in the same repeat: load from other processes,
                # which drifts over minutes, falls on both sides of a ratio alike
                "speedup": {
                    v: statistics.median(a / b for a, b in zip(rates[v], rates["portable"])) for v in lowerings
                },
                "greedy_agreement": {v: agreement(tokens[v], tokens["portable"]) for v in lowerings[1:]},
            }
            if engine_variants:
                out["batches"][str(batch)]["engine"] = engine_pairs(
                    backends["fused"], engine_variants, batch, vocab, args
                )
            print(f"{model} batch {batch}: " + ", ".join(f"{v} {statistics.median(r):.1f}" for v, r in rates.items()))
    return results


def alternated(configs: dict, batch: int, vocab: int, args) -> tuple[dict, dict]:
    """Each configuration (name -> (backend, engine options)) once, 8 tokens, to warm up, then `--repeats` times,
    interleaved (A B C, then C B A, ...) so load from other processes falls on all alike: the rates, and the
    tokens of each one's last run."""
    rates: dict[str, list[float]] = {v: [] for v in configs}
    tokens: dict[str, list[list[int]]] = {}
    for be, options in configs.values():
        decode_rate(be, batch, vocab, args.prompt, 8, **options)
    names = list(configs)
    for repeat in range(args.repeats):
        for v in names if repeat % 2 == 0 else names[::-1]:
            be, options = configs[v]
            rate, tokens[v] = decode_rate(be, batch, vocab, args.prompt, args.new, **options)
            rates[v].append(rate)
    return rates, tokens


def engine_pairs(be, variants: list[str], batch: int, vocab: int, args) -> dict:
    """The default engine against engine variants on the fused backend, alternated among themselves only: right
    after the portable decoder's runs, either side ran up to 0.7x slower for a while (its sessions' pool threads,
    the caches), which split one configuration's repeats in two when it sometimes followed them."""
    configs = {v: (be, ENGINE_OPTIONS.get(v, {})) for v in ["fused", *variants]}
    rates, tokens = alternated(configs, batch, vocab, args)
    return {
        "tok_s": rates,
        "median": {v: statistics.median(r) for v, r in rates.items()},
        "fused_over": {v: statistics.median(a / b for a, b in zip(rates["fused"], rates[v])) for v in variants},
        "same_tokens": {v: tokens[v] == tokens["fused"] for v in variants},
    }


def machine(threads: int) -> dict:
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "load_avg_at_start": os.getloadavg(),
        "threads": threads,
        "onnxruntime": ort.__version__,
    }


def table(results: dict) -> str:
    lines = []
    for model, m in results["models"].items():
        lines.append(f"\n{model} ({m['decoder_bytes'] / 2**20:.1f} MiB portable decoder)")
        variants = list(next(iter(m["batches"].values()))["median"])
        lines.append(
            "batch | "
            + " | ".join(f"{v} tok/s" for v in variants)
            + " | "
            + " | ".join(f"{v} / portable" for v in variants[1:])
        )
        for batch, b in m["batches"].items():
            cells = " | ".join(f"{b['median'][v]:.1f}" for v in variants)
            ratios = " | ".join(f"{b['speedup'][v]:.2f}x" for v in variants[1:])
            lines.append(f"{batch} | {cells} | {ratios}")
        err = ", ".join(f"{v} {e:.1e}" for v, e in m["logit_error"].items())
        agree = ", ".join(
            f"b{batch} {v} {a:.2f}" for batch, b in m["batches"].items() for v, a in b["greedy_agreement"].items()
        )
        lines.append(f"logit error vs portable: {err}; greedy agreement: {agree}")
        for batch, b in m["batches"].items():
            for v, r in b.get("engine", {}).get("fused_over", {}).items():
                e = b["engine"]
                lines.append(
                    f"batch {batch}, the default engine against `{v}` on the fused decoder, alternated: "
                    f"{e['median']['fused']:.1f} vs {e['median'][v]:.1f} tok/s, {r:.2f}x; "
                    f"same tokens: {e['same_tokens'][v]}"
                )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", choices=list(MODELS))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--no-spin",
        action="store_true",
        help="pool threads stop spinning at the end of each run, as edgekitd runs them (session.force_spinning_stop)",
    )
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=128)
    p.add_argument(
        "--variants", nargs="*", default=[], choices=[*(v for v in VARIANTS if v != "fused"), *ENGINE_OPTIONS]
    )
    p.add_argument("--work", type=Path, default=Path("out/cpu_decode"))
    p.add_argument("--json", type=Path, default=Path(__file__).with_suffix(".json"))
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    results = run(args)
    print(table(results))
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
