"""The radreport-tiny tokenizer: a small byte-level BPE trained on the synthetic report corpus.

Byte-level so any prompt a user types encodes without `<unk>`; digits split one by one so the model learns sizes
and counts digit by digit and generalises to numbers it never saw whole. No post-processor adds special tokens:
callers build `<bos> {modality}: {prompt} <sep>` explicitly (see `encode_prompt`), which is what the runtime does
from `generation_config.json`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from edgekit.errors import ConfigError

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<sep>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, SEP_ID, UNK_ID = range(5)
PROMPT_TEMPLATE = "{modality}: {prompt}"
MAX_VOCAB = 1024


def train_tokenizer(texts: Iterable[str], *, vocab_size: int = MAX_VOCAB, min_frequency: int = 2) -> Tokenizer:
    """Train the BPE deterministically; it stops early once no pair occurs `min_frequency` times (sized to corpus)."""
    if not 0 < vocab_size <= MAX_VOCAB:
        raise ConfigError(f"tokenizer vocab_size must be in 1..{MAX_VOCAB}, got {vocab_size}")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sorted(texts), trainer)  # sorted: the result must not depend on corpus order
    check_special_tokens(tok, "<trained>")
    return tok


def check_special_tokens(tok: Tokenizer, path: str | Path) -> None:
    """The ids of the special tokens are part of the model contract; a tokenizer that moved them is unusable."""
    for want, name in enumerate(SPECIAL_TOKENS):
        got = tok.token_to_id(name)
        if got != want:
            raise ConfigError(f"tokenizer maps {name} to {got}, expected {want}", path)


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    if not path.is_file():
        raise ConfigError("tokenizer file not found", path)
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise ConfigError(f"not a valid tokenizer.json ({type(e).__name__})", path) from None
    check_special_tokens(tok, path)
    return tok


def encode_text(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def encode_prompt(tok: Tokenizer, modality: str, prompt: str) -> list[int]:
    """`<bos> {modality}: {prompt} <sep>`: the decoder input before the report."""
    return [BOS_ID, *encode_text(tok, PROMPT_TEMPLATE.format(modality=modality, prompt=prompt)), SEP_ID]


def decode_report(tok: Tokenizer, ids: Iterable[int]) -> str:
    """Report text from generated ids: stops at the first `<eos>`, drops other special tokens."""
    out = []
    for i in ids:
        if i == EOS_ID:
            break
        out.append(int(i))
    return tok.decode(out, skip_special_tokens=True)
