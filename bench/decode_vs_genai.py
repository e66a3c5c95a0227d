"""edgekit's cpu decode speed against onnxruntime-genai's, on the same checkpoints, side by side in one run.

Checkpoints (Hugging Face directories, made here, nothing downloaded; cached under `--work`):
- `smollm`: a random-init LLaMA of SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads, 3 KV heads, head_dim 64,
  intermediate 1536, vocab 49152, rope_theta 100000, max_position_embeddings 8192, tied embeddings), made by
  transformers (`LlamaForCausalLM(LlamaConfig(...))`, torch seed 0, `save_pretrained(safe_serialization=True)`),
  with a byte-level BPE tokenizer of 49152 ids (SmolLM2's three special tokens at their ids, 256 byte symbols,
  48893 seeded merges of two symbols) and SmolLM2-Instruct's ChatML template;
- `radreport`: radreport-tiny's trained decoder and embeddings (the package's weights, untied LM head) written as
  a LlamaForCausalLM directory with its own tokenizer; its logits are checked against the package's PyTorch
  model (`models/radreport_tiny/modeling.py`) on the bench's prompt when the directory is made.
Each directory is built twice, as each tool's users build it: `python -m onnxruntime_genai.models.builder -i DIR
-p int4 -e cpu --extra_options block_size=B` (genai's int4 on cpu: symmetric RTN, int8 activations
(accuracy_level 4), a tied embedding shared with the LM head at int4), and `edgekit build DIR --target cpu
--recipe int4 --no-parity` (the parity figure needs PyTorch and does not change the graphs). `--block` (default
32) is the INT4 block of both: genai's `block_size`, and edgekit's `int4` recipe with its int4 passes' `block` set
to it (a copy written to the work folder; `--block 128` builds the bundled recipe as it ships). The recipe's
`keep = ["lm_head"]` (8 bits) applies where a checkpoint has an LM head of its own (radreport-tiny); the JSON
lists each decoder's MatMulNBits by bits, block and accuracy_level, and the MB/step columns what each streams.
genai loads the onnxruntime package's own library (`onnxruntime_genai/_dll_directory.py`): one ONNX Runtime
version on both sides, in the JSON.

Timing, 2 intra-op threads on both sides (genai_config.json's `session_options.intra_op_num_threads`, edgekit's
`RuntimeOptions(threads=2)`), a 32-token prompt (the same ids on both sides; row r of batch 8 is another 32 ids),
128 new tokens, greedy, no stopping early (edgekit `stop_token_ids=[]`, genai `min_length = max_length = 32 +
128`). Each token's time is stamped as it is chosen (genai: after each `generate_next_token()`; edgekit: the
engine's `on_token`). One definition for both:
- decode tok/s at batch 1 = tokens after the first / seconds after the first (edgekit: the engine's own
  `Timings.decode_tokens_per_s`, the figure `edgekit run --json` reports; the stamps give the same within noise);
- decode tok/s at batch B = B x steps / seconds of the stretch where all B rows decode together: from the moment
  every row has its first token (all prefills done) to the moment the first row has its last, counting every
  token chosen in between (genai prefills the batch in one call and finishes all rows together; so does edgekit's
  engine, whose prompts of one length and positions share a prefill call: `Engine._prefill_group`);
- prefill = from the prompt going in to the first token (batch B: to every row's first token), reported apart.
Each configuration runs once to warm up, then `--repeats` pairs (default 5, `--quick` 2), edgekit and genai back
to back, alternating which goes first (A B, then B A, ...); the table gives medians, and the ratio is the median
of each pair's edgekit / genai (drift between pairs cancels). The machine is shared: before each pair the bench
waits up to `--quiet` seconds for other processes' load to fall below 0.3 cores, and every run records that
load and the CPU it got (`cpu_per_wall`: 2.0 = both threads busy throughout); every repeat is in the JSON.
`--runs N` makes each side's turn in a pair N generations back to back, and the turn's figures their medians: a
radreport-tiny generation decodes for about 20 ms, so one run is at the mercy of a page fault or a scheduler tick
(single-run pairs scattered 0.58-1.13 on the 2-core host).
`--isolate` times each turn in a fresh process that loads its side alone and warms up there first: by default
both runtimes share the bench's process, and a run right after the other side's can meet its pool threads and
caches (a run after the portable decoder's ran up to 0.7x slower in bench/cpu_decode.py).

Memory-bandwidth limit: this machine's copy bandwidth, measured at the start and at the end of the run (the
higher counts: other processes only lower it): numpy `copyto` of a 512 MiB array, best of 5, counting bytes read
+ written (STREAM's copy convention). numpy copies on one thread, so it is measured with one thread and with two
threads each copying its own half (numpy lets go of the GIL while it copies); the higher is the limit.
Bytes one decode step reads = the decoder's streamed initializers (packed int4/int8 codes + scales + float
parameters; tables that are only indexed - an embedding used by a Gather alone, RoPE cos/sin caches - are not
counted; a tied embedding that is also the LM head is counted once, as the head) + each row's KV cache at that
step's length (the mean over the 127 decode steps). % of limit = steps/s x bytes per step / bandwidth, per side
with that side's own bytes. radreport-tiny's decoder is a few MB and stays in cache: its percentages are small by
construction.

    python bench/decode_vs_genai.py [--quick] [--only smollm|radreport] [--repeats N] [--block 32] [--quiet 20]
                                    [--runs N] [--isolate] [--work out/decode_vs_genai] [--rebuild]
                                    [--json bench/decode_vs_genai.json]

onnxruntime-genai is a bench-only dependency (`pip install 'edgekit[bench]'`), never a runtime one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from cpu_decode import SMOLLM2  # bench/ is on sys.path when a bench runs

REPO = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = 32
NEW_TOKENS = 128
THREADS = 2
BATCHES = (1, 8)
MODELS = ("smollm", "radreport")
LABELS = {"smollm": "SmolLM2-135M shape", "radreport": "radreport-tiny decoder"}
SMOLLM_SHAPE = SMOLLM2  # one definition of the shape, bench/cpu_decode.py's
SMOLLM_SPECIALS = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
CHATML = (  # SmolLM2-Instruct's template
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
RADREPORT_TEMPLATE = (  # its prompt format (generation_config.json): <bos> + the text + <sep>
    "{{ '<bos>' }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<sep>' }}{% endif %}"
)
PROMPT_TEXT = (  # encoded and cut to 32 tokens: the prompt's ids on both sides
    "CT chest with contrast. History: cough and fever for two weeks, former smoker. Compare with the prior study "
    "and describe the lungs, pleura, mediastinum, heart and the visible upper abdomen."
)
MAKER_VERSION = 1  # bump when a checkpoint maker changes: cached directories are made again


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------------------
# checkpoints
# ----------------------------------------------------------------------------------------------------------------
def _stamp_path(folder: Path) -> Path:
    """What made `folder` (kept beside it, not in it: a bundle lists its own files): reused when it matches."""
    return folder.with_name(folder.name + ".stamp.json")


def _stamp_ok(folder: Path, stamp: dict) -> bool:
    path = _stamp_path(folder)
    return folder.is_dir() and path.is_file() and json.loads(path.read_text()) == stamp


def _write_stamp(folder: Path, stamp: dict) -> None:
    _stamp_path(folder).write_text(json.dumps(stamp, indent=2))


def byte_level_bpe(vocab_size: int, specials: dict[str, int], seed: int = 0):
    """A GPT-2-style byte-level BPE of `vocab_size` ids: the special tokens at their ids, the 256 byte symbols,
    then merges of two byte symbols in a seeded order (as many as the vocabulary holds)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    vocab = dict(specials)
    free = (i for i in range(vocab_size) if i not in specials.values())
    for ch in alphabet:
        vocab[ch] = next(free)
    pairs = [(a, b) for a in alphabet for b in alphabet]
    rng = np.random.default_rng(seed)
    merges = []
    for k in rng.permutation(len(pairs)):
        if len(vocab) >= vocab_size:
            break
        a, b = pairs[k]
        merges.append((a, b))
        vocab[a + b] = next(free)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials))
    return tok


