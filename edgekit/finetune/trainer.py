"""LoRA fine-tuning of a Hugging Face decoder or VLM, with learned head gates: `edgekit finetune`.

Why both in one step: the X1's dynamic head skipping (DSS) is cheap only on a model that has learned to do
without some heads. The gates (`edgekit.finetune.gates`) are learned with a LoRA adapter that gives the model the
capacity to move the closed heads' work elsewhere; the base weights stay frozen, as in any PEFT fine-tune.

What it writes is a PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`) that PEFT itself
loads, plus `head_gates.json` (the gates in the `head_importance.json` schema) and `finetune.json` (recipe,
losses, held-out figures before and after). The `lora` pass merges the adapter and folds the gates without
torch; the bundle it builds ships the gates as the head importance DSS reads.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgekit import names
from edgekit.errors import ConfigError

from .data import IGNORE, Dataset, Tokenization, load_grey, read_dataset

METHOD = "learned sigmoid head gates with a LoRA adapter (L1 penalty, the lowest closed to 0 during training)"


@dataclass
class FinetuneOptions:
    steps: int = 200
    batch_size: int = 8
    lr: float = 2e-3  # LoRA matrices
    gate_lr: float = 0.05  # gate logits: they start at 2.0 (g = 0.88) and must cross the others within the run
    r: int = 16
    alpha: float = 32.0
    target_modules: str = ""  # PEFT regex; empty: every q/k/v/o and gate/up/down projection of the decoder
    gate_rate: float = 0.375  # fraction of decoder heads closed (0: a plain LoRA fine-tune)
    gate_weight: float = 0.05  # weight of the L1 penalty on the open gates
    gate_start: float = 0.4  # heads are closed between these fractions of training
    gate_end: float = 0.6
    max_length: int = 256
    seed: int = 0
    threads: int = 0  # torch intra-op threads (0: torch's default)

    def validate(self) -> None:
        checks = {
            "steps": self.steps >= 1,
            "batch_size": self.batch_size >= 1,
            "lr": self.lr > 0,
            "gate_lr": self.gate_lr > 0,
            "r": self.r >= 1,
            "gate_rate": 0.0 <= self.gate_rate < 1.0,
            "gate_weight": self.gate_weight >= 0,
            "gate_start": 0.0 <= self.gate_start <= self.gate_end <= 1.0,
            "max_length": self.max_length >= 2,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ConfigError(
                f"fine-tuning option(s) out of range: {', '.join(f'{k}={getattr(self, k)}' for k in bad)}"
            )


def load_model(model_dir: Path):
    """The model (float32, train mode off), its kind, its tokenization and (VLMs) its spec."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    from edgekit.hf import is_hf_model_dir, read_hf_config
    from edgekit.hf.config import model_kind

    if not is_hf_model_dir(model_dir):
        raise ConfigError(
            "not a Hugging Face model directory (config.json has no model_type); the embedded radreport-tiny learns "
            "its head gates in its own recipe (python -m edgekit.models.radreport_tiny.train)",
            model_dir,
        )
    cfg = read_hf_config(model_dir)
    kind = model_kind(cfg, model_dir)
    if kind == "vision":
        raise ConfigError("a vision tower alone has no decoder heads to fine-tune", model_dir / "config.json")
    tok_path = model_dir / "tokenizer.json"
    if not tok_path.is_file():
        raise ConfigError("fine-tuning needs the model's tokenizer.json", model_dir)
    tokenizer = Tokenizer.from_file(str(tok_path))
    spec = None
    auto: type[transformers.AutoModelForImageTextToText] | type[transformers.AutoModelForCausalLM]
    if kind == "vlm":
        from edgekit.hf import SafetensorsCheckpoint
        from edgekit.hf.vlm import vlm_spec

        spec = vlm_spec(cfg, model_dir, SafetensorsCheckpoint(model_dir).entries)
        auto = transformers.AutoModelForImageTextToText
    else:
        auto = transformers.AutoModelForCausalLM
    model = auto.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = _eos_id(model_dir, tokenizer, model.config)
    if spec is None:
        return model, kind, Tokenization(tokenizer, eos), None
    from edgekit.hf.serving import generation_config

    return (
        model,
        kind,
        Tokenization(tokenizer, eos, tuple(spec.span_ids), generation_config(spec, model_dir, tokenizer)),
        spec,
    )


def _eos_id(model_dir: Path, tokenizer, config) -> int | None:
    """The end token as a bundle of the model stops at (`edgekit.hf.serving.eos_token_id`), else the (text)
    config's `eos_token_id`, where a bare decoder may name it only."""
    from edgekit.hf.config import language_model_config
    from edgekit.hf.serving import eos_token_id

    eos = eos_token_id(model_dir, tokenizer)
    cfg = config.to_dict()
    for c in (cfg, language_model_config(cfg)):  # the top level, then a VLM's language model
        if eos is not None:
            break
        e = c.get("eos_token_id")
        eos = (e[0] if e else None) if isinstance(e, list) else e if isinstance(e, int) else None
    return eos


