"""The cpu target (ONNX Runtime): KV-cache consistency, batching, profiling, options and bad graphs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgekit.errors import BundleError, ConfigError
from edgekit.targets.cpu import CpuBackend, physical_cores

from small_model import SMALL


@pytest.fixture(scope="module")
def onnx_dir(small_onnx_dir):
    return small_onnx_dir


@pytest.fixture(scope="module")
def backend(onnx_dir):
    return CpuBackend.from_dir(onnx_dir, intra_op_threads=1)


def _inputs(backend, rng, batch=1, prompt_len=6):
    pixels = rng.uniform(-1, 1, (batch, SMALL.num_frames, 1, SMALL.image_size, SMALL.image_size)).astype(np.float32)
    prompt = rng.integers(5, SMALL.vocab_size, (batch, prompt_len))
    return np.concatenate([backend.encode_images(pixels), backend.embed(prompt)], axis=1)


def test_reads_its_shape_from_the_decoder_graph(backend):
    assert (backend.num_layers, backend.kv_heads, backend.head_dim, backend.hidden) == (2, 2, 12, 48)
    assert backend.encode_images(np.zeros((3, 2, 1, 32, 32), np.float32)).shape == (3, SMALL.num_image_tokens, 48)
    assert backend.embed(np.array([[1, 2]])).shape == (1, 2, 48)


def test_kv_cache_decode_equals_recomputing_the_full_sequence(backend):
    rng = np.random.default_rng(0)
    prefix = _inputs(backend, rng)
    steps = backend.embed(rng.integers(5, SMALL.vocab_size, (1, 20)))
    n = prefix.shape[1]
    logits, past = backend.decode(prefix, np.ones((1, n), np.int64), np.arange(n)[None], None)
    cached = [logits[:, -1]]
    for i in range(20):
        total = n + i + 1
        logits, past = backend.decode(steps[:, i : i + 1], np.ones((1, total), np.int64), np.array([[total - 1]]), past)
        cached.append(logits[:, -1])
    assert past[0][0].shape == (1, 2, n + 20, 12)
    full = np.concatenate([prefix, steps], axis=1)
    total = full.shape[1]
    full_logits, _ = backend.decode(full, np.ones((1, total), np.int64), np.arange(total)[None], None)
    recomputed = full_logits[0, n - 1 :]
    np.testing.assert_allclose(np.concatenate(cached), recomputed, atol=1e-4, rtol=0)


def test_left_padded_batch_rows_equal_their_single_runs(backend):
    rng = np.random.default_rng(1)
    long, short = _inputs(backend, rng, prompt_len=7), _inputs(backend, rng, prompt_len=4)
    pad = long.shape[1] - short.shape[1]
    batch = np.concatenate([long, np.concatenate([np.zeros((1, pad, 48), np.float32), short], axis=1)])
    mask = np.ones(batch.shape[:2], np.int64)
    mask[1, :pad] = 0
    pos = np.maximum(mask.cumsum(-1) - 1, 0)
    logits, _ = backend.decode(batch, mask, pos, None)
    single_long, _ = backend.decode(long, np.ones(long.shape[:2], np.int64), np.arange(long.shape[1])[None], None)
    single_short, _ = backend.decode(short, np.ones(short.shape[:2], np.int64), np.arange(short.shape[1])[None], None)
    np.testing.assert_allclose(logits[0], single_long[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits[1, pad:], single_short[0], atol=1e-5, rtol=0)


def test_profiling_writes_chrome_traces(onnx_dir, tmp_path):
    be = CpuBackend.from_dir(onnx_dir, intra_op_threads=1, profile_dir=tmp_path)
    x = _inputs(be, np.random.default_rng(2))
    be.decode(x, np.ones(x.shape[:2], np.int64), np.arange(x.shape[1])[None])
    traces = be.end_profiling()
    assert len(traces) == 3 and all(p.parent == tmp_path for p in traces)
    events = json.loads(traces[2].read_text())
    assert any(e.get("ph") == "X" and "/model/layers.0/self_attn" in e.get("name", "") for e in events)


def test_thread_options(onnx_dir):
    assert physical_cores() >= 1
    assert CpuBackend.from_dir(onnx_dir).intra_op_threads == physical_cores()
    with pytest.raises(ConfigError, match="intra_op_threads"):
        CpuBackend.from_dir(onnx_dir, intra_op_threads=0)


def test_missing_or_corrupt_graphs_raise_bundle_errors(onnx_dir, tmp_path):
    with pytest.raises(BundleError, match="vision_encoder.onnx: ONNX graph not found"):
        CpuBackend.from_dir(tmp_path)
    bad = tmp_path / "decoder_model_merged.onnx"
    bad.write_bytes(b"not a protobuf")
    with pytest.raises(BundleError, match="decoder_model_merged.onnx: ONNX Runtime cannot load"):
        CpuBackend(onnx_dir / "vision_encoder.onnx", onnx_dir / "embed_tokens.onnx", bad)
    with pytest.raises(BundleError, match="lacks inputs"):  # a graph that is not a decoder
        CpuBackend(onnx_dir / "vision_encoder.onnx", onnx_dir / "embed_tokens.onnx", onnx_dir / "embed_tokens.onnx")
