"""Where a decode token's time goes, edgekit against onnxruntime-genai at batch 1: the decoder graph, and the loop
around it. Side by side in one run, on bench/decode_vs_genai.py's checkpoints and builds (the same `--work` cache;
built there when missing).

- token ms: each side's own loop generating 128 tokens after a 32-token prompt, greedy (edgekit's token engine
  from Python; genai's C++ `generate_next_token`), the mean time between two tokens, first to last (what decode
  tok/s counts; edgekit's engine hands greedy tokens over in runs of several steps, so its gaps are not per token);
- graph ms: each side's decoder graph alone, run through ONNX Runtime's I/O binding from one Python harness (the
  same session options: ORT_ENABLE_ALL, sequential, 2 intra-op threads as in decode_vs_genai), its KV cache
  preallocated and shared between past and present at the length the loop reaches mid-report (96 positions), one
  token in, logits out; the mean of `--runs` runs, the two graphs alternated in blocks of `BLOCK` runs, each
  block in a process of its own (two sessions in one process hid a 9 us difference between the graphs: the
  idle session's spinning pool threads take the 2 cores from the timed one);
- loop ms = token ms - graph ms: everything a token costs outside the graph (edgekit: the engine's Python step,
  the embedding lookup, the binding; genai: its C++ step and search);
- edgekit's engine us a token: its token ms less its decoder's decode-step runs timed inside its own loop (their
  mean; the same graph runs there as in the harness; what the engine's Python costs between two runs, caches cold
  from the graph).
Ratios are edgekit / genai. The machine is shared: each figure is a median over `--repeats` reports (token) or
blocks (graph), interleaved.

    python bench/decode_split.py [--only radreport|smollm] [--runs 1000] [--repeats 15] [--json bench/decode_split.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_vs_genai as dvg  # noqa: E402 - a bench beside this one: its checkpoints and builds

PAST = 96  # positions in the cache when the graph is timed (the middle of a 32 + 128 report)
CAPACITY = 256  # each side's KV buffer length (genai: max_length; edgekit: the slot backend's first capacity)


class BareGraph:
    """One decoder graph in an ORT session with every input and output bound once (past and present share each
    layer's buffer), so a run is the graph's work and nothing else."""

    def __init__(self, path: Path, threads: int, kv_heads: int, head_dim: int):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self.session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        self.binding = self.session.io_binding()
        self.held: list[np.ndarray] = []
        self.kv_shape = (1, kv_heads, CAPACITY, head_dim)  # genai's graph names the last axis, not its size
        outputs = {o.name: o for o in self.session.get_outputs()}
        vocab = int(outputs["logits"].shape[-1])
        for i in self.session.get_inputs():
            self._bind(i.name, self._input(i))
            present = i.name.replace("past_key_values", "present")
            if present in outputs:
                self._bind(present, self.held[-1], output=True)
        self._bind("logits", np.zeros((1, 1, vocab), np.float32), output=True)

    def _input(self, i) -> np.ndarray:
        if i.name.startswith("past_key_values"):
            return np.zeros(self.kv_shape, np.float32)
        fixed = {
            "input_ids": np.array([[5]], np.int64),
            "attention_mask": np.ones((1, PAST + 1), np.int64),
            "position_ids": np.array([[PAST]], np.int64),
            "seqlens_k": np.array([PAST], np.int32),
            "total_sequence_length": np.array(PAST + 1, np.int32),
        }
        if i.name == "inputs_embeds":
            return np.random.default_rng(0).standard_normal((1, 1, int(i.shape[2])), np.float32)
        if i.name not in fixed:
            raise RuntimeError(f"{i.name}: an input this harness does not know how to feed")
        return fixed[i.name]

    def _bind(self, name: str, array: np.ndarray, *, output: bool = False) -> None:
        self.held.append(array)  # ORT reads the raw pointer: the array must outlive the binding
        bind = self.binding.bind_output if output else self.binding.bind_input
        bind(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)

    def times(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            t = time.perf_counter()
            self.session.run_with_iobinding(self.binding)  # no RunOptions: reading one costs ~40 us a call (ORT 1.32)
            out.append(time.perf_counter() - t)
        return out


BLOCK = 100  # graph runs a child process times (after warming up)


def bare_block(path: Path, threads: int, kv_heads: int, head_dim: int, runs: int = BLOCK) -> list[float]:
    """`runs` timed runs of one graph (`BareGraph`) in a fresh process: seconds each."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import decode_split as ds; "
        "g = ds.BareGraph(ds.Path(sys.argv[2]), *map(int, sys.argv[3:6])); g.times(50); "
        "print(json.dumps(g.times(int(sys.argv[6]))))"
    )
    here = str(Path(__file__).resolve().parent)
    args = [sys.executable, "-c", code, here, str(path), str(threads), str(kv_heads), str(head_dim), str(runs)]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


