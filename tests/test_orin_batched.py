"""Continuous batching on orin, held to ONNX Runtime through the orin graphs (issue #29).

The default model's orin bundle, its graphs run in ONNX Runtime (`OrinOnnxBackend`, the reference the TensorRT
engines are held to) with the rows algorithm the TensorRT backend shares (`rows.RowBatcher`): requests decoded
together in one `edgekit.engine.Engine` give the tokens each gives alone, each row is billed what it would be
billed alone, the profiles refuse what the engines would, and finding F1 on eval studies does not move.

What is not here: TensorRT. `TrtBackend` runs the same `RowBatcher` on device buffers (`device_kv.DeviceKV`);
only its pure parts are tested (the buffer sizes and the copy plans, applied as cudaMemcpy2D defines a copy).
The test that would run it skips without TensorRT, naming what is missing.
"""

from __future__ import annotations

import json
import threading
from importlib.resources import files

import numpy as np
import pytest

from edgekit import names
from edgekit.build import build
from edgekit.bundle import load_bundle
from edgekit.cli.app import main
from edgekit.engine import Engine, Request
from edgekit.errors import ConfigError, EdgekitError
from edgekit.eval.finding_metrics import prf, score_study
from edgekit.eval.runner import evaluate, load_split
from edgekit.findings import Finding
from edgekit.ingest import load_study
from edgekit.plugins import load_backend
from edgekit.reporter import Reporter
from edgekit.target import RuntimeOptions
from edgekit.targets.orin import TRT_MISSING
from edgekit.targets.orin.device_kv import KVLayout
from edgekit.targets.orin.onnx_backend import HostKV, OrinOnnxBackend
from edgekit.targets.orin.profiles import ProfileError
from edgekit.targets.orin.trt_import import tensorrt_available

SAMPLES = files("edgekit.models") / "samples"
ORT_4 = {"engine": "onnxruntime", "max_batch": 4}  # the run setting: profiles remade at 4 rows
BILLED_4 = {**ORT_4, "estimate": "agx-orin-64:MAXN"}


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return load_bundle(build("orin", tmp_path_factory.mktemp("orin-batched") / "orin", parity=False).bundle)


def _backend(bundle, settings=ORT_4):
    return load_backend(bundle, RuntimeOptions(threads=1, settings=settings))


def _requests(bundle, backend) -> list[Request]:
    """Five reports' requests: two modalities, prompts of 0 to 11 words, caps from 12 to 64 tokens (some stop at
    the end token first), so the rows have different lengths and leave at different steps."""
    reporter = Reporter(bundle, backend=backend)
    reporter.close()  # only its prompt layout and preprocessing are used here
    cases = [
        ("cr_chest", "", 40),
        ("ct_chest", "Cough and fever for three days.", 12),
        ("cr_chest", "Follow-up of a nodule seen last year, please compare with the prior study.", 64),
        ("ct_chest", "Trauma.", 25),
        ("cr_chest", "Chest pain.", 33),
    ]
    out = []
    for sample, prompt, cap in cases:
        study = load_study(SAMPLES / sample)
        layout = reporter.prompt(study.modality, prompt)
        opts = reporter.options(max_new_tokens=cap)  # stops at the bundle's end token
        out.append(Request(np.asarray(layout.ids, np.int64), opts, reporter.pixel_values(study)[0], layout.image_slot))
    return out


def _alone(backend, request, positions=None):
    engine = Engine(backend, max_batch=1, positions=positions)
    ticket = engine.submit(request)
    engine.run()
    return ticket.result()


def _staggered(backend, requests):
    """Two requests, five steps, a third, seven steps, the last two: run to the end. Returns the results and the
    most rows that were in flight at once."""
    engine = Engine(backend, max_batch=8)  # the backend's rows cap it
    assert engine.max_batch == backend.max_rows == 4
    tickets, peak = [engine.submit(r) for r in requests[:2]], 0
    for when, joining in ((5, requests[2:3]), (7, requests[3:])):
        for _ in range(when):
            engine.step()
            peak = max(peak, engine.in_flight)
        tickets += [engine.submit(r) for r in joining]
    while engine.step():
        peak = max(peak, engine.in_flight)
    assert engine.stats.tokens > engine.stats.steps  # some steps carried several rows
    return [t.result() for t in tickets], peak


def test_batched_greedy_tokens_equal_each_request_alone(bundle):
    backend = _backend(bundle)
    requests = _requests(bundle, backend)
    alone = [_alone(backend, r) for r in requests]
    together, peak = _staggered(backend, requests)
    assert peak == 4  # never more than the decode profile's 4 rows
    for a, t in zip(alone, together):
        assert t.token_ids == a.token_ids and t.stop_reason == a.stop_reason
    assert {r.stop_reason for r in alone} == {"stop_token", "max_new_tokens"}  # rows left for both reasons
    assert len({len(r.token_ids) for r in alone}) >= 3  # of different lengths: rows leave while others decode