def _save_tokenizer(path: Path, tok, template: str, bos: str, eos: str, pad: str, unk: str | None = None) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad, unk_token=unk)
    fast.chat_template = template
    fast.model_max_length = 8192
    fast.save_pretrained(path)


def make_smollm(folder: Path) -> Path:
    stamp = {"maker": MAKER_VERSION, "model": "smollm", "shape": SMOLLM_SHAPE, "seed": 0}
    if _stamp_ok(folder, stamp):
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    say(f"checkpoint: random-init LLaMA of SmolLM2-135M's shape -> {folder}")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    ids = SMOLLM_SPECIALS
    config = LlamaConfig(
        **SMOLLM_SHAPE, bos_token_id=ids["<|im_start|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|im_end|>"]
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    tok = byte_level_bpe(SMOLLM_SHAPE["vocab_size"], SMOLLM_SPECIALS)
    _save_tokenizer(folder, tok, CHATML, "<|im_start|>", "<|im_end|>", "<|im_end|>")
    _write_stamp(folder, stamp)
    return folder


def radreport_config():
    from edgekit.build import default_model_dir
    from edgekit.export.default import load_model_config

    return default_model_dir(), load_model_config(default_model_dir() / "config.json")


def make_radreport(folder: Path) -> Path:
    """radreport-tiny's decoder + embeddings + LM head as a LlamaForCausalLM directory (the tensor names are the
    same: `edgekit/export/weights.py`), checked against the package's PyTorch model on the bench prompt."""
    from edgekit.bundle import sha256_file

    src, c = radreport_config()
    stamp = {"maker": MAKER_VERSION, "model": "radreport", "weights_sha256": sha256_file(src / "model.safetensors")}
    if _stamp_ok(folder, stamp):
        return folder
    import torch
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    say(f"checkpoint: radreport-tiny's decoder as a LlamaForCausalLM -> {folder}")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    gen = json.loads((src / "generation_config.json").read_text())
    config = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden,
        intermediate_size=c.intermediate,
        num_hidden_layers=c.layers,
        num_attention_heads=c.heads,
        num_key_value_heads=c.kv_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_positions,
        rope_theta=c.rope_theta,
        rms_norm_eps=c.rms_eps,
        tie_word_embeddings=False,
        bos_token_id=gen["bos_token_id"],
        eos_token_id=gen["eos_token_id"],
        pad_token_id=gen["pad_token_id"],
    )
    weights = load_file(src / "model.safetensors")
    state = {k: torch.from_numpy(v) for k, v in weights.items() if k.startswith("model.") or k == "lm_head.weight"}
    model = LlamaForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise SystemExit(f"radreport-tiny -> LLaMA: missing {missing}, unexpected {unexpected}")
    error = _radreport_parity(model, src, c)
    if error > 1e-4:
        raise SystemExit(f"radreport-tiny as LLaMA disagrees with its own PyTorch model: max |logits| error {error}")
    model.save_pretrained(folder, safe_serialization=True)
    _save_tokenizer(
        folder, Tokenizer.from_file(str(src / "tokenizer.json")), RADREPORT_TEMPLATE, "<bos>", "<eos>", "<pad>", "<unk>"
    )
    (folder / "bench_parity.json").write_text(json.dumps({"max_abs_logit_error_vs_package_model": error}))
    _write_stamp(folder, stamp)
    return folder