class TimedRuns:
    """edgekit's decoder session with each `run_with_iobinding` timed: the graph as the engine's own loop runs it
    (after each run, the engine's first numpy calls meet caches the graph's weights went through, so its Python
    costs more in the loop than alone)."""

    def __init__(self, session):
        self.session, self.seconds = session, []

    def run_with_iobinding(self, binding) -> None:
        t = time.perf_counter()
        self.session.run_with_iobinding(binding)
        self.seconds.append(time.perf_counter() - t)

    def __getattr__(self, name: str):
        return getattr(self.session, name)


def token_ms(side, ids: np.ndarray) -> float:
    """The mean gap between two tokens of one report, first to last (each side's own stamps)."""
    run = side.run(ids)
    stamps = run.stamps[0]
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3


def split(model: str, work: Path, threads: int, runs: int, repeats: int) -> dict:
    hf_dir = (dvg.make_smollm if model == "smollm" else dvg.make_radreport)(work / "hf" / model)
    recipe = dvg.edgekit_recipe(work, 32)
    edgekit_dir = Path(dvg.build_edgekit(hf_dir, work / f"edgekit-{model}", recipe, False)["dir"])
    genai_dir = Path(dvg.build_genai(hf_dir, work / f"genai-{model}", 32, False)["dir"])
    sides = {"edgekit": dvg.EdgekitSide(edgekit_dir), "genai": dvg.GenaiSide(genai_dir)}
    cfg = json.loads((hf_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    ids = dvg.prompt_ids(hf_dir / "tokenizer.json", 1)
    for name in sides:  # warm-up
        sides[name].run(ids)
    tokens: dict[str, list[float]] = {n: [] for n in sides}
    backend = sides["edgekit"].backend
    timed = backend.decoder = TimedRuns(backend.decoder)  # the fused decoder's session (the cpu slot backend)
    in_loop: list[float] = []
    for rep in range(repeats):
        for name in list(sides) if rep % 2 == 0 else list(sides)[::-1]:
            timed.seconds = []
            tokens[name].append(token_ms(sides[name], ids))
            if name == "edgekit":  # the report's decode steps: its first run is the prompt's prefill
                in_loop.append(statistics.fmean(timed.seconds[1:]) * 1e3)
    backend.decoder = timed.session
    bare: dict[str, list[float]] = {n: [] for n in sides}
    for block in range(max(1, runs // BLOCK)):
        for name in list(sides) if block % 2 == 0 else list(sides)[::-1]:
            bare[name].append(statistics.fmean(bare_block(sides[name].graph, threads, kv_heads, head_dim)))
    out: dict = {"graphs": {n: str(s.graph) for n, s in sides.items()}}
    for name in sides:
        tok = statistics.median(tokens[name])
        graph = statistics.median(bare[name]) * 1e3
        out[name] = {"token_ms": tok, "graph_ms": graph, "loop_ms": tok - graph, "token_ms_runs": tokens[name]}
    out["edgekit"]["graph_in_loop_ms"] = statistics.median(in_loop)
    out["edgekit"]["engine_ms"] = out["edgekit"]["token_ms"] - out["edgekit"]["graph_in_loop_ms"]
    out["ratio"] = {k: out["edgekit"][k] / out["genai"][k] for k in ("token_ms", "graph_ms", "loop_ms")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=dvg.MODELS)
    ap.add_argument("--runs", type=int, default=1000, help=f"graph runs per side (blocks of {BLOCK})")
    ap.add_argument("--repeats", type=int, default=15, help="reports per side (token ms: the median of their means)")
    ap.add_argument("--work", type=Path, default=dvg.REPO / "out" / "decode_vs_genai")
    ap.add_argument("--json", type=Path, default=Path(__file__).with_suffix(".json"))
    args = ap.parse_args()
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    busy = dvg.busy_cores()
    chosen = [args.only] if args.only else list(dvg.MODELS)
    models = {m: split(m, args.work, dvg.THREADS, args.runs, args.repeats) for m in chosen}
    report = {
        "command": "python " + " ".join(sys.argv),
        "threads": dvg.THREADS,
        "past_positions": PAST,
        "busy_cores_at_start": busy,
        "versions": dvg.versions(),
        "models": models,
    }
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nbatch 1, {dvg.THREADS} threads, means (a report, a block) and their medians; ratio = edgekit / genai")
    print(f"{'model':<24} {'side':<8} {'token ms':>9} {'graph ms':>9} {'loop ms':>8}")
    for model, m in models.items():
        for side in ("edgekit", "genai"):
            s = m[side]
            print(f"{dvg.LABELS[model]:<24} {side:<8} {s['token_ms']:9.3f} {s['graph_ms']:9.3f} {s['loop_ms']:8.3f}")
        r = m["ratio"]
        print(f"{'':<24} {'ratio':<8} {r['token_ms']:9.2f} {r['graph_ms']:9.2f} {r['loop_ms']:8.2f}")
        e = m["edgekit"]
        print(
            f"{'':<24} edgekit's graph run inside its own loop {e['graph_in_loop_ms']:.3f} ms: the engine's own "
            f"{e['engine_ms'] * 1e3:.0f} us a token"
        )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