def test_a_batched_step_gives_each_row_the_logits_it_gets_alone(bundle):
    """Below the tokens: rows of 3 different lengths left-padded into one step, against each row stepped alone."""
    backend = _backend(bundle)
    rng = np.random.default_rng(0)
    hidden = backend.hidden
    prompts = [rng.standard_normal((1, n, hidden)).astype(np.float32) for n in (7, 19, 30)]
    tokens = rng.standard_normal((3, 1, hidden)).astype(np.float32)
    positions = np.array([[7], [19], [30]], np.int64)

    def prefill(row, x):
        return backend.prefill(row, x, np.arange(x.shape[1], dtype=np.int64)[None])

    alone = []
    for i, x in enumerate(prompts):
        prefill(0, x)
        alone.append(backend.step([0], tokens[i : i + 1], positions[i : i + 1])[0])
        backend.release(0)
    for row, x in enumerate(prompts):
        prefill(row, x)
    together = backend.step([0, 1, 2], tokens, positions)
    for row in range(3):
        backend.release(row)
    np.testing.assert_allclose(together, np.stack(alone), atol=1e-4, rtol=1e-4)
    assert (together.argmax(-1) == np.stack(alone).argmax(-1)).all()


def test_each_row_is_billed_what_it_is_billed_alone(bundle):
    backend = _backend(bundle, BILLED_4)
    requests = _requests(bundle, backend)
    serial = [_alone(backend, r) for r in requests]
    together, _ = _staggered(backend, requests)
    for request, a, t in zip(requests, serial, together):
        assert t.cost == a.cost and a.cost["figure_source"] == "estimated:orin-agx64-maxn"
        chosen = len(a.token_ids) + (a.stop_reason == "stop_token")  # the stop token cost a decoder pass too
        counted = (a.cost["prompt_tokens"], a.cost["new_tokens"], a.cost["image"])
        assert counted == (request.prompt_ids.size, chosen, True)
    for key in ("latency_ms", "energy_j"):
        assert sum(t.cost[key] for t in together) == pytest.approx(sum(a.cost[key] for a in serial), rel=1e-12)


def test_beyond_the_profiles_is_refused_with_the_profiles_line(bundle):
    backend = _backend(bundle)
    assert backend.max_rows == 4
    hidden, heads, dim = backend.hidden, backend.kv_heads, backend.head_dim
    past = [(np.zeros((5, heads, 9, dim), np.float32),) * 2] * backend.num_layers
    with pytest.raises(ProfileError) as err:  # five rows in one decode step: the engines take four
        backend.decode(np.zeros((5, 1, hidden), np.float32), np.ones((5, 10), np.int64), np.full((5, 1), 9), past)
    assert str(err.value) == (
        f"{bundle.source}: input inputs_embeds has size 5 on axis 0, outside the engine's profile [1, 4] "
        "(decoder profile 'decode', runtime.profiles in the manifest)"
    )
    with pytest.raises(ProfileError, match=r"input pixel_values has size 5 on axis 0, outside .*\[1, 4\]"):
        backend.encode_images(np.zeros((5, 8, 1, 64, 64), np.float32), rows=range(5))
    with pytest.raises(EdgekitError, match="row 4 is outside the engines' 4 rows"):
        backend.prefill(4, np.zeros((1, 3, hidden), np.float32), np.arange(3)[None])

    # a second prompt chunk on a non-empty cache fits neither profile: refused before the row's cache moves
    x = np.random.default_rng(1).standard_normal((1, 12, hidden)).astype(np.float32)
    token = x[:, :1]
    backend.prefill(0, x, np.arange(12)[None])
    want = backend.step([0], token, np.array([[12]]))
    backend.release(0)
    backend.prefill(0, x, np.arange(12)[None])
    with pytest.raises(ProfileError, match="outside the engine's profile"):
        backend.prefill(0, x[:, :3], np.arange(12, 15)[None])
    np.testing.assert_array_equal(backend.step([0], token, np.array([[12]])), want)
    backend.release(0)


def test_max_batch_is_a_plan_setting_recorded_in_the_bundle(bundle, capsys):
    runtime = bundle.manifest.runtime
    assert runtime["max_batch"] == 8 and OrinOnnxBackend(bundle, intra_op_threads=1).max_rows == 8
    with pytest.raises(ConfigError, match=r"max_batch must be an integer in \[1, 64\], got 0"):
        _backend(bundle, {"engine": "onnxruntime", "max_batch": 0})
    source = str(bundle.source)
    assert main(["engine", "build", source, "--dry-run", "--json"]) == 0
    default = json.loads(capsys.readouterr().out)
    assert main(["engine", "build", source, "--dry-run", "--max-batch", "4", "--json"]) == 0
    four = json.loads(capsys.readouterr().out)
    assert (default["plan"]["max_batch"], four["plan"]["max_batch"]) == (8, 4)
    assert four["bundle_id"] != default["bundle_id"]  # engines built for 4 rows are other engines


def _scored(records: list[tuple[dict, object]]) -> float:
    """Finding F1 over (study, report) pairs, as `edgekit.eval` scores them."""
    counts = np.zeros(3)
    for study, report in records:
        truth = [Finding(**f) for f in study["findings"]]
        score = score_study(truth, study["negatives"], [Finding(**f) for f in report.findings], list(report.negatives))
        counts += (score.tp, score.fp, score.fn)
    return prf(*counts)[2]


