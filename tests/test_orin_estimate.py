"""The Orin cost model: its data file as shipped, what it refuses, and the directions its estimates must move in.

Nothing here checks the estimate against a Jetson (there is none): the tests hold the model to its own stated
formula and to the published numbers it was built from, so an edit that breaks either fails here.
"""

from __future__ import annotations

import dataclasses
import json
from importlib.resources import files

import pytest

from edgekit.errors import ConfigError
from edgekit.targets.orin.estimate import (
    DATA_FILE,
    DEVICE_FIELDS,
    Precision,
    estimate_report,
    get_device,
    known_devices,
    load_data,
    mode_rates,
    parse_data,
    preset,
    reference_checks,
    shape_from_params,
)

WANTED = {
    "agx-orin-64": {"MAXN", "50W", "30W", "15W"},
    "agx-orin-32": {"MAXN", "40W", "30W", "15W"},
    "orin-nx-16": {"MAXN", "25W", "15W", "10W"},
    "orin-nx-8": {"MAXN", "20W", "15W", "10W"},
    "orin-nano-8": {"15W", "7W"},
    "orin-nano-4": {"10W", "7W"},
    "orin-nano-8-super": {"MAXN_SUPER", "25W", "15W"},
}
INT4 = Precision(weights="int4", block=32)
FP16 = Precision(weights="fp16")


@pytest.fixture(scope="module")
def seed():
    return preset("seed-1.2b")


# --- the data file ------------------------------------------------------------------------------------------------


def test_the_data_file_ships_as_package_data():
    resource = files("edgekit.targets.orin").joinpath(DATA_FILE)
    assert resource.is_file()
    data = load_data()
    for device, modes in WANTED.items():
        assert modes <= set(data.devices[device].modes), device
    assert known_devices()["agx-orin-64"] == ("MAXN", "50W", "30W", "15W")


def test_every_device_number_names_a_source_with_title_and_url():
    data = load_data()
    for src_id, src in data.sources.items():
        assert src["kind"] == "published", src_id
        assert src["title"].strip() and src["url"].startswith("https://"), src_id
    numeric = [f for f in DEVICE_FIELDS if f not in ("name", "label", "unverified")]
    for dev in data.devices.values():
        assert set(numeric) <= set(dev.provenance), (dev.id, set(numeric) - set(dev.provenance))
        assert all(s in data.sources for s in dev.provenance.values()), dev.id
        assert set(dev.unverified) <= set(numeric), dev.id
        for m in dev.modes.values():
            assert m.source in data.sources, (dev.id, m.name)
            assert set(m.unconstrained) <= {"gpu_mhz", "emc_mhz", "dla_mhz", "budget_w"}, (dev.id, m.name)
            assert 0 < m.gpu_tpcs <= dev.gpu_tpcs and 0 < m.gpu_mhz <= dev.gpu_max_mhz, (dev.id, m.name)
            assert 0 < m.emc_mhz <= dev.emc_max_mhz and m.dla_mhz <= dev.dla_max_mhz, (dev.id, m.name)


def test_every_assumption_is_marked_and_says_why():
    raw = load_data().raw
    for name, entry in raw["assumptions"].items():
        assert isinstance(entry["value"], (int, float)) and len(entry["basis"]) > 40, name
    for ref in raw["references"].values():
        assert ref["source"] in raw["sources"]


def test_derived_peaks_reproduce_the_published_module_totals():
    """GPU TPCs x clock and DLAs x clock at the device maxima add up to NVIDIA's headline TOPS, and bus width x
    EMC clock to the published bandwidth: the scaling rule and the per-device numbers agree."""
    data = load_data()
    for dev in data.devices.values():
        top = max(dev.modes.values(), key=lambda m: (m.gpu_tpcs * m.gpu_mhz, m.emc_mhz))
        full = dataclasses.replace(top, gpu_tpcs=dev.gpu_tpcs, gpu_mhz=dev.gpu_max_mhz, dla_mhz=dev.dla_max_mhz)
        r = mode_rates(dev, full)
        total = r.gpu_sparse_int8_tops + 2 * r.dla_int8_tops
        assert total == pytest.approx(dev.total_sparse_int8_tops, rel=0.06), dev.id
        peak_bw = mode_rates(dev, dataclasses.replace(full, emc_mhz=dev.emc_max_mhz)).bandwidth_gbs
        assert peak_bw == pytest.approx(dev.memory_bandwidth_gbs, rel=0.02), dev.id