def _radreport_parity(llama, src: Path, c) -> float:
    """Max |logit| difference, LLaMA directory vs the package's own model, on the bench's 32-token prompt."""
    import torch

    from edgekit.export import load_weights
    from edgekit.models.radreport_tiny.modeling import RadReportTiny

    ref = RadReportTiny(c).eval()
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in load_weights(src / "model.safetensors").items()})
    ids = torch.from_numpy(prompt_ids(src / "tokenizer.json", 1))
    with torch.no_grad():
        logits_ref, _ = ref.decode(ref.model.embed_tokens(ids), torch.ones_like(ids), torch.arange(ids.shape[1])[None])
        logits = llama(input_ids=ids).logits
    return float((logits - logits_ref).abs().max())


def prompt_ids(tokenizer_json: Path, batch: int) -> np.ndarray:
    """(batch, 32) int64: id 1 (`<|im_start|>` / `<bos>` in both checkpoints), then the prompt text through the
    tokenizer, cut to 31 ids; row r starts r words later in the text (repeated), so the rows differ."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    words = PROMPT_TEXT.split()
    rows = []
    for r in range(batch):
        ids = tok.encode(" ".join((words * 4)[r : r + 3 * len(words)]), add_special_tokens=False).ids
        rows.append([1, *ids[: PROMPT_TOKENS - 1]])
    out = np.asarray(rows, np.int64)
    if out.shape != (batch, PROMPT_TOKENS):
        raise SystemExit(f"the prompt text gives {out.shape[1]} tokens, not {PROMPT_TOKENS}")
    return out


# ----------------------------------------------------------------------------------------------------------------
# builds
# ----------------------------------------------------------------------------------------------------------------
def _run(cmd: list[str], log: Path, env: dict | None = None) -> float:
    say("  $ " + " ".join(map(str, cmd)))
    t = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run(list(map(str, cmd)), stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    if proc.returncode != 0:
        lines = [line.strip() for line in log.read_text().splitlines() if line.strip()]
        raise BuildFailed(
            f"{Path(cmd[0]).name} exited {proc.returncode}: {lines[-1] if lines else ''} (log: {log})", log
        )
    return time.perf_counter() - t


class BuildFailed(RuntimeError):
    def __init__(self, message: str, log: Path):
        super().__init__(message)
        self.log = log


def build_genai(hf_dir: Path, out: Path, block: int, rebuild: bool) -> dict:
    stamp = {"source": _digest(hf_dir), "block": block, "genai": _version("onnxruntime_genai")}
    if not rebuild and _stamp_ok(out, stamp):
        return {"dir": str(out), "cached": True}
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "onnxruntime_genai.models.builder",
        "-i",
        hf_dir,
        "-o",
        out,
        "-p",
        "int4",
        "-e",
        "cpu",
        "-c",
        out.parent / (out.name + "-cache"),
        "--extra_options",
        f"block_size={block}",
    ]
    seconds = _run(cmd, out.parent / (out.name + ".log"), env)
    shutil.rmtree(out.parent / (out.name + "-cache"), ignore_errors=True)
    config_path = out / "genai_config.json"
    config = json.loads(config_path.read_text())
    so = config["model"]["decoder"].setdefault("session_options", {})
    so["intra_op_num_threads"] = THREADS
    config_path.write_text(json.dumps(config, indent=4))
    _write_stamp(out, stamp)
    return {"dir": str(out), "cached": False, "seconds": round(seconds, 1), "command": " ".join(map(str, cmd))}


def edgekit_recipe(work: Path, block: int) -> str:
    """The bundled `int4` recipe with its int4 passes at `block`: the name `int4` itself when that is the block it
    ships with, else a copy written to `work` (only the `block` lines of its int4 passes changed)."""
    from edgekit.plugins import get_model_family

    shipped = get_model_family().recipe_path("int4")
    text = shipped.read_text()
    parts = re.split(r"(?m)^(?=\[\[pass\]\])", text)
    new = "".join(re.sub(r"(?m)^block = \d+$", f"block = {block}", p) if 'name = "int4"' in p else p for p in parts)
    if new == text:
        return "int4"
    new = re.sub(r'(?m)^name = "int4"$', f'name = "int4-block{block}"', new, count=1)
    note = f"the bundled int4 recipe, its int4 passes at block {block} (bench/decode_vs_genai.py); it says: "
    new = re.sub(r'(?m)^description = "', f'description = "{note}', new, count=1)
    path = work / f"int4-block{block}.toml"
    path.write_text(new)
    return str(path)


def build_edgekit(hf_dir: Path, out: Path, recipe: str, rebuild: bool) -> dict:
    recipe_text = Path(recipe).read_text() if recipe.endswith(".toml") else recipe
    stamp = {"source": _digest(hf_dir), "recipe": recipe_text, "edgekit": _git_head()}
    if not rebuild and _stamp_ok(out, stamp):
        return {"dir": str(out), "cached": True}
    shutil.rmtree(out, ignore_errors=True)
    exe = Path(sys.executable).with_name("edgekit")
    cmd = [exe, "build", hf_dir, "--target", "cpu", "--recipe", recipe, "-o", out, "--force", "--no-parity"]
    seconds = _run(cmd, out.parent / (out.name + ".log"))
    _write_stamp(out, stamp)
    return {"dir": str(out), "cached": False, "seconds": round(seconds, 1), "command": " ".join(map(str, cmd))}


def _digest(folder: Path) -> str:
    """A checkpoint's identity for the builds' stamps: the stamp it was made with."""
    return _stamp_path(folder).read_text()


# ----------------------------------------------------------------------------------------------------------------
# bytes a decode step reads
# ----------------------------------------------------------------------------------------------------------------
ELEMENT_BYTES = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 16: 2, 21: 0.5, 22: 0.5}
INDEXED = {  # (op type, input index): a table the op reads a few rows of
    ("Gather", 0),
    ("GatherBlockQuantized", 0),
    ("GatherBlockQuantized", 2),
    ("GatherBlockQuantized", 3),
    ("RotaryEmbedding", 2),
    ("RotaryEmbedding", 3),
    ("GroupQueryAttention", 7),
    ("GroupQueryAttention", 8),
}


def streamed_bytes(graph: Path, hf_dir: Path) -> dict:
    """What one decode step of `graph` reads of its initializers, by kind, and the KV cache's bytes per token and
    row (the checkpoint's layers x KV heads x head_dim, key and value, in the graph's cache dtype)."""
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    g = model.graph
    consumers: dict[str, list[tuple[str, int, dict]]] = {}
    for node in g.node:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        for i, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node.op_type, i, attrs))
    kinds = {"packed_codes": 0, "scales_zero_points": 0, "float_params": 0, "indexed_not_counted": 0}
    for t in g.initializer:
        n = int(np.prod(t.dims, dtype=np.int64)) * ELEMENT_BYTES.get(t.data_type, 4)
        uses = consumers.get(t.name, [])
        if uses and all((op, i) in INDEXED for op, i, _ in uses):
            kinds["indexed_not_counted"] += n
        elif any(op == "MatMulNBits" and i == 1 for op, i, _ in uses):
            kinds["packed_codes"] += n
        elif any(op in ("MatMulNBits", "GatherBlockQuantized") and i in (2, 3) for op, i, _ in uses):
            kinds["scales_zero_points"] += n
        else:
            kinds["float_params"] += n
    nbits = [
        (attrs.get("bits", 4), attrs.get("block_size"), attrs.get("accuracy_level", 0))
        for node in g.node
        if node.op_type == "MatMulNBits"
        for attrs in [{a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}]
    ]
    cfg = json.loads((hf_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    past = [i for i in g.input if i.name.startswith("past_key_values")]
    if not past:
        raise RuntimeError(f"{graph} has no past_key_values inputs")
    dtype = ELEMENT_BYTES[past[0].type.tensor_type.elem_type]
    kv = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * dtype
    counted = kinds["packed_codes"] + kinds["scales_zero_points"] + kinds["float_params"]
    return {
        "graph": str(graph),
        "weight_bytes_per_step": counted,
        **kinds,
        "kv_bytes_per_token_per_row": kv,
        "matmulnbits": {f"bits={b} block={bl} accuracy_level={a}": nbits.count((b, bl, a)) for b, bl, a in set(nbits)},
        "ops": _op_counts(g),
    }


def _op_counts(g) -> dict:
    counts: dict[str, int] = {}
    for node in g.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def copy_bandwidth(mib: int = 512, tries: int = 5) -> dict:
    """Bytes read + written per second by numpy copies of `mib` MiB: one thread, and two threads on halves."""
    n = mib * 2**20 // 8
    src = np.ones(n, np.float64)
    dst = np.zeros(n, np.float64)
    np.copyto(dst, src)

    def one() -> float:
        t = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - t

    def two() -> float:
        half = n // 2
        threads = [threading.Thread(target=np.copyto, args=(dst[a : a + half], src[a : a + half])) for a in (0, half)]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return time.perf_counter() - t

    moved = 2 * n * 8
    one_t = [one() for _ in range(tries)]
    two_t = [two() for _ in range(tries)]
    out = {
        "array_mib": mib,
        "tries": tries,
        "one_thread_gb_s": moved / min(one_t) / 1e9,
        "two_threads_gb_s": moved / min(two_t) / 1e9,
        "seconds_one_thread": [round(t, 4) for t in one_t],
        "seconds_two_threads": [round(t, 4) for t in two_t],
    }
    out["limit_gb_s"] = max(out["one_thread_gb_s"], out["two_threads_gb_s"])
    out["source"] = (
        "numpy copyto of a 512 MiB float64 array, best of 5, bytes read + written (STREAM copy); one thread, and "
        "two threads each copying its own half; the limit is the higher"
    )
    return out


def bandwidth_share(tok_s: float, batch: int, side_bytes: dict, bandwidth_gb_s: float) -> dict:
    lengths = [PROMPT_TOKENS + i for i in range(1, NEW_TOKENS)]  # the cache each decode step reads (with its token)
    kv = batch * side_bytes["kv_bytes_per_token_per_row"] * float(np.mean(lengths))
    per_step = side_bytes["weight_bytes_per_step"] + kv
    steps = tok_s / batch
    return {"bytes_per_step": per_step, "kv_bytes_per_step": kv, "pct": 100 * steps * per_step / (bandwidth_gb_s * 1e9)}


# ----------------------------------------------------------------------------------------------------------------
# the two sides
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Run:
    """One generation of `batch` rows: each token's time, per row, from the prompt going in (seconds)."""

    stamps: list[list[float]]
    first_tokens: list[list[int]] = field(default_factory=list)
    engine_tok_s: float | None = None  # edgekit's Timings.decode_tokens_per_s (batch 1)
    cpu_per_wall: float = 0.0  # this process's CPU seconds per wall second over the run (2.0: both threads busy)

    def figures(self) -> dict:
        rows = len(self.stamps)
        if any(len(s) != NEW_TOKENS for s in self.stamps):
            raise RuntimeError(f"expected {NEW_TOKENS} tokens per row, got {[len(s) for s in self.stamps]}")
        t_all_first = max(s[0] for s in self.stamps)
        t_first_done = min(s[-1] for s in self.stamps)
        inside = sum(1 for s in self.stamps for t in s if t_all_first < t <= t_first_done)
        tok_s = inside / (t_first_done - t_all_first)
        out = {
            "decode_tok_s": tok_s,
            "cpu_per_wall": round(self.cpu_per_wall, 2),
            "window_tokens": inside,
            "window_s": t_first_done - t_all_first,
            "prefill_ms": t_all_first * 1e3,
            "total_s": max(s[-1] for s in self.stamps),
        }
        if rows == 1 and self.engine_tok_s is not None:
            out["stamped_decode_tok_s"] = tok_s
            out["decode_tok_s"] = self.engine_tok_s
        return out


