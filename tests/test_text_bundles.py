"""Decoder-only checkpoints (LLaMA, Qwen2, Mistral) become text bundles (issue #29): random-init models built from
tiny transformers configs (nothing downloaded), built by `edgekit build` for cpu (plain and `--recipe int4`) and
x1, served by `edgekit run --prompt`, `edgekit eval` on a JSON Lines file of prompts and references, and edgekitd
(a report request without files); the bundle's greedy tokens are transformers' `generate()` on the prompt its
own chat template gives. Then the refusals: a study for a text bundle, a prompt alone for a VLM's, a prompt too
long for the context, files sent to a text variant."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("jinja2")

from hf_text_factory import make_text_lm  # noqa: E402

from edgekit.bundle import load_bundle  # noqa: E402
from edgekit.cli.app import main  # noqa: E402
from edgekit.errors import TextModelError  # noqa: E402
from edgekit.reporter import Reporter  # noqa: E402

SAMPLES = Path(__file__).resolve().parents[1] / "models" / "samples"
TOL = 1e-4  # relative to the largest logit
PROMPT = "w3 w4 w5 w6"
LONG_PROMPT = " ".join(["w7"] * 120)  # the tiny models' context is 96 positions


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("text-bundles")


@pytest.fixture(scope="module")
def llama(root):
    return make_text_lm(root / "llama", "llama", seed=1)


@pytest.fixture(scope="module")
def llama_cpu(root, llama) -> tuple[Path, dict]:
    """`edgekit build LLAMA_DIR --target cpu --json`: the bundle and the build's figures."""
    out = root / "llama-cpu"
    rc, result = _cli(["build", str(llama.path), "--target", "cpu", "-o", str(out), "--json"])
    assert rc == 0, result
    return out, result["figures"]


@pytest.fixture(scope="module")
def vlm_bundle(root) -> Path:
    """A tiny vision-language model's bundle (edgekit's own architecture), for the refusals and the daemon."""
    from edgekit.build import build
    from edgekit.daemon.testing import write_tiny_model

    return build("x1", root / "vlm-x1", model_dir=write_tiny_model(root / "vlm"), parity=False).bundle