def test_per_mode_scaling_matches_nvidias_gpu_and_dla_table_for_agx_orin_64():
    """dla-readme: GPU and 2x DLA sparse INT8 TOPS by power mode (JetPack 5.1 clocks). Its 15W GPU figure (14
    TOPS, 2 TPCs) predates the 3-TPC 15W mode in the nvpmodel file we use, so only the DLA is compared there."""
    dev = get_device("agx-orin-64")
    gpu = {"MAXN": 171, "50W": 109, "30W": 41}
    dla = {"MAXN": 105, "50W": 92, "30W": 90, "15W": 40}
    for mode, tops in gpu.items():
        assert mode_rates(dev, dev.mode(mode)).gpu_sparse_int8_tops == pytest.approx(tops, rel=0.05), mode
    for mode, tops in dla.items():
        assert 2 * mode_rates(dev, dev.mode(mode)).dla_int8_tops == pytest.approx(tops, rel=0.05), mode


def test_a_bad_data_file_is_refused_naming_the_device_and_field():
    raw = json.loads(json.dumps(load_data().raw))
    raw["devices"]["agx-orin-64"]["provenance"]["gpu_max_mhz"] = "a-forum-post"
    with pytest.raises(ConfigError, match="agx-orin-64.*gpu_max_mhz.*a-forum-post"):
        parse_data(raw, "devices.toml")
    raw = json.loads(json.dumps(load_data().raw))
    del raw["devices"]["orin-nx-8"]["modes"]["15W"]["emc_mhz"]
    with pytest.raises(ConfigError, match="orin-nx-8.*15W.*emc_mhz"):
        parse_data(raw, "devices.toml")


# --- refusals and labels ------------------------------------------------------------------------------------------


def test_an_unknown_device_is_refused_in_one_line_listing_the_known_ones(seed):
    with pytest.raises(ConfigError) as err:
        estimate_report(seed, device="xavier-nx")
    msg = str(err.value)
    assert "\n" not in msg and "xavier-nx" in msg
    assert all(d in msg for d in known_devices())


def test_an_unknown_mode_is_refused_in_one_line_listing_the_devices_modes(seed):
    with pytest.raises(ConfigError) as err:
        estimate_report(seed, device="orin-nx-16", mode="45W")
    msg = str(err.value)
    assert "\n" not in msg and "45W" in msg and "MAXN, 25W, 15W, 10W" in msg
    assert estimate_report(seed, "orin-nx-16", "mode_15w").mode.name == "15W"  # nvpmodel names, any case
    assert estimate_report(seed, "nx16", "15w").device.id == "orin-nx-16"  # the label works as an id


def test_bad_workloads_and_models_are_refused(seed, tmp_path):
    with pytest.raises(ConfigError, match="new_tokens"):
        estimate_report(seed, new_tokens=0)
    with pytest.raises(ConfigError, match="weights"):
        estimate_report(seed, weights="int3")
    with pytest.raises(ConfigError, match="neither a bundle .directory or .ekb. nor a model preset"):
        estimate_report(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="unknown assumption"):
        estimate_report(seed, assumptions={"magic": 1.0})
    with pytest.raises(ConfigError, match="has no DLA"):
        estimate_report(seed, "orin-nano-8", "15W", weights=Precision(weights="int8"), vision_on="dla")
    with pytest.raises(ConfigError, match="INT8 vision weights"):
        estimate_report(seed, weights=FP16, vision_on="dla")


def test_labels_name_the_module_and_the_mode(seed):
    assert estimate_report(seed).source == "estimated:orin-agx64-maxn"
    assert estimate_report(seed, "orin-nx-16", "25W").source == "estimated:orin-nx16-25w"
    est = estimate_report(seed, "orin-nano-8-super", "MAXN_SUPER")
    assert est.source == "estimated:orin-nano8s-maxn-super"
    fig = est.figure()
    assert fig["source"].startswith("estimated:orin-nano8s-maxn-super (")
    assert "not measured on a device" in fig["source"]
    assert fig["latency_ms"] == pytest.approx(est.latency_ms, abs=1e-3)