class GenaiSide:
    name = "genai"

    def __init__(self, model_dir: Path):
        import onnxruntime_genai as og

        self.og = og
        self.dir = model_dir
        config = og.Config(str(model_dir))
        self.model = og.Model(config)
        cfg = json.loads((model_dir / "genai_config.json").read_text())
        self.graph = model_dir / cfg["model"]["decoder"]["filename"]
        self.session_options = cfg["model"]["decoder"].get("session_options", {})

    def run(self, ids: np.ndarray) -> Run:
        og = self.og
        batch = ids.shape[0]
        params = og.GeneratorParams(self.model)
        total = PROMPT_TOKENS + NEW_TOKENS
        params.set_search_options(max_length=total, min_length=total, do_sample=False, batch_size=batch)
        gen = og.Generator(self.model, params)
        stamps: list[float] = []
        t0 = time.perf_counter()
        gen.append_tokens(ids.astype(np.int32))
        while not gen.is_done():
            gen.generate_next_token()
            stamps.append(time.perf_counter() - t0)
        seqs = [list(map(int, gen.get_sequence(r)))[PROMPT_TOKENS:] for r in range(batch)]
        return Run([list(stamps) for _ in range(batch)], [s[:8] for s in seqs])

    def tokenizer_check(self, ids_text: str, expect: list[int]) -> dict:
        """genai's own tokenizer on the prompt text against the `tokenizers` ids (is the tokenizer real to it?)."""
        try:
            tok = self.og.Tokenizer(self.model)
            got = list(map(int, tok.encode(ids_text)))
        except Exception as exc:  # noqa: BLE001 - reported, not fatal: timing feeds ids
            return {"loaded": False, "error": f"{type(exc).__name__}: {exc}"}
        return {"loaded": True, "same_ids_as_tokenizers": got == expect, "n": len(got)}