def _collate(examples, spec, pad_id: int):
    import torch

    from edgekit.hf.parity import hf_image_inputs, hf_token_inputs

    n = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), n), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), n), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), n), dtype=torch.long)
    for i, e in enumerate(examples):
        ids[i, : len(e.input_ids)] = torch.tensor(e.input_ids)
        labels[i, : len(e.labels)] = torch.tensor(e.labels)
        mask[i, : len(e.input_ids)] = 1
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels, **hf_token_inputs(spec, ids)}
    images = [hf_image_inputs(spec, load_grey(e.image, spec.image_size)) for e in examples if e.image]
    for key in images[0] if images else ():  # pixel_values, and llava_next's image_sizes
        batch[key] = torch.cat([im[key] for im in images], dim=0)
    return batch


def evaluate(model, data: Dataset, spec, pad_id: int, batch_size: int) -> dict:
    """Mean loss and next-token accuracy over the learned tokens of `data` (teacher forcing)."""
    import torch

    total_loss, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for s in range(0, len(data), batch_size):
            batch = _collate(data.examples[s : s + batch_size], spec, pad_id)
            labels = batch.pop("labels")
            logits = model(**batch).logits[:, :-1].float()
            target = labels[:, 1:]
            keep = target != IGNORE
            loss = torch.nn.functional.cross_entropy(logits[keep], target[keep], reduction="sum")
            total_loss += float(loss)
            correct += int((logits.argmax(-1)[keep] == target[keep]).sum())
            count += int(keep.sum())
    return {"loss": round(total_loss / count, 5), "token_accuracy": round(correct / count, 5), "tokens": count}


def finetune(
    model_dir: str | Path,
    data: str | Path,
    out: str | Path,
    opts: FinetuneOptions | None = None,
    *,
    eval_data: str | Path | None = None,
    progress: Callable[[int, int, float], None] | None = None,
) -> dict:
    """Fine-tune `model_dir` on `data` (JSONL); write the adapter, gates and result to `out`; return the result."""
    import peft  # noqa: F401  (the train extra: missing, it fails here, before any check or work)
    import torch

    from .hf_gates import find_decoder_attention

    opts = opts or FinetuneOptions()
    opts.validate()
    model_dir, out = Path(model_dir), Path(out)
    _check_paths(out, data, eval_data)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    model, kind, tok, spec = load_model(model_dir)
    train = read_dataset(data, tok, opts.max_length, vlm=kind == "vlm")
    held = read_dataset(eval_data, tok, opts.max_length, vlm=kind == "vlm") if eval_data else None
    pad_id = tok.eos_id if tok.eos_id is not None else 0
    attention = find_decoder_attention(model)
    before = evaluate(model, held, spec, pad_id, opts.batch_size) if held else None

    run = _Training.setup(model, attention, opts)
    losses, closed_at, seconds = _train(run, train, spec, pad_id, opts, progress)
    out.mkdir(parents=True, exist_ok=True)
    run.peft_model.save_pretrained(str(out))
    after = run.evaluate(held, spec, pad_id, opts.batch_size) if held else None
    result = _result(model_dir, kind, train, held, opts, run, losses, seconds, before, after)
    if run.gates is not None:
        source = f"edgekit finetune of {model_dir.name}, {opts.steps} steps on {train.path.name}"
        result["gates"] = _write_gates(out, run, source, closed_at)
    (out / "finetune.json").write_text(json.dumps(result, indent=2) + "\n")
    if not math.isfinite(losses[-1]):
        raise ConfigError("training diverged (loss is not finite); lower --lr", out / "finetune.json")
    return result