# --- the model's directions ---------------------------------------------------------------------------------------


def test_energy_is_power_times_time_and_power_stays_between_idle_and_budget(seed):
    est = estimate_report(seed, weights=INT4)
    assert est.energy_j == pytest.approx(sum(p["power_w"] * p["time_ms"] / 1e3 for p in est.breakdown))
    assert est.latency_ms == pytest.approx(sum(p["time_ms"] for p in est.breakdown))
    idle = est.assumptions["idle_fraction"] * est.mode.budget_w
    for p in est.breakdown:
        assert idle < p["power_w"] <= est.mode.budget_w, p["phase"]
    assert [p["phase"] for p in est.breakdown] == ["vision", "prefill", "decode"]
    assert est.phase("decode").steps == est.report.new_tokens - 1  # the prefill yields the first token


def test_int4_decodes_faster_than_fp16_everywhere_and_by_the_weight_bytes(seed):
    for device, modes in known_devices().items():
        for mode in modes:
            fp16 = estimate_report(seed, device, mode, weights=FP16)
            int4 = estimate_report(seed, device, mode, weights=INT4)
            assert int4.ms_per_token < fp16.ms_per_token, (device, mode)
            assert int4.energy_j < fp16.energy_j, (device, mode)
    fp16, int4 = estimate_report(seed, weights=FP16), estimate_report(seed, weights=INT4)
    bytes_ratio = fp16.phase("decode").bytes / int4.phase("decode").bytes
    assert 3.3 < bytes_ratio < 2 / (0.5 + 2 / 32)  # FP16 vs 4 bits + an FP16 scale per 32, less the FP16 KV reads
    assert fp16.phase("decode").memory_s / int4.phase("decode").memory_s == pytest.approx(bytes_ratio)
    # weight-only INT4 computes in FP16: the compute-bound prefill takes the same math time
    assert int4.phase("prefill").compute_s == pytest.approx(fp16.phase("prefill").compute_s)
    assert fp16.phase("decode").bound == int4.phase("decode").bound == "memory"


def test_latency_never_rises_with_the_power_mode(seed):
    for device, modes in known_devices().items():
        dev = get_device(device)
        ordered = sorted(modes, key=lambda m: (dev.mode(m).budget_w, dev.mode(m).gpu_tpcs * dev.mode(m).gpu_mhz))
        for weights in (FP16, INT4):
            times = [estimate_report(seed, device, m, weights=weights).latency_ms for m in ordered]
            assert all(a >= b - 1e-9 for a, b in zip(times, times[1:])), (device, ordered, times)
    agx = [estimate_report(seed, "agx-orin-64", m, weights=INT4) for m in ("15W", "30W", "50W", "MAXN")]
    assert agx[0].latency_ms > agx[-1].latency_ms and agx[0].avg_power_w < agx[-1].avg_power_w


