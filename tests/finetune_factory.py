"""A random-init Hugging Face LLaMA directory with a word-level tokenizer, and a learnable task in JSON Lines:
what `edgekit finetune` is tested (and its --help examples run) on. Nothing is downloaded.

The task: reverse a sequence of words (`prompt` "a b c d", `completion` "d c b a"). It needs attention, so
closing heads has a cost the fine-tune can be seen to pay or avoid.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SPECIALS = {"<unk>": 0, "<s>": 1, "</s>": 2}
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def make_llama(path: Path, *, vocab: int = 64, hidden: int = 64, layers: int = 2, heads: int = 4, seed: int = 0):
    """Save a random-init LlamaForCausalLM and its tokenizer (`<s>` prepended, words `w0`, `w1`, ...)."""
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    cfg = tf.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    words = {f"w{i - len(SPECIALS)}": i for i in range(len(SPECIALS), vocab)}
    tok = Tokenizer(models.WordLevel({**SPECIALS, **words}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(SPECIALS))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    return model


def reverse_task(n: int, *, words: int = 60, length: int = 5, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        seq = [f"w{int(i)}" for i in rng.choice(words, length, replace=False)]
        rows.append({"prompt": " ".join(seq) + " w0", "completion": " ".join(reversed(seq))})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_image_records(folder: Path, n: int) -> Path:
    """`n` image + prompt + completion records over one random 40 x 40 grey PNG, as `folder / "t.jsonl"`."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 40), dtype=np.uint8)).save(folder / "img.png")
    rows = [{"image": "img.png", "prompt": f"w{i}", "completion": f"w{i + 1} w{i + 2}"} for i in range(n)]
    return write_jsonl(folder / "t.jsonl", rows)