def _cli(argv: list[str]) -> tuple[int, dict]:
    """Run the CLI in-process with --json on stdout captured: (exit code, parsed stdout)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(argv)
    return rc, json.loads(out.getvalue()) if out.getvalue().strip() else {}


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: "), err
    assert "Traceback" not in err
    return err


# build ----------------------------------------------------------------------------------------------------------
def test_llama_builds_a_text_bundle_with_parity(llama_cpu, llama):
    out, figures = llama_cpu
    parity = figures["parity"]
    assert parity["measured"] and parity["greedy_identical"] == 1.0 and parity["max_rel_logit_error"] <= TOL
    bundle = load_bundle(out)
    assert bundle.is_text and bundle.graph_roles == ("embed_tokens", "decoder")
    assert {"vision_encoder", "preprocessor_config"}.isdisjoint(bundle.roles)
    assert (out / "tokenizer.json").read_bytes() == (llama.path / "tokenizer.json").read_bytes()
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["prompt_template"] == "[INST] {prompt} " and (gen["bos_token_id"], gen["sep_token_id"]) == (1, 4)
    assert "image_token" not in gen and gen["eos_token_id"] == llama.eos_token_id
    assert json.loads((out / "config.json").read_text())["max_positions"] == 96
    assert bundle.manifest.provenance["passes"][0]["params"]["kind"] == "decoder"


def test_mistral_builds_with_int4_and_qwen2_for_x1(root):
    """Mistral imports as LLaMA (no sliding window): `--recipe int4` by name, as for edgekit's own model; Qwen2's
    q/k/v biases and ChatML template compile for the X1 and run on its emulator."""
    mistral = make_text_lm(root / "mistral", "mistral", seed=2)
    rc, result = _cli(["build", str(mistral.path), "--recipe", "int4", "-o", str(root / "m-int4"), "--json"])
    assert rc == 0 and result["figures"]["recipe"]["name"] == "int4"
    assert result["figures"]["parity"]["measured"]  # the INT4 graphs against float transformers: measured, not 1.0
    assert load_bundle(root / "m-int4").is_text

    qwen2 = make_text_lm(root / "qwen2", "qwen2", seed=3)
    out = root / "q-x1"
    rc, result = _cli(["build", str(qwen2.path), "--target", "x1", "-o", str(out), "--no-parity", "--json"])
    assert rc == 0 and set(result["figures"]["x1_compile"]["program_bytes"]) == {"embed_tokens", "decoder"}
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["prompt_template"].endswith("<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant")
    rc, report = _cli(["run", str(out), "--prompt", PROMPT, "--max-new-tokens", "4", "--json"])
    assert rc == 0 and report["target"] == "x1" and report["timings"]["new_tokens"] >= 1
    assert report["energy_source"] == "emulated:x1" and report["study"] == "" and report["frames"] == {}
    reporter = Reporter.from_bundle(out)
    with pytest.raises(TextModelError, match="no vision graph"):
        reporter.backend.encode_images(np.zeros((1, 1, 1, 8, 8), np.float32))
    reporter.close()


def test_a_decoder_refuses_image_size(llama, root, capsys):
    assert main(["build", str(llama.path), "-o", str(root / "no"), "--image-size", "56"]) == 2
    assert "does not apply to llama: a decoder alone takes no image" in _one_line_error(capsys)
    assert not (root / "no").exists()


# serving --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_tokens_are_transformers_generate(root, llama, llama_cpu, family):
    """The bundle's prompt is the ids transformers' `apply_chat_template` gives, and its greedy report is the tokens
    `generate()` writes from them (both stop at the model's end token)."""
    if family == "llama":
        lm, bundle = llama, llama_cpu[0]
    else:
        lm = make_text_lm(root / "qwen2-parity", "qwen2", seed=4)
        bundle = root / "qwen2-cpu"
        assert main(["build", str(lm.path), "-o", str(bundle), "--no-parity"]) == 0
    reporter = Reporter.from_bundle(bundle, threads=1)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(lm.path)  # tokenizer.json as it is
    for prompt in (PROMPT, "w11 w12"):
        messages = [{"role": "user", "content": prompt}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
        assert reporter.prompt("", prompt).ids == ids
        ours: list[int] = []
        keep = ours.append
        report = reporter.report_text(
            prompt, reporter.options(max_new_tokens=12), on_token=lambda t, _i, keep=keep: keep(t)
        )
        with torch.no_grad():
            x = torch.tensor([ids])
            out = lm.model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=12,
                do_sample=False,
                eos_token_id=lm.eos_token_id,
                pad_token_id=0,
            )[0, len(ids) :].tolist()
        theirs = out[:-1] if out and out[-1] == lm.eos_token_id else out
        assert ours == theirs and len(ours) >= 1
        assert report.text == reporter.tokenizer.decode(theirs, skip_special_tokens=True).strip()
    reporter.close()


def test_run_writes_a_text_report_and_refuses_what_it_cannot_serve(llama_cpu, vlm_bundle, capsys):
    bundle = str(llama_cpu[0])
    rc, report = _cli(["run", bundle, "--prompt", PROMPT, "--max-new-tokens", "5", "--json"])
    assert rc == 0 and report["text"] and report["model"] == "llama" and report["target"] == "cpu"
    t = report["timings"]
    assert t["new_tokens"] >= 1 and t["total_ms"] >= t["generate_ms"] > 0 and "ingest_ms" not in t
    assert "decode_tokens_per_s" in t and report["stop_reason"] in ("max_new_tokens", "stop_token")
    capsys.readouterr()

    # a study for a text bundle; a prompt alone for a VLM's; a prompt the context cannot hold; no prompt at all
    cases = [
        (["run", bundle, "-s", str(SAMPLES / "cr_chest"), "-p", "x"], "text_model", "not --study"),
        (["run", str(vlm_bundle), "-p", "Cough."], "study_required", "--study is required"),
        (["run", bundle, "-p", LONG_PROMPT], "prompt_too_long", "context of 96 positions"),
        (["run", bundle], "empty_prompt", "prompt, and the prompt is empty"),
    ]
    for argv, code, needle in cases:
        assert main(argv) == 2
        assert needle in _one_line_error(capsys)
        rc, body = _cli([*argv, "--json"])
        assert rc == 2 and body["error"]["code"] == code, body
        capsys.readouterr()


# eval -----------------------------------------------------------------------------------------------------------
def test_eval_on_prompts_and_references(llama_cpu, root, capsys):
    data = root / "notes-val.jsonl"
    lines = [
        {"prompt": PROMPT, "reference": "w1 w2 w3"},
        {"id": "nodule", "prompt": "w8", "reference": ["FINDINGS: 6 mm nodule in the right upper lobe.", "a nodule"]},
        {"prompt": "w9 w10", "reference": "No pleural effusion."},
        {"prompt": LONG_PROMPT, "reference": "too long to report"},
    ]
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    rc, result = _cli(["eval", str(llama_cpu[0]), "--data", str(data), "--json"])
    assert rc == 0
    assert (result["split"], result["samples"]) == ("notes-val", 4)
    o = result["overall"]
    assert (o["n"], o["failed"]) == (3, 1)  # the prompt too long for the context is a failure, not the end
    assert 0 <= o["bleu4"]["value"] <= 100 and 0 <= o["rouge_l"]["value"] <= 1
    assert o["finding_n"] == 2 and 0 <= o["finding_f1"]["value"] <= 1  # the two references that state findings
    assert o["latency_ms"]["p50"] > 0 and "records" not in result
    out = root / "notes-val-together.json"
    rc, together = _cli(
        ["eval", str(llama_cpu[0]), "--data", str(data), "--concurrency", "3", "-o", str(out), "--json"]
    )
    assert rc == 0 and (together["concurrency"], together["rows_max"]) == (3, 3)  # in flight, decoded together
    assert (together["overall"]["n"], together["overall"]["failed"]) == (3, 1)
    records = json.loads(out.read_text())["records"]
    assert [r["id"] for r in records][1] == "nodule" and records[3]["error"] is not None  # in the file's order

    bad = root / "bad.jsonl"
    bad.write_text('{"prompt": "w1", "reference": "x"}\n{"prompt": "w2"}\n')
    assert main(["eval", str(llama_cpu[0]), "--data", str(bad)]) == 2
    assert "line 2: needs 'reference'" in _one_line_error(capsys)
    assert main(["eval", str(llama_cpu[0])]) == 2
    assert "--data PROMPTS.jsonl" in _one_line_error(capsys)


# edgekitd -------------------------------------------------------------------------------------------------------
def test_edgekitd_writes_text_reports_for_requests_without_files(root, llama_cpu, vlm_bundle):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from edgekit.daemon.client import study_files
    from edgekit.daemon.testing import DaemonProcess

    config = root / "edgekitd.toml"
    config.write_text(
        "\n".join(
            [
                "[models]",
                'active = "notes"',
                "[[variants]]",
                'name = "notes"',
                f'bundle = "{llama_cpu[0]}"',
                "[[variants]]",
                'name = "images"',
                f'bundle = "{vlm_bundle}"',
            ]
        )
        + "\n"
    )
    with DaemonProcess(root / "state", config=config).start() as d:
        c = d.client
        fields = {"prompt": PROMPT, "max_new_tokens": "6"}
        sync = c.post_study("/v1/reports", [], fields)
        assert sync.status == 200, sync.body
        body = sync.json()
        assert body["text"] and body["variant"] == "notes" and body["timings"]["new_tokens"] >= 1
        assert "queue_ms" in body["timings"] and body["study"] == ""

        streamed = c.post_study("/v1/reports?stream=ndjson", [], fields)
        events = [json.loads(line) for line in streamed.body.decode().splitlines()]
        assert events[-1]["event"] == "report" and events[-1]["report"]["text"] == body["text"]  # greedy: same
        assert "".join(e["text"] for e in events if e["event"] == "token").strip() == body["text"]

        job = c.post_study("/v1/jobs", [], fields)
        assert job.status == 202, job.body
        done = c.wait_job(job.json()["id"])
        assert done["state"] == "succeeded" and done["report"]["text"] == body["text"]
        sr = c.get(f"/v1/jobs/{done['id']}/sr")
        assert (sr.status, sr.error_code) == (422, "text_model")

        refusals = [
            (study_files(SAMPLES / "cr_chest" / "image.dcm"), fields, "/v1/reports", 422, "text_model"),
            (study_files(SAMPLES / "cr_chest" / "image.dcm"), fields, "/v1/jobs", 422, "text_model"),
            ([], {"prompt": ""}, "/v1/reports", 422, "empty_prompt"),
            ([], {"prompt": LONG_PROMPT}, "/v1/reports", 422, "prompt_too_long"),
            ([], fields, "/v1/reports?format=sr", 422, "text_model"),
            ([], {**fields, "variant": "images"}, "/v1/reports", 422, "validation_error"),  # as before: files
        ]
        for files, form, url, status, code in refusals:
            reply = c.post_study(url, files, form)
            assert (reply.status, reply.error_code) == (status, code), (url, reply.body[:300])
        assert c.get("/v2/health/ready").status == 200


def test_edgekitd_serving_text_models_only_starts_no_ingest_process(root, llama_cpu, vlm_bundle):
    """Ingest processes start with edgekitd when a configured variant reads studies, and not for text models alone
    (they would hold memory for studies nobody can send)."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from edgekit.daemon.testing import DaemonProcess, process_tree

    def ingest_processes(variants: list[tuple[str, str]], state: str) -> int:
        config = root / f"{state}.toml"
        lines = ["[models]", f'active = "{variants[0][0]}"']
        for name, bundle in variants:
            lines += ["[[variants]]", f'name = "{name}"', f'bundle = "{bundle}"']
        config.write_text("\n".join(lines) + "\n")
        with DaemonProcess(root / state, config=config).start() as d:
            return len([p for p in process_tree(d.proc.pid) if p != d.proc.pid])

    assert ingest_processes([("notes", str(llama_cpu[0]))], "text-only") == 0
    assert ingest_processes([("notes", str(llama_cpu[0])), ("images", str(vlm_bundle))], "both") >= 1