def test_finding_f1_is_unchanged_batched_vs_serial(bundle, tmp_path):
    from edgekit.models.synth.splits import write_split

    split = write_split(tmp_path / "test", "test", 8).parent
    studies = load_split(split)
    serial = evaluate(Reporter(bundle, backend=_backend(bundle)), split, include_video=False, resamples=10)
    reporter = Reporter(bundle, backend=_backend(bundle), max_batch=4)
    reports: dict[str, object] = {}
    gate = threading.Barrier(4)

    def write(chunk):
        gate.wait()  # four reports submitted together, so they decode together
        for s in chunk:
            reports[s["id"]] = reporter.report(split / s["path"], prompt=s.get("indication", ""))

    threads = [threading.Thread(target=write, args=(studies[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reporter.close()
    assert reporter.engine.stats.tokens > reporter.engine.stats.steps  # the reports were decoded together
    by_id = {r["id"]: r for r in serial["records"]}
    assert [reports[s["id"]].text for s in studies] == [by_id[s["id"]]["text"] for s in studies]
    f1 = serial["overall"]["finding_f1"]["value"]
    assert _scored([(s, reports[s["id"]]) for s in studies]) == f1 > 0.5


# ---------------------------------------------------------------------------------------------------------------
# the TensorRT side's pure parts: no TensorRT, no stand-in for it
# ---------------------------------------------------------------------------------------------------------------
def _apply(copy, dst: np.ndarray, src: np.ndarray) -> None:
    """A Copy2D applied as cudaMemcpy2D defines a copy: `height` lines of `width` bytes, each line at its pitch."""
    d, s = dst.view(np.uint8).reshape(-1), src.view(np.uint8).reshape(-1)
    for line in range(copy.height):
        at, fro = copy.dst_offset + line * copy.dst_pitch, copy.src_offset + line * copy.src_pitch
        d[at : at + copy.width] = s[fro : fro + copy.width]


def test_the_device_copy_plans_move_what_the_host_store_moves(bundle):
    """`DeviceKV` gathers and scatters with `KVLayout`'s copy plans; applied to host bytes they must give the
    numpy store's batch (left-padded with zeros) and homes back. This checks our offsets and pitches only."""
    profiles = bundle.manifest.runtime["profiles"][names.DECODER_ROLE]
    layout = KVLayout.of(profiles, num_layers=1)
    heads, dim = layout.kv_heads, layout.head_dim
    assert (layout.max_rows, layout.max_positions, heads, dim) == (8, 256, 2, 32)
    assert layout.home_bytes == heads * 256 * dim * 4 and layout.batch_bytes == 8 * layout.home_bytes
    assert layout.device_bytes == 2 * (8 * layout.home_bytes + 2 * layout.batch_bytes)

    rng = np.random.default_rng(2)
    lengths, rows = [5, 17, 1, 9], [3, 0, 6, 2]
    store = HostKV(decode=None)
    for row, n in zip(rows, lengths):
        k = rng.standard_normal((1, heads, n, dim)).astype(np.float32)
        store.home[row] = [(k, k + 1)]
    store.gather(rows, lengths)
    want = store.batch[0][0]
    longest = max(lengths)
    got = np.zeros((len(rows), heads, longest, dim), np.float32)  # DeviceKV.gather zeroes it first (cudaMemsetAsync)
    for row, copy in zip(rows, layout.gather_copies(lengths)):
        _apply(copy, got, store.home[row][0][0])
    np.testing.assert_array_equal(got, want)

    grown = np.concatenate([want, rng.standard_normal((len(rows), heads, 1, dim)).astype(np.float32)], axis=2)
    store.batch = [(grown, grown)]
    store.scatter(rows, [n + 1 for n in lengths], longest + 1)
    for row, n, copy in zip(rows, lengths, layout.scatter_copies([n + 1 for n in lengths], longest + 1)):
        home = np.empty((1, heads, n + 1, dim), np.float32)
        _apply(copy, home, grown)
        np.testing.assert_array_equal(home, store.home[row][0][0])
    with pytest.raises(EdgekitError, match="do not fit the device KV cache"):
        layout.check([4] * 9, 4)


@pytest.mark.skipif(not tensorrt_available(), reason=TRT_MISSING)
def test_tensorrt_batched_tokens_equal_onnx_runtime(bundle, tmp_path, monkeypatch):
    """On a Jetson: the engines' batched tokens against the ONNX Runtime reference's (the same staggered run)."""
    from edgekit.targets.orin.engine_build import build_engines

    monkeypatch.setenv("EDGEKIT_STATE_DIR", str(tmp_path))
    build_engines(bundle, overrides={"max_batch": 4})
    trt = load_backend(bundle, RuntimeOptions(settings={"max_batch": 4}))
    reference = _backend(bundle)
    requests = _requests(bundle, reference)
    on_device, in_ort = _staggered(trt, requests)[0], _staggered(reference, requests)[0]
    assert [r.token_ids for r in on_device] == [r.token_ids for r in in_ort]
