"""The radreport-tiny tokenizer: exact round trips, fixed special ids, single digits, deterministic training."""

from __future__ import annotations

import json

import pytest

from edgekit.errors import ConfigError
from edgekit.models.radreport_tiny.tokenizer import (
    BOS_ID,
    EOS_ID,
    SEP_ID,
    SPECIAL_TOKENS,
    decode_report,
    encode_prompt,
    encode_text,
    load_tokenizer,
    train_tokenizer,
)
from edgekit.models.synth import generate_study


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    texts = {"XC"}
    for i in range(12):
        s = generate_study(i, "train")
        texts.update([s.modality, s.indication, *s.references])
    return sorted(texts)


@pytest.fixture(scope="module")
def tok(corpus):
    return train_tokenizer(corpus)


def test_special_tokens_have_contract_ids(tok):
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert tok.get_vocab_size() <= 1024


def test_reports_round_trip_exactly(tok, corpus):
    for text in corpus:
        assert tok.decode(encode_text(tok, text)) == text
    # studies the tokenizer never saw, and text with characters outside the corpus, round-trip too (byte-level)
    for i in range(3):
        for ref in generate_study(i, "val").references:
            assert tok.decode(encode_text(tok, ref)) == ref
    odd = "Ünïcode   spaces\tand 1234567 mm"
    assert tok.decode(encode_text(tok, odd)) == odd


def test_digits_are_single_tokens(tok):
    pieces = tok.encode("measuring 1234 mm", add_special_tokens=False).tokens
    assert [p for p in pieces if any(c.isdigit() for c in p)] == ["1", "2", "3", "4"]


def test_training_is_deterministic_and_order_independent(corpus):
    a = train_tokenizer(corpus).to_str()
    b = train_tokenizer(list(reversed(corpus))).to_str()
    assert a == b


def test_prompt_and_report_framing(tok):
    ids = encode_prompt(tok, "CT", "cough")
    assert ids[0] == BOS_ID and ids[-1] == SEP_ID
    assert tok.decode(ids[1:-1]) == "CT: cough"
    report = encode_text(tok, "No acute findings.")
    assert decode_report(tok, report + [EOS_ID] + encode_text(tok, " junk")) == "No acute findings."


def test_load_rejects_bad_files(tmp_path, tok):
    with pytest.raises(ConfigError, match="not found") as e:
        load_tokenizer(tmp_path / "missing.json")
    assert "missing.json" in str(e.value)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json"):
        load_tokenizer(bad)
    # a tokenizer whose special ids moved breaks the model contract
    data = json.loads(tok.to_str())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "<eos>"]
    del data["model"]["vocab"]["<eos>"]
    moved = tmp_path / "moved.json"
    moved.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="<eos>"):
        load_tokenizer(moved)