class EdgekitSide:
    name = "edgekit"

    def __init__(self, bundle_dir: Path):
        from edgekit import names
        from edgekit.bundle import load_bundle
        from edgekit.plugins import load_backend
        from edgekit.positions import PositionScheme
        from edgekit.target import RuntimeOptions

        self.bundle = load_bundle(bundle_dir)
        self.backend = load_backend(self.bundle, RuntimeOptions(threads=THREADS))
        config_path = self.bundle.component("model_config")
        self.positions = PositionScheme.of(json.loads(config_path.read_text()), config_path)
        # the decoder graph the run side serves (the cpu target's fused one, or the portable one), for its bytes
        served = getattr(self.backend, "_decoder_path", None)
        self.graph = Path(served) if served is not None else self.bundle.component(names.DECODER_ROLE)
        self.session_options = {
            "threads": THREADS,
            "backend": type(self.backend).__name__,
            "bundle_runtime": dict(self.bundle.manifest.runtime or {}),
        }

    def run(self, ids: np.ndarray) -> Run:
        from edgekit.engine import Engine, Request
        from edgekit.generate import GenerationOptions

        batch = ids.shape[0]
        engine = Engine(self.backend, positions=self.positions, max_batch=batch)
        stamps: list[list[float]] = [[] for _ in range(batch)]

        def stamp(row: int):
            return lambda _token, _index: stamps[row].append(time.perf_counter() - t0)

        options = GenerationOptions(max_new_tokens=NEW_TOKENS, stop_token_ids=[])
        requests = [Request(ids[r], options, on_token=stamp(r)) for r in range(batch)]
        t0 = time.perf_counter()
        tickets = [engine.submit(r) for r in requests]
        engine.run()
        results = [t.result() for t in tickets]
        engine.close()
        run = Run(stamps, [r.token_ids[:8] for r in results])
        if batch == 1:
            run.engine_tok_s = results[0].timings.decode_tokens_per_s
        return run


