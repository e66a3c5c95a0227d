"""Token streaming: generate's on_token hook, text deltas that join to the report, and the daemon's NDJSON/SSE
streams for synchronous reports and durable jobs (served over the Unix socket on a tiny random model)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from edgekit.generate import GenerationOptions, generate

from small_model import SMALL

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "models" / "samples"


@pytest.fixture(scope="module")
def backend(small_backend):
    return small_backend


@pytest.mark.parametrize("stop", [[], "first"])
def test_on_token_sees_exactly_the_generated_tokens_in_order(backend, stop):
    rng = np.random.default_rng(1)
    pixels = rng.uniform(-1, 1, (1, 2, 1, 32, 32)).astype(np.float32)
    prompt = rng.integers(5, SMALL.vocab_size, (1, 6))
    plain = generate(backend, pixels, prompt, GenerationOptions(max_new_tokens=12, temperature=0.9, seed=4))
    # stop on a token that the unstopped run produces, so the stop path (stop token not reported) is exercised
    stops = [plain.token_ids[5]] if stop == "first" else []
    seen = []
    result = generate(
        backend,
        pixels,
        prompt,
        GenerationOptions(max_new_tokens=12, temperature=0.9, seed=4, stop_token_ids=stops),
        on_token=lambda t, i: seen.append((t, i)),
    )
    assert [t for t, _ in seen] == result.token_ids and [i for _, i in seen] == list(range(len(seen)))
    assert result.token_ids == (plain.token_ids if not stops else plain.token_ids[: plain.token_ids.index(stops[0])])


def test_on_token_refuses_a_batch(backend):
    from edgekit.errors import EdgekitError
    from edgekit.generate import generate_batch

    pixels = np.zeros((2, 2, 1, 32, 32), np.float32)
    with pytest.raises(EdgekitError, match="batch of 2"):
        generate_batch(
            backend, pixels, np.full((2, 3), 7), GenerationOptions(max_new_tokens=2), on_token=lambda t, i: None
        )


def test_text_deltas_join_to_the_stripped_decoded_text():
    from edgekit.daemon.streams import TextDeltas
    from edgekit.models.radreport_tiny.tokenizer import train_tokenizer
    from edgekit.models.synth import generate_study

    texts = [r for i in range(6) for r in generate_study(i, "train").references]
    tok = train_tokenizer(texts + ["Café — 5 mm ± 2 µm."], vocab_size=300)
    rng = np.random.default_rng(0)
    cases = [tok.encode(t, add_special_tokens=False).ids for t in texts[:5] + ["  lead and trail  "]]
    cases += [list(rng.integers(0, tok.get_vocab_size(), 40)) for _ in range(20)]  # garbage, specials, bytes
    for ids in cases:
        deltas = TextDeltas(tok)
        out = [deltas.push(t) for t in ids]
        final = tok.decode([int(t) for t in ids], skip_special_tokens=True).strip()
        out.append(deltas.finish(final))
        assert "".join(out) == final


# --- over the socket ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from edgekit.daemon.testing import DaemonProcess, write_tiny_model

    root = tmp_path_factory.mktemp("edgekitd-stream")
    with DaemonProcess(root / "state", write_tiny_model(root / "model", max_new_tokens=40)).start() as d:
        yield d


def _events(body: bytes, fmt: str) -> list[dict]:
    text = body.decode()
    if fmt == "sse":
        blocks = [b for b in text.split("\n\n") if b.strip()]
        assert all(b.startswith("data: ") for b in blocks), blocks[:2]
        return [json.loads(b[len("data: ") :]) for b in blocks]
    return [json.loads(line) for line in text.splitlines()]


def _deltas(events: list[dict]) -> str:
    tokens = [e for e in events if e["event"] == "token"]
    assert [e["index"] for e in tokens] == list(range(len(tokens)))
    return "".join(e["text"] for e in tokens)


@pytest.mark.parametrize("fmt", ["ndjson", "sse"])
def test_synchronous_stream_deltas_equal_the_report(daemon, fmt):
    from edgekit.daemon.client import study_files

    files = study_files(SAMPLES / "ct_chest")
    reply = daemon.client.post_study(f"/v1/reports?stream={fmt}", files, {"prompt": "Follow-up."})
    assert reply.status == 200
    assert reply.headers["content-type"].startswith("text/event-stream" if fmt == "sse" else "application/x-ndjson")
    events = _events(reply.body, fmt)
    assert events[-1]["event"] == "report" and sum(e["event"] == "token" for e in events) >= 2
    report = events[-1]["report"]
    assert report["text"] and _deltas(events) == report["text"]
    # the same request without streaming writes the same report (greedy)
    plain = daemon.client.post_study("/v1/reports", files, {"prompt": "Follow-up."}).json()
    assert plain["text"] == report["text"]


def test_synchronous_stream_refuses_non_json_format_and_bad_input_before_streaming(daemon):
    from edgekit.daemon.client import study_files

    files = study_files(SAMPLES / "cr_chest" / "image.dcm")
    r = daemon.client.post_study("/v1/reports?stream=ndjson&format=sr", files)
    assert (r.status, r.error_code) == (400, "validation_error")
    r = daemon.client.post_study("/v1/reports?stream=ndjson", [("a.dcm", b"not dicom", "application/dicom")])
    assert (r.status, r.error_code) == (400, "invalid_study")
    # the variant is checked before the upload is read, as /v1/jobs does (one upload form, one set of checks)
    r = daemon.client.post_study("/v1/reports?stream=ndjson", files, {"variant": "nope"})
    assert (r.status, r.error_code) == (404, "unknown_variant")
    assert daemon.client.get("/v2/health/ready").status == 200


def _read_live(client, url: str) -> tuple[list[dict], list[float]]:
    """Read a stream line by line as it arrives, with the time each event came."""
    from edgekit.daemon.client import UnixConnection

    conn = UnixConnection(client.socket_path, 60)
    try:
        conn.request("GET", url)
        resp = conn.getresponse()
        assert resp.status == 200
        events, times = [], []
        while line := resp.readline():
            events.append(json.loads(line))
            times.append(time.monotonic())
        return events, times
    finally:
        conn.close()


def test_job_stream_gives_states_tokens_then_the_report_live_and_replayed(daemon):
    from edgekit.daemon.client import study_files

    files = study_files(SAMPLES / "cr_chest" / "image.dcm")
    # jobs ahead keep ours queued, so its stream opens before it finishes; on the tiny model a job can still finish
    # first (the engine runs greedy steps several at a time), and its stream is then a replay: try again with more
    # jobs ahead (within the daemon's queue of 16) until the stream is live
    for n_ahead in (1, 4, 8, 12):
        ahead = [
            daemon.client.post_study("/v1/jobs", files, {"max_new_tokens": "120", "prompt": "ahead"}).json()["id"]
            for _ in range(n_ahead)
        ]
        job = daemon.client.post_study("/v1/jobs", files, {"max_new_tokens": "40", "prompt": "Cough."}).json()["id"]
        events, _ = _read_live(daemon.client, f"/v1/jobs/{job}/stream")
        states = [e["state"] for e in events if e["event"] == "state"]
        if states[0] in ("queued", "running"):
            break
        for earlier in ahead:  # the queue empties before the next try
            _read_live(daemon.client, f"/v1/jobs/{earlier}/stream")
    kinds = [e["event"] for e in events]
    assert states[0] in ("queued", "running") and states[-1] == "succeeded"
    first_token, last_state = kinds.index("token"), len(kinds) - 1
    assert "running" in states and kinds[last_state] == "state" and first_token < last_state
    assert all(k == "token" for k in kinds[first_token:last_state])
    text = events[-1]["report"]["text"]
    assert _deltas(events) == text
    # after the job finished, the stream replays the same deltas
    replay = _events(daemon.client.get(f"/v1/jobs/{job}/stream?format=sse").body, "sse")
    assert _deltas(replay) == text and replay[-1]["state"] == "succeeded"
    assert all(daemon.client.get(f"/v1/jobs/{j}").json()["state"] in ("running", "succeeded") for j in ahead)
