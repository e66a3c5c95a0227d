"""edgekitd's input-adaptive precision gate (`[precision_gate]`, off unless configured): a study whose display
entropy is below the threshold is reported by the higher-precision variant, and the report says why. Real
daemon, real DICOM uploads written by pydicom; the two variants are two real bundles."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from edgekit.daemon.client import study_files  # noqa: E402
from edgekit.daemon.config import load_config  # noqa: E402
from edgekit.daemon.testing import DaemonProcess, write_tiny_model  # noqa: E402
from edgekit.errors import ConfigError  # noqa: E402
from edgekit.ingest import display_entropy_bits, load_study  # noqa: E402

from ingest_factory import make_dataset, save  # noqa: E402


def _dicom(path, pixels):
    return save(make_dataset(pixels.astype(np.uint16), window=(2048, 4096)), path)


@pytest.fixture(scope="module")
def studies(tmp_path_factory):
    root = tmp_path_factory.mktemp("gate")
    flat = np.full((32, 32), 1000)
    flat[8:24, 8:24] = 3000  # two grey levels: 1 bit
    noisy = np.random.default_rng(0).integers(0, 4096, (32, 32))  # every display level: about 8 bits
    return _dicom(root / "flat.dcm", flat), _dicom(root / "noisy.dcm", noisy)


def test_entropy_of_the_display_values_is_what_the_gate_reads(studies):
    flat, noisy = (display_entropy_bits(load_study(p).frames) for p in studies)
    assert flat == pytest.approx(0.811, abs=0.01)  # 3/4 of pixels at one level, 1/4 at the other
    assert noisy > 7.5


def test_low_entropy_studies_go_to_the_higher_precision_variant_and_say_so(tmp_path, studies):
    from edgekit.build import build

    model = write_tiny_model(tmp_path / "model")
    build("cpu", tmp_path / "int8", model_dir=model, parity=False, recipe="int8")
    build("cpu", tmp_path / "fp32", model_dir=model, parity=False)
    config = tmp_path / "edgekitd.toml"
    config.write_text(
        f'[models]\nactive = "int8"\n'
        f'[[variants]]\nname = "int8"\nbundle = "{tmp_path / "int8"}"\n'
        f'[[variants]]\nname = "fp32"\nbundle = "{tmp_path / "fp32"}"\n'
        '[precision_gate]\nvariant = "fp32"\nentropy_below = 4.2\n'
    )
    flat, noisy = studies
    with DaemonProcess(tmp_path / "state", config=config).start() as d:
        low = d.client.report(flat).json()
        assert low["variant"] == "fp32", low
        gate = low["routing"]["precision_gate"]
        assert gate["routed"] and gate["entropy_bits"] < 4.2 and gate["variant"] == "fp32"

        high = d.client.report(noisy).json()
        assert high["variant"] == "int8" and high["routing"]["precision_gate"]["routed"] is False

        asked = d.client.report(flat, variant="int8").json()  # a request that names its variant keeps it
        assert asked["variant"] == "int8" and "routing" not in asked

        job = d.client.post_study("/v1/jobs", study_files(flat))
        assert job.status == 202, job.json()
        state = d.client.wait_job(job.json()["id"])
        assert state["state"] == "succeeded" and state["report"]["variant"] == "fp32"
        assert state["report"]["routing"]["precision_gate"]["routed"]

        metrics = d.client.get("/metrics").body.decode()
        assert 'edgekit_precision_gate_total{route="higher_precision"} 2.0' in metrics
        assert 'edgekit_precision_gate_total{route="as_served"} 1.0' in metrics


@pytest.mark.parametrize(
    "table,message",
    [
        ('variant = "nope"', "precision_gate.variant names an unknown variant 'nope'"),
        ('variant = "a"\nentropy_below = 9', "precision_gate.entropy_below must be in (0, 8] bits"),
        ('variant = "a"\nstatistic = "x"', "unknown key precision_gate.statistic"),
    ],
)
def test_a_bad_gate_is_refused_at_load_naming_the_key(tmp_path, table, message):
    config = tmp_path / "edgekitd.toml"
    config.write_text(f'[[variants]]\nname = "a"\nbundle = "b"\n[precision_gate]\n{table}\n')
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(config)