# ----------------------------------------------------------------------------------------------------------------
def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module.replace("_", "-"))
    except Exception:  # noqa: BLE001
        return None


def _git_head() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        return head
    except OSError:
        return "unknown"


def machine() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu,
        "memory_bytes": mem,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def versions() -> dict:
    import onnxruntime

    out = {
        "onnxruntime": onnxruntime.__version__,
        "onnxruntime_genai": _version("onnxruntime_genai"),
        "transformers": _version("transformers"),
        "torch": _version("torch"),
        "tokenizers": _version("tokenizers"),
        "numpy": np.__version__,
        "edgekit_commit": _git_head(),
    }
    # genai loads the onnxruntime package's own C library (onnxruntime_genai/_dll_directory.py): the same version
    lib = os.environ.get("ORT_LIB_PATH")
    out["onnxruntime_library_genai_loaded"] = lib
    return out


def busy_cores(interval: float = 0.5) -> float:
    """Cores the machine kept busy over `interval` (all processes; this one is idle while it waits)."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    try:
        t0, i0 = sample()
        time.sleep(interval)
        t1, i1 = sample()
    except OSError:
        return 0.0
    cores = os.cpu_count() or 1
    return cores * (1 - (i1 - i0) / max(1, t1 - t0))


def wait_quiet(limit_s: float) -> float:
    """Wait up to `limit_s` for the machine's other load to fall below 0.3 cores (a shared machine: builds and
    tests of others come and go); the load seen last, so each run records what it ran beside."""
    deadline = time.monotonic() + limit_s
    busy = busy_cores()
    while busy > 0.3 and time.monotonic() < deadline:
        time.sleep(1.0)
        busy = busy_cores()
    return round(busy, 2)


def timed(side, ids: np.ndarray, busy: float, runs: int = 1) -> dict:
    """`runs` generations back to back; each figure is the median over them (the JSON keeps every run's decode
    tok/s). One radreport-tiny generation decodes for about 20 ms: a single run is at the mercy of one page
    fault or one scheduler tick, and pairs of single runs scattered 0.58-1.13 on the 2-core host."""
    figures = []
    for _ in range(runs):
        c0, w0 = os.times(), time.perf_counter()
        run = side.run(ids)
        c1, w1 = os.times(), time.perf_counter()
        run.cpu_per_wall = (c1.user + c1.system - c0.user - c0.system) / (w1 - w0)
        figures.append(run.figures())
    out = {k: float(np.median([f[k] for f in figures])) for k in figures[0]}
    out["cpu_per_wall"] = round(out["cpu_per_wall"], 2)
    out["runs_decode_tok_s"] = [round(f["decode_tok_s"], 1) for f in figures]
    return {**out, "others_busy_cores_before": busy, "first_tokens": run.first_tokens}


SIDES = {"edgekit": EdgekitSide, "genai": GenaiSide}


def timed_alone(name: str, model_dir: Path, hf_dir: Path, batch: int, busy: float, runs: int) -> dict:
    """`timed` in a fresh process that loads this side alone (`--isolate`): no other runtime's sessions beside it,
    and none of the previous run's state. It warms up once, then times `runs` runs."""
    args = [sys.executable, __file__, "--child", name, str(model_dir), str(hf_dir), str(batch), str(busy), str(runs)]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:  # the child's last words, not a bare CalledProcessError
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        raise RuntimeError(f"{name}'s run alone exited {proc.returncode}: {lines[-1] if lines else ''}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def child(name: str, model_dir: str, hf_dir: str, batch: str, busy: str, runs: str) -> None:
    side = SIDES[name](Path(model_dir))
    ids = prompt_ids(Path(hf_dir) / "tokenizer.json", int(batch))
    side.run(ids)  # warm-up, unmeasured
    print(json.dumps(timed(side, ids, float(busy), int(runs))))


def measure(
    model: str,
    sides: dict,
    ids_by_batch: dict,
    repeats: int,
    quiet_s: float,
    alone: dict | None = None,
    per_repeat: int = 1,
) -> dict:
    """`alone` (side -> its model directory, and "hf" -> the checkpoint): each timed repeat in a process of its own.
    `per_repeat`: generations per side in a repeat, whose medians are the repeat's figures."""
    out: dict = {}
    for batch in BATCHES:
        ids = ids_by_batch[batch]
        if alone is None:
            for side in sides.values():  # warm-up, unmeasured
                side.run(ids)
        runs: dict[str, list[dict]] = {name: [] for name in sides}
        for rep in range(repeats):
            order = list(sides) if rep % 2 == 0 else list(sides)[::-1]
            busy = wait_quiet(quiet_s)  # once per pair: the two runs of a pair follow each other
            for name in order:
                if alone is None:
                    runs[name].append(timed(sides[name], ids, busy, per_repeat))
                else:
                    runs[name].append(timed_alone(name, alone[name], alone["hf"], batch, busy, per_repeat))
            line = "  ".join(
                f"{n} {runs[n][-1]['decode_tok_s']:8.1f} ({runs[n][-1]['cpu_per_wall']:.1f} cores)" for n in sides
            )
            say(f"  {LABELS[model]} batch {batch} repeat {rep + 1}/{repeats}: {line} tok/s")
        med = {
            name: {k: float(np.median([r[k] for r in rs])) for k in ("decode_tok_s", "prefill_ms", "cpu_per_wall")}
            for name, rs in runs.items()
        }
        first = {name: rs[-1].pop("first_tokens") for name, rs in runs.items()}
        for rs in runs.values():
            for r in rs:
                r.pop("first_tokens", None)
        row = {"median": med, "repeats": runs, "first_tokens": first}
        if "edgekit" in runs:  # each pair's edgekit / genai, then their median: drift between pairs cancels
            pairs = [e["decode_tok_s"] / g["decode_tok_s"] for e, g in zip(runs["edgekit"], runs["genai"])]
            row["ratio_per_pair"] = [round(r, 4) for r in pairs]
            row["ratio"] = float(np.median(pairs))
            row["ratio_of_medians"] = med["edgekit"]["decode_tok_s"] / med["genai"]["decode_tok_s"]
        if len(first) == 2:
            row["same_first_tokens_per_row"] = [a == b for a, b in zip(first["edgekit"], first["genai"])]
        out[f"batch{batch}"] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 repeats instead of 5")
    ap.add_argument("--repeats", type=int, help="measured runs per side and batch (default 5, --quick 2)")
    ap.add_argument("--only", choices=MODELS, help="one checkpoint")
    ap.add_argument("--block", type=int, default=32, help="INT4 block of both sides (default 32)")
    ap.add_argument("--work", type=Path, default=REPO / "out" / "decode_vs_genai", help="checkpoints and builds")
    ap.add_argument("--rebuild", action="store_true", help="build both sides again even when cached")
    ap.add_argument("--json", type=Path, default=Path(__file__).with_suffix(".json"))
    ap.add_argument(
        "--quiet",
        type=float,
        default=20.0,
        help="seconds to wait before each run for other processes' load to fall below 0.3 cores (default 20)",
    )
    ap.add_argument(
        "--isolate",
        action="store_true",
        help="time each run in a fresh process that loads its side alone (no other runtime beside it)",
    )
    ap.add_argument(
        "--runs",
        type=int,
        default=1,
        help="generations per side in each repeat, back to back; the repeat's figures are their medians (default 1)",
    )
    ap.add_argument("--child", nargs=6, help=argparse.SUPPRESS)  # one run of one side, for --isolate
    args = ap.parse_args()
    if args.runs < 1:
        ap.error(f"--runs must be >= 1, got {args.runs}")
    if args.child:
        return child(*args.child)
    repeats = args.repeats or (2 if args.quick else 5)
    models = [args.only] if args.only else list(MODELS)
    args.work = args.work.resolve()  # the builds run with the repository as their working directory
    args.work.mkdir(parents=True, exist_ok=True)

    import onnxruntime_genai  # noqa: F401 - fails here, with pip's hint below, when the bench extra is missing

    wait_quiet(args.quiet)
    bandwidth = {"start": copy_bandwidth()}
    recipe = edgekit_recipe(args.work, args.block)
    results: dict = {}
    for model in models:
        say(f"{LABELS[model]}:")
        hf_dir = (make_smollm if model == "smollm" else make_radreport)(args.work / "hf" / model)
        entry: dict = {"hf_dir": str(hf_dir), "builds": {}, "errors": {}}
        parity = hf_dir / "bench_parity.json"
        if parity.is_file():
            entry["checkpoint_parity"] = json.loads(parity.read_text())
        sides: dict = {}
        try:
            entry["builds"]["edgekit"] = build_edgekit(hf_dir, args.work / f"edgekit-{model}", recipe, args.rebuild)
            sides["edgekit"] = EdgekitSide(Path(entry["builds"]["edgekit"]["dir"]))
        except Exception as exc:  # noqa: BLE001 - the genai half still runs; the table says why edgekit did not
            entry["errors"]["edgekit"] = f"{type(exc).__name__}: {exc}"
            say(f"  edgekit side unavailable: {entry['errors']['edgekit']}")
        entry["builds"]["genai"] = build_genai(hf_dir, args.work / f"genai-{model}", args.block, args.rebuild)
        sides["genai"] = GenaiSide(Path(entry["builds"]["genai"]["dir"]))
        ids = {b: prompt_ids(hf_dir / "tokenizer.json", b) for b in BATCHES}
        entry["prompt_ids_row0"] = ids[1][0].tolist()
        from tokenizers import Tokenizer

        text = Tokenizer.from_file(str(hf_dir / "tokenizer.json")).decode(ids[1][0, 1:].tolist())
        expect = Tokenizer.from_file(str(hf_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids
        entry["genai_tokenizer"] = sides["genai"].tokenizer_check(text, expect)
        entry["bytes"] = {name: streamed_bytes(side.graph, hf_dir) for name, side in sides.items()}
        entry["session_options"] = {name: side.session_options for name, side in sides.items()}
        alone = {name: Path(entry["builds"][name]["dir"]) for name in sides} if args.isolate else None
        if alone is not None:
            alone["hf"] = hf_dir
        entry.update(measure(model, sides, ids, repeats, args.quiet, alone, args.runs))
        results[model] = entry
        del sides

    wait_quiet(args.quiet)
    bandwidth["end"] = copy_bandwidth()
    bandwidth["limit_gb_s"] = max(bandwidth["start"]["limit_gb_s"], bandwidth["end"]["limit_gb_s"])
    bandwidth["source"] = bandwidth["start"].pop("source") + "; measured at the start and at the end, the higher"
    bandwidth["end"].pop("source")
    say(f"copy bandwidth: {bandwidth['limit_gb_s']:.1f} GB/s")
    for entry in results.values():
        for b in BATCHES:
            share = entry[f"batch{b}"]["bandwidth"] = {}
            for name, med in entry[f"batch{b}"]["median"].items():
                share[name] = bandwidth_share(med["decode_tok_s"], b, entry["bytes"][name], bandwidth["limit_gb_s"])

    report = {
        "command": "python " + " ".join(sys.argv),
        "settings": {
            "threads": THREADS,
            "prompt_tokens": PROMPT_TOKENS,
            "new_tokens": NEW_TOKENS,
            "greedy": True,
            "batches": list(BATCHES),
            "block": args.block,
            "repeats": repeats,
            "runs_per_repeat": args.runs,
            "edgekit_recipe": recipe if not recipe.endswith(".toml") else Path(recipe).read_text(),
            "order": "warm-up run per side and batch, then repeats alternating edgekit/genai (A B, B A, ...)"
            + (
                "; each run in a fresh process loading its side alone, after a warm-up run there"
                if args.isolate
                else ""
            ),
            "decode_definition": (
                "B x steps / seconds while all B rows decode together (from every row's first token to the first "
                "row's last); batch 1: tokens after the first / seconds after the first (edgekit: the engine's "
                "Timings.decode_tokens_per_s, what `edgekit run --json` reports)"
            ),
        },
        "versions": versions(),
        "machine": machine(),
        "bandwidth": bandwidth,
        "models": results,
    }
    args.json.write_text(json.dumps(report, indent=2))
    print_table(report)
    print(f"wrote {args.json}")


def print_table(report: dict) -> None:
    bw = report["bandwidth"]["limit_gb_s"]
    print(
        f"\ncpu decode, {report['settings']['threads']} threads, INT4 block {report['settings']['block']}, "
        f"{PROMPT_TOKENS}-token prompt, {NEW_TOKENS} new tokens, greedy; medians of {report['settings']['repeats']}; "
        f"batch 8 = total over rows; % = share of the {bw:.1f} GB/s copy bandwidth"
    )
    head = f"{'model':<24} {'batch':>5} {'genai tok/s':>12} {'edgekit tok/s':>14} {'ratio':>6} {'genai %bw':>10} "
    head += f"{'edgekit %bw':>12} {'genai MB/step':>14} {'edgekit MB/step':>16}"
    print(head)
    for model, entry in report["models"].items():
        for b in BATCHES:
            row = entry[f"batch{b}"]
            med, share = row["median"], row["bandwidth"]
            g = med["genai"]["decode_tok_s"]
            e = med.get("edgekit", {}).get("decode_tok_s")
            cells = [
                f"{LABELS[model]:<24} {b:>5} {g:12.1f}",
                f"{e:14.1f} {row['ratio']:6.2f}" if e else f"{'n/a':>14} {'':>6}",
                f"{share['genai']['pct']:9.1f}%",
                f"{share['edgekit']['pct']:11.1f}%" if e else f"{'n/a':>12}",
                f"{share['genai']['bytes_per_step'] / 1e6:14.1f}",
                f"{share['edgekit']['bytes_per_step'] / 1e6:16.1f}" if e else f"{'n/a':>16}",
            ]
            print(" ".join(cells))
        for name, error in entry["errors"].items():
            print(f"  {name} not measured: {error.splitlines()[0][:200]}")
    print("\nprefill ms (32 tokens; batch 8: until every row has its first token):")
    for model, entry in report["models"].items():
        for b in BATCHES:
            med = entry[f"batch{b}"]["median"]
            parts = "  ".join(f"{n} {v['prefill_ms']:.1f}" for n, v in med.items())
            print(f"  {LABELS[model]:<24} batch {b}: {parts}")


if __name__ == "__main__":
    main()