def _check_paths(out: Path, data: str | Path, eval_data: str | Path | None) -> None:
    """An empty (or new) output folder and data files that exist, checked before the model loads (minutes)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError("output exists and is not an empty folder; refusing to overwrite", out)
    for path in (data, eval_data):
        if path is not None and not Path(path).is_file():
            raise ConfigError("fine-tuning data not found", path)


@dataclass
class _Training:
    """The model with its LoRA adapter (PEFT's wrappers, in place), its head gates and the optimiser of both."""

    model: Any
    peft_model: Any
    attention: Any  # hf_gates' decoder attention: its modules, heads and head_dim
    gates: Any  # gates.HeadGates, or None for a plain LoRA fine-tune
    groups: list[dict]
    optim: Any
    sched: Any

    @classmethod
    def setup(cls, model, attention, opts: FinetuneOptions) -> _Training:
        import peft
        import torch

        from .gates import HeadGates

        torch.manual_seed(opts.seed)
        targets = opts.target_modules or (
            re.escape(attention.prefix) + r"layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
        )
        # peft annotates lora_alpha as int, but scales by lora_alpha / r and takes a float (alpha = 2r from the CLI)
        lcfg = peft.LoraConfig(
            r=opts.r,
            lora_alpha=opts.alpha,  # type: ignore[arg-type]
            target_modules=targets,
            lora_dropout=0.0,
        )
        pm = peft.get_peft_model(model, lcfg)  # in place: `model`'s modules are now PEFT's wrappers
        gates = HeadGates(len(attention.modules), attention.heads) if opts.gate_rate > 0 else None
        groups = [{"params": [p for p in model.parameters() if p.requires_grad], "lr": opts.lr}]
        if gates is not None:
            groups.append({"params": [gates.logits], "lr": opts.gate_lr})
        optim = torch.optim.AdamW(groups, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 - s / opts.steps)
        return cls(model, pm, attention, gates, groups, optim, sched)

    @property
    def heads_total(self) -> int:
        return len(self.attention.modules) * self.attention.heads

    def step(self, batch: dict, gate_weight: float):
        """One optimiser step on `batch`; returns the language-model loss (without the gates' penalty)."""
        from .hf_gates import gates_applied

        model, gates = self.model, self.gates
        if gates is not None:
            with gates_applied(model, self.attention, gates):
                lm = model(**batch).loss
            loss = lm + gate_weight * gates.penalty()
        else:
            lm = loss = model(**batch).loss
        self.optim.zero_grad(set_to_none=True)
        loss.backward()
        self.optim.step()
        self.sched.step()
        return lm

    def evaluate(self, held: Dataset, spec, pad_id: int, batch_size: int) -> dict:
        """`evaluate` on the model as trained: with its gates applied when it has them."""
        from .hf_gates import gates_applied

        if self.gates is None:
            return evaluate(self.model, held, spec, pad_id, batch_size)
        with gates_applied(self.model, self.attention, self.gates):
            return evaluate(self.model, held, spec, pad_id, batch_size)


def _train(
    run: _Training, train: Dataset, spec, pad_id: int, opts: FinetuneOptions, progress
) -> tuple[list[float], dict[str, int], float]:
    """`opts.steps` steps over shuffled passes of `train`, closing heads on schedule. Returns each step's loss,
    the step each head closed at ("layer.head"), and the seconds taken."""
    import torch

    from .gates import closed_target

    order = torch.Generator().manual_seed(opts.seed)
    queue: list[int] = []
    losses, closed_at = [], {}
    t0 = time.perf_counter()
    run.model.train()
    for step in range(opts.steps):
        while len(queue) < opts.batch_size:
            queue += torch.randperm(len(train), generator=order).tolist()
        idx, queue = queue[: opts.batch_size], queue[opts.batch_size :]
        lm = run.step(_collate([train.examples[i] for i in idx], spec, pad_id), opts.gate_weight)
        if run.gates is not None:
            want = closed_target(step, opts.steps, run.heads_total, opts.gate_rate, opts.gate_start, opts.gate_end)
            for li, h in run.gates.close_to(want):
                closed_at[f"{li}.{h}"] = step
        losses.append(float(lm.detach()))
        if progress:
            progress(step + 1, opts.steps, losses[-1])
    run.model.eval()
    return losses, closed_at, time.perf_counter() - t0


def _result(
    model_dir: Path,
    kind: str,
    train: Dataset,
    held: Dataset | None,
    opts: FinetuneOptions,
    run: _Training,
    losses: list[float],
    seconds: float,
    before: dict | None,
    after: dict | None,
) -> dict:
    """`finetune.json` without its gates: the base, the data, the options and the figures before and after."""
    import peft
    import torch

    return {
        "base": str(model_dir),
        "kind": kind,
        "data": {"path": str(train.path), "examples": len(train), "layout": train.layout, "truncated": train.truncated},
        "eval_data": (
            {"path": str(held.path), "examples": len(held), "truncated": held.truncated} if held is not None else None
        ),
        "options": asdict(opts),
        "trainable_parameters": int(sum(p.numel() for g in run.groups for p in g["params"])),
        "steps": opts.steps,
        "first_loss": round(losses[0], 5),
        "last_loss": round(float(np.mean(losses[-5:])), 5),
        "train_seconds": round(seconds, 1),
        "before": before,
        "after": after,
        "torch": torch.__version__,
        "peft": peft.__version__,
    }


def _write_gates(out: Path, run: _Training, source: str, closed_at: dict[str, int]) -> dict:
    """`head_gates.json` (the head-importance schema) into `out`; returns the result's `gates` entry."""
    doc = {
        "version": 1,
        "method": METHOD,
        "source": source,
        "layers": run.gates.layer_entries(list(run.attention.modules), run.attention.head_dim),
    }
    (out / names.HEAD_GATES_FILE).write_text(json.dumps(doc, indent=1) + "\n")
    closed, total = int(run.gates.closed.sum()), run.heads_total
    return {"closed": closed, "total": total, "closed_ratio": round(closed / total, 4), "closed_at_step": closed_at}
