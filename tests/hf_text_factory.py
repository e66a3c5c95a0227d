"""Random-init Hugging Face decoder-only checkpoints (LLaMA, Qwen2, Mistral) built from tiny configs, nothing
downloaded: what a user's download of a text report model looks like (`config.json` + safetensors from
`save_pretrained`, a word-level `tokenizer.json` holding the special tokens at their config ids, the chat template
in `tokenizer_config.json`). Shared by tests/test_text_bundles.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hf_vlm_factory import save_word_tokenizer

# LLaMA-2-chat's and Mistral-Instruct's layout (the template writes <s>); Qwen2-Instruct's ChatML with its default
# system turn. Both take a message's content as a string, as text models' templates do.
INST_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'assistant' %} {{ m['content'] }} </s>{% endif %}{% endfor %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB = 160
DECODER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=96,  # short, so a long prompt is refused without a long test
    initializer_range=0.2,  # wide enough that logits spread and greedy tokens mean something
)


@dataclass
class TinyLM:
    family: str
    path: Path
    model: object  # the transformers model, eval mode, float32
    eos_token_id: int


def make_text_lm(path: Path, family: str = "llama", *, seed: int = 0) -> TinyLM:
    """A `family` ("llama", "qwen2", "mistral") checkpoint directory at `path`, with its tokenizer and template."""
    import torch
    import transformers as tf

    cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "mistral": tf.MistralConfig}[family]
    extra = {"sliding_window": None} if family == "mistral" else {}
    if family == "qwen2":
        specials = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "system": 3, "user": 4, "assistant": 5}
        template, bos, eos = CHATML_TEMPLATE, "<|im_start|>", "<|im_end|>"
        extra.update(bos_token_id=None, eos_token_id=2)
    else:
        specials = {"<unk>": 0, "<s>": 1, "</s>": 2, "[INST]": 3, "[/INST]": 4}
        template, bos, eos = INST_TEMPLATE, "<s>", "</s>"
        extra.update(bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cls(**DECODER, **extra)).eval()
    model.save_pretrained(path)
    save_word_tokenizer(path, VOCAB, specials, template, bos, eos, newlines=family == "qwen2")
    return TinyLM(family, Path(path), model, specials[eos])
