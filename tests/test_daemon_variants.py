"""Two variants (two tiny random models) in one daemon: a live switch with requests in flight, none dropped, and
keep-alive unloading of the idle variant with on-demand reload; readiness stays 200 throughout."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from edgekit.daemon.client import study_files  # noqa: E402
from edgekit.daemon.testing import DaemonProcess, write_tiny_model  # noqa: E402

SAMPLES = Path(__file__).resolve().parents[1] / "models" / "samples"
KEEP_ALIVE_S = 1.0
N_BEFORE, N_AFTER = 24, 4  # a backlog on "a" several times longer than loading "b" takes, even on busy cores


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    from edgekit.build import build

    root = tmp_path_factory.mktemp("edgekitd-variants")
    config = root / "edgekitd.toml"
    lines = ["[models]", 'active = "a"', f"keep_alive_s = {KEEP_ALIVE_S}"]
    for name, seed in (("a", 1), ("b", 2)):
        build(
            "cpu", root / f"bundle-{name}", model_dir=write_tiny_model(root / f"model-{name}", seed=seed), parity=False
        )
        lines += ["[[variants]]", f'name = "{name}"', f'bundle = "bundle-{name}"']
    config.write_text("\n".join(lines) + "\n")
    with DaemonProcess(root / "state", config=config, extra_args=["--max-queue", "32"]).start() as d:
        yield d


def _variants(d) -> dict[str, dict]:
    return {v["name"]: v for v in d.client.get("/v1/variants").json()["variants"]}


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise TimeoutError(what)


def test_switch_with_requests_in_flight_drops_none_and_old_ones_finish_on_the_old(daemon):
    files = study_files(SAMPLES / "cr_chest" / "image.dcm")
    assert daemon.client.get("/v1/variants").json()["active"] == "a"
    assert not _variants(daemon)["b"]["loaded"]

    def one(_):
        r = daemon.client.post_study("/v1/reports", files, {"max_new_tokens": "120"})
        return r.status, r.json().get("variant")

    readiness: list[int] = []
    probing = threading.Event()

    def probe():
        while not probing.is_set():
            readiness.append(daemon.client.get("/v2/health/ready").status)
            time.sleep(0.02)

    with ThreadPoolExecutor(N_BEFORE + 1) as pool:
        prober = pool.submit(probe)
        before = [pool.submit(one, i) for i in range(N_BEFORE)]

        def accepted():  # every request holds a queue slot, is running, or is done (uploads are ingested in turn)
            r = daemon.client.get("/v2/health/ready").json()
            return r["queue_depth"] + r["running"] + sum(f.done() for f in before) >= N_BEFORE

        _wait(accepted, 30, "requests accepted")
        switch = daemon.client.put_json("/v1/variants/active", {"name": "b"})
        in_flight_at_switch = sum(not f.done() for f in before)
        assert switch.status == 200 and switch.json()["active"] == "b"
        with ThreadPoolExecutor(N_AFTER) as pool2:
            after = list(pool2.map(one, range(N_AFTER)))
        old = [f.result() for f in before]
        probing.set()
        prober.result()
    assert in_flight_at_switch >= 1, "every request ended before the switch: nothing was tested"
    assert old == [(200, "a")] * N_BEFORE, old
    assert after == [(200, "b")] * N_AFTER, after
    assert set(readiness) == {200}, readiness
    print(
        f"switch: {N_BEFORE} accepted on a ({in_flight_at_switch} still in flight at the switch) all finished on "
        f"a; {N_AFTER} after on b; 0 dropped; {len(readiness)} readiness probes all 200"
    )


def test_idle_variant_unloads_after_keep_alive_and_loads_again_on_demand(daemon):
    if daemon.client.get("/v1/variants").json()["active"] != "b":
        assert daemon.client.put_json("/v1/variants/active", {"name": "b"}).status == 200
    files = study_files(SAMPLES / "cr_chest" / "image.dcm")
    # "a" is idle and not active: it goes after the keep-alive; "b" is active and stays
    _wait(lambda: not _variants(daemon)["a"]["loaded"], 10 * KEEP_ALIVE_S + 5, "a unloaded")
    assert re.search(r'edgekitd_variant_loaded\{variant="a"\} 0\.0', daemon.client.get("/metrics").body.decode())
    time.sleep(KEEP_ALIVE_S * 1.5)
    assert _variants(daemon)["b"]["loaded"], "the active variant must stay loaded"
    assert daemon.client.get("/v2/health/ready").status == 200
    r = daemon.client.post_study("/v1/reports", files, {"variant": "a"})
    assert r.status == 200 and r.json()["variant"] == "a"
    assert _variants(daemon)["a"]["loaded"]
    assert re.search(r'edgekitd_variant_loaded\{variant="a"\} 1\.0', daemon.client.get("/metrics").body.decode())
    _wait(lambda: not _variants(daemon)["a"]["loaded"], 10 * KEEP_ALIVE_S + 5, "a unloaded again")


def test_a_variants_settings_reach_its_target_at_load(tmp_path):
    from edgekit.build import build
    from edgekit.daemon.config import DaemonConfig, Variant
    from edgekit.daemon.variants import VariantRegistry
    from edgekit.errors import ConfigError

    x1 = build("x1", tmp_path / "x1", parity=False).bundle
    cpu = build("cpu", tmp_path / "cpu", model_dir=write_tiny_model(tmp_path / "m"), parity=False).bundle
    cfg = DaemonConfig(
        state_dir=tmp_path / "state",
        variants=(
            Variant("int4", x1),
            Variant("int4-dss25", x1, {"sparsity_target": 0.25}),
            Variant("cpu-dss", cpu, {"sparsity_target": 0.5}),
        ),
    )
    registry = VariantRegistry(cfg)
    assert registry.activate("int4").reporter.backend.settings["sparsity_target"] == 0.38  # the bundle's own
    assert registry.activate("int4-dss25").reporter.backend.settings["sparsity_target"] == 0.25
    assert {v["name"]: v["settings"] for v in registry.describe()}["int4-dss25"] == {"sparsity_target": 0.25}
    with pytest.raises(ConfigError, match="sparsity_target"):  # the cpu target knows no DSS: refused, by name
        registry.activate("cpu-dss")