def test_decode_time_follows_memory_bandwidth(seed):
    dev = get_device("agx-orin-64")
    half = dataclasses.replace(dev, memory_bus_bits=dev.memory_bus_bits // 2)
    full_est, half_est = estimate_report(seed, dev, weights=INT4), estimate_report(seed, half, weights=INT4)
    assert half_est.rates.bandwidth_gbs == pytest.approx(full_est.rates.bandwidth_gbs / 2)
    assert half_est.phase("decode").memory_s == pytest.approx(2 * full_est.phase("decode").memory_s)
    assert half_est.latency_ms > full_est.latency_ms
    better = estimate_report(seed, weights=INT4, assumptions={"bandwidth_fraction": 0.9})
    assert better.latency_ms < full_est.latency_ms
    # the 15W mode caps EMC at 2133 MHz: two thirds of the bandwidth
    assert estimate_report(seed, dev, "15W").rates.bandwidth_gbs == pytest.approx(204.8 * 2133 / 3200)


def test_longer_reports_cost_more_and_the_kv_cache_is_read_each_step(seed):
    short = estimate_report(seed, weights=INT4, new_tokens=32)
    long = estimate_report(seed, weights=INT4, new_tokens=128)
    assert long.latency_ms > short.latency_ms and long.energy_j > short.energy_j
    per_step = (long.phase("decode").bytes / long.phase("decode").steps) - (
        short.phase("decode").bytes / short.phase("decode").steps
    )
    assert per_step == pytest.approx(48 * seed.kv_bytes_per_token())  # mean context grows by (127 - 31) / 2 tokens


def test_a_vision_encoder_on_the_dla_is_labelled_and_timed_on_the_dla(seed):
    gpu = estimate_report(seed, weights=Precision(weights="int4", vision="int8"))
    dla = estimate_report(seed, weights=Precision(weights="int4", vision="int8"), vision_on="dla")
    assert dla.phase("vision").on == "dla" and gpu.phase("vision").on == "gpu"
    assert dla.phase("vision").compute_s != gpu.phase("vision").compute_s
    assert dla.phase("decode").time_s == pytest.approx(gpu.phase("decode").time_s)


def test_a_model_known_only_by_its_size_is_estimated(seed):
    shape = shape_from_params(1.2e9, layers=22, hidden=2048, heads=32, kv_heads=4)
    assert shape.total_params() == pytest.approx(1.2e9, rel=0.005)
    assert estimate_report(shape, weights="int4").latency_ms == pytest.approx(
        estimate_report(seed, weights=Precision(weights="int4", block=32)).latency_ms, rel=0.05
    )
    with pytest.raises(ConfigError, match="params"):
        shape_from_params(1e6, layers=22, hidden=2048, heads=32, kv_heads=4)


def test_the_decode_rate_stays_near_nvidias_published_orin_nano_measurements():
    """The one outside check: MLC INT4 tokens/s NVIDIA published for Orin Nano (devices.toml [references])."""
    checks = reference_checks()
    assert len(checks) >= 4
    for c in checks:
        assert 0.75 < c["ratio"] < 1.25, c


# --- bundles ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def int4_bundle(tmp_path_factory):
    from edgekit.build import build

    out = tmp_path_factory.mktemp("orin-estimate") / "radreport-tiny-int4"
    build("cpu", out, recipe="int4", parity=False)
    return out


def test_a_bundle_is_read_for_its_shape_precision_and_report_length(int4_bundle):
    est = estimate_report(int4_bundle, "orin-nx-16", "15W")
    tiny = preset("radreport-tiny")
    assert est.shape.hidden == tiny.hidden and est.shape.vision.image_tokens == 16
    assert est.precision.weights == "int4" and est.precision.lm_head == "int8" and est.precision.block == 128
    assert est.precision.vision == "int4" and est.precision.embedding == "int4"
    gen = json.loads((int4_bundle / "generation_config.json").read_text())
    assert est.report.new_tokens == gen["max_new_tokens"]
    assert est.report.prompt_tokens > 2  # <bos> + the template's tokens + <sep>
    assert est.facts["bundle_target"] == "cpu" and est.facts["graph_bytes"]["decoder"] > 0
    assert any("max_new_tokens" in n for n in est.notes)
    assert est.source == "estimated:orin-nx16-15w"
    # a tiny model is overhead-bound: launches and host work, not bytes, set its decode time
    assert est.phase("decode").bound == "overhead"
    assert estimate_report(int4_bundle, weights="fp16").precision.weights == "fp16"  # an override wins


def test_a_packed_bundle_gives_the_same_estimate_and_a_broken_one_is_refused(int4_bundle, tmp_path):
    from edgekit.bundle import pack_bundle
    from edgekit.errors import BundleError

    packed = pack_bundle(int4_bundle, tmp_path / "radreport-tiny-int4.ekb")
    assert estimate_report(packed).latency_ms == pytest.approx(estimate_report(int4_bundle).latency_ms)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "manifest.json").write_text("{not json")
    with pytest.raises(BundleError, match="manifest is not valid JSON"):
        estimate_report(broken)
