"""edgekitd with a [policy]: two tiny variants, a profile naming their bundles by digest, and a fixture sysfs tree
(an Orin Nano's INA3221 and thermal zones, plus a battery) that the test changes as the day goes: the daemon steps
down when the battery runs low, back up after the window, answers GET/PUT /v1/policy, bills each report's energy
with the sensor's name, and refuses a profile measured on other bundles."""

from __future__ import annotations

import re
import shutil
import time
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from edgekit.bundle import load_bundle  # noqa: E402
from edgekit.daemon.testing import DaemonProcess, write_tiny_model  # noqa: E402
from edgekit.pareto import Point, Profile, write_profile  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "sysfs"
SAMPLES = Path(__file__).resolve().parents[1] / "models" / "samples"
WINDOW_S = 2.0


def _point(name: str, bundle: Path, f1: float, energy_j: float, p50_ms: float, **settings) -> Point:
    return Point(
        id=name, bundle=str(bundle), bundle_digest=load_bundle(bundle).digest, target="cpu", settings=settings,
        f1=f1, f1_ci=(f1 - 0.01, f1 + 0.01), hallucination_rate=0.0, latency_p50_ms=p50_ms,
        latency_p95_ms=p50_ms * 1.2, energy_j=energy_j, energy_source="estimated:test-profile",
        peak_rss_mib=100.0, count=300,
    )  # fmt: skip


def _battery(root: Path, percent: int, status: str, ac: bool) -> None:
    bat, mains = root / "sys/class/power_supply/BAT0", root / "sys/class/power_supply/AC"
    for d, files in ((bat, {"type": "Battery", "capacity": str(percent), "status": status}),
                     (mains, {"type": "Mains", "online": "1" if ac else "0"})):  # fmt: skip
        d.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (d / name).write_text(text + "\n")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from edgekit.build import build

    root = tmp_path_factory.mktemp("edgekitd-policy")
    bundles = {}
    for name, seed in (("big", 1), ("small", 2)):
        bundles[name] = root / f"bundle-{name}"
        build("cpu", bundles[name], model_dir=write_tiny_model(root / f"model-{name}", seed=seed), parity=False)
    sysfs = root / "sysfs"
    shutil.copytree(FIXTURES / "orin_nano", sysfs)
    _battery(sysfs, 90, "Charging", ac=True)
    write_profile(
        Profile(
            [
                _point("big", bundles["big"], 0.99, 10.0, 1000),
                _point("small", bundles["small"], 0.96, 3.0, 500),
                _point("short", bundles["small"], 0.95, 2.0, 300, max_new_tokens=3),  # a length cap: applied
                _point("dss", bundles["small"], 0.99, 0.5, 100, sparsity_target=0.5),  # a load-time knob: left out
            ],
            split={"name": "test", "count": 300},
        ),
        root / "pareto.json",
    )
    return root, bundles, sysfs


def _config(root: Path, bundles: dict, **policy) -> Path:
    lines = ["[models]", 'active = "big"']
    for name, bundle in bundles.items():
        lines += ["[[variants]]", f'name = "{name}"', f'bundle = "{bundle}"']
    lines += ["[policy]", 'profile = "pareto.json"', 'signals_root = "sysfs"', "tick_s = 0.1", f"window_s = {WINDOW_S}"]
    lines += [f"{k} = {v!r}".replace("'", '"') for k, v in policy.items()]
    path = root / "edgekitd.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _wait_point(d: DaemonProcess, point: str, timeout: float = 60.0) -> dict:
    """Until `point` is chosen and its variant serves: the policy names its choice before the variant has loaded."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = d.client.get("/v1/policy").json()
        variant = {p["id"]: p["variant"] for p in state["front"]}.get(point)
        if state["point"] == point and state["variant"] == variant:
            return state
        time.sleep(0.1)
    raise TimeoutError(f"policy never served {point}: {state}")


def test_the_policy_follows_the_battery_and_answers_its_api(setup):
    root, bundles, sysfs = setup
    config = _config(root, bundles, mode="performance", quality_floor_f1=0.9)
    with DaemonProcess(root / "state", config=config).start() as d:
        state = _wait_point(d, "big")
        assert state["mode"] == "performance" and state["variant"] == "big"
        assert {p["id"] for p in state["front"]} == {"big", "small", "short"}
        assert "1 point(s) of variant small were measured with other load-time settings" in d.log.read_text()

        _battery(sysfs, 15, "Discharging", ac=False)  # unplugged and low: saver at the next tick
        t0 = time.monotonic()
        state = _wait_point(d, "short")
        # within a tick, plus loading and warming the next variant: that part is the daemon's own figure, so a slow
        # load on 2 busy cores is not taken for a slow policy
        small = {v["name"]: v for v in d.client.get("/v1/variants").json()["variants"]}["small"]
        assert time.monotonic() - t0 - (small["load_ms"] + small["warm_ms"]) / 1e3 < 10
        assert state["decision"]["reason"] == "battery"
        assert state["signals"]["battery_pct"] == 15 and state["signals"]["on_battery"] is True
        assert state["signals"]["power_source"].startswith("measured:ina3221")

        r = d.client.report(SAMPLES / "cr_chest" / "image.dcm")
        body = r.json()
        assert r.status == 200 and body["variant"] == "small" and body["timings"]["new_tokens"] <= 3  # the cap
        assert body["energy_j"] > 0 and body["energy_source"].startswith("measured:ina3221")
        r = d.client.report(SAMPLES / "cr_chest" / "image.dcm", max_new_tokens="4", quality="max")
        assert r.json()["variant"] == "big"  # a per-request override within the policy

        _battery(sysfs, 95, "Charging", ac=True)  # back on the charger: the step up waits for the window
        t0 = time.monotonic()
        early = d.client.get("/v1/policy").json()["point"]
        assert early == "short" or time.monotonic() - t0 >= WINDOW_S * 0.9  # (a slow GET may see the window pass)
        _wait_point(d, "big")
        assert time.monotonic() - t0 >= WINDOW_S * 0.9

        r = d.client.put_json("/v1/policy", {"mode": "saver"})
        assert r.status == 200 and r.json()["point"] == "short" and r.json()["mode"] == "saver"
        for bad, needle in (({"mode": "turbo"}, "mode must be one of"), ({"bogus": 1}, "unknown policy key")):
            r = d.client.put_json("/v1/policy", bad)
            assert r.status == 400 and needle in r.json()["error"]["message"], r.json()

        metrics = d.client.get("/metrics").body.decode()
        assert re.search(r'edgekit_policy_switches_total\{from="big",reason="battery",to="short"\} 1\.0', metrics)
        assert 'edgekit_active_variant{variant="small"} 1.0' in metrics
        assert re.search(r'edgekit_energy_joules_total\{source="measured:ina3221[^"]*",variant="small"\}', metrics)
        assert "edgekit_power_watts{" in metrics
        assert "Discharging" not in d.log.read_text()  # logs say why, with no file contents beyond the figures


def test_a_profile_of_other_bundles_is_refused_at_start_naming_the_file(setup, tmp_path):
    root, bundles, _ = setup
    other = tmp_path / "other"
    shutil.copytree(root, other, ignore=shutil.ignore_patterns("state*"))
    manifest = other / "bundle-small" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"name"', '"name" ', 1))  # same files, another digest
    config = _config(other, {k: other / v.name for k, v in bundles.items()}, mode="balanced")
    d = DaemonProcess(other / "state", config=config)
    with pytest.raises(RuntimeError) as err:
        d.start(wait_ready=30)
    assert "pareto.json" in str(err.value) and "no point for variant 'small'" in str(err.value)


def test_one_bundle_listed_dense_and_sparse_gets_each_its_own_points(setup, tmp_path, caplog):
    from edgekit.daemon.config import load_config
    from edgekit.daemon.policy_loop import match_profile
    from edgekit.daemon.variants import VariantRegistry
    from edgekit.errors import ConfigError

    root, bundles, _ = setup

    def config(*variants: tuple[str, str]) -> Path:
        path = tmp_path / "edgekitd.toml"
        tables = [f'[[variants]]\nname = "{n}"\nbundle = "{bundles["small"]}"\n{extra}' for n, extra in variants]
        path.write_text("\n".join(tables) + f'\n[policy]\nprofile = "{root / "pareto.json"}"\n')
        return path

    cfg = load_config(config(("small", ""), ("small-dss", "settings = { sparsity_target = 0.5 }")))
    caplog.set_level("INFO", logger="edgekitd")
    by_variant: dict[str, set] = {}
    for p in match_profile(cfg, VariantRegistry(cfg)):
        by_variant.setdefault(p.settings["variant"], set()).add(p.id)
    assert by_variant == {"small": {"small", "short"}, "small-dss": {"dss"}}  # the DSS point is the sparse one's
    assert "3 of 3 points were measured one report at a time" in caplog.text  # no point has max_batch
    cfg = load_config(config(("small", ""), ("small-dss", "settings = { sparsity_target = 0.38 }")))
    with pytest.raises(ConfigError, match=r"no point for variant 'small-dss' with settings \{'sparsity_target': 0.38"):
        match_profile(cfg, VariantRegistry(cfg))
    with pytest.raises(ConfigError, match=r"variants\[1\].settings must be a table of scalars"):
        load_config(config(("small", ""), ("bad", "settings = { dss = [1] }")))
    bad = tmp_path / "bad-pareto.json"
    write_profile(Profile([_point("zero", bundles["small"], 0.96, 3.0, 500, max_batch=0)]), bad)
    cfg = load_config(config(("small", "")))
    with pytest.raises(ConfigError, match=r"point 'zero' is malformed \(max_batch must be an integer >= 1, not 0\)"):
        match_profile(replace(cfg, policy_profile=bad), VariantRegistry(cfg))


def test_the_served_points_batch_size_caps_the_engines_rows(setup, tmp_path):
    """A point measured with `max_batch` (edgekit pareto --max-batch) caps the served variant's engine at its batch
    size, which /metrics shows: concurrent reports under a one-at-a-time point each decode alone
    (`decode_batch_mean` 1), and the batched point gives the engine its rows back. (Whether concurrent reports then
    share steps depends on their timing: tests/test_engine.py holds the engine to that.)"""
    from concurrent.futures import ThreadPoolExecutor

    root, bundles, _ = setup
    write_profile(
        Profile(
            [
                _point("alone", bundles["small"], 0.96, 3.0, 500, max_batch=1),
                _point("batched", bundles["small"], 0.96, 1.0, 900, max_batch=4),
            ],
            split={"name": "test", "count": 300},
        ),
        tmp_path / "pareto.json",
    )
    config = tmp_path / "edgekitd.toml"
    config.write_text(
        f'[[variants]]\nname = "small"\nbundle = "{bundles["small"]}"\n'
        f'[policy]\nprofile = "{tmp_path / "pareto.json"}"\nmode = "fixed"\nfixed = "alone"\ntick_s = 0.1\n'
    )
    study = SAMPLES / "cr_chest" / "image.dcm"

    def shared(d: DaemonProcess) -> list[float]:
        with ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(lambda _: d.client.report(study, max_new_tokens="24"), range(12)))
        assert all(r.status == 200 for r in replies), [r.json() for r in replies if r.status != 200]
        return [r.json()["timings"]["decode_batch_mean"] for r in replies]

    def rows_max(d: DaemonProcess) -> float:
        metrics = d.client.get("/metrics").body.decode()
        found = re.search(r'edgekitd_engine_rows_max\{variant="small"\} ([0-9.]+)', metrics)
        assert found, "no engine row gauge for the loaded variant"
        return float(found.group(1))

    with DaemonProcess(tmp_path / "state", config=config).start() as d:
        _wait_point(d, "alone")
        assert set(shared(d)) == {1.0}
        assert rows_max(d) == 1
        r = d.client.put_json("/v1/policy", {"fixed": "batched"})
        assert r.status == 200 and r.json()["point"] == "batched"
        deadline = time.monotonic() + 10
        while rows_max(d) != 4 and time.monotonic() < deadline:  # set at the next tick
            time.sleep(0.05)
        assert rows_max(d) == 4


def test_a_variant_loaded_between_ticks_starts_with_the_policys_row_cap(setup, tmp_path):
    """The policy's cap lives in the registry, not only in a loaded engine: a variant unloaded and loaded again by a
    request before the next tick decodes no more rows than the served point allows, and /metrics' gauge follows."""
    from edgekit.daemon.config import DaemonConfig, Variant
    from edgekit.daemon.metrics import Metrics
    from edgekit.daemon.variants import VariantRegistry
    from edgekit.errors import ConfigError

    _, bundles, _ = setup
    metrics = Metrics()
    cfg = DaemonConfig(
        state_dir=tmp_path,
        max_batch=6,
        keep_alive_s=0.0,
        active_variant="big",
        variants=(Variant("big", bundles["big"]), Variant("small", bundles["small"])),
    )
    reg = VariantRegistry(cfg, on_change=lambda _loaded: metrics.set_engine_rows(reg.rows_max()))
    assert reg.cap_rows("small", 2) is None  # not loaded: kept for its load
    assert reg.get("small").reporter.engine.rows_max == 2
    assert reg.unload_idle(now=time.monotonic() + 1) == ["small"]
    assert 'variant="small"' not in metrics.render().decode()  # an unloaded variant has no engine to cap
    reloaded = reg.get("small")
    assert reloaded.reporter.engine.rows_max == 2
    assert 'edgekitd_engine_rows_max{variant="small"} 2.0' in metrics.render().decode()
    assert reg.cap_rows("small", None) is reloaded and reloaded.reporter.engine.rows_max == 6
    assert 'edgekitd_engine_rows_max{variant="small"} 6.0' in metrics.render().decode()  # a change is published
    assert reg.get("big").reporter.engine.rows_max == 6
    slot = reg.load_slot("small", bundles["small"])  # a rollout's gate: loaded while the old one serves
    reg.cap_rows("small", 3)  # a tick meanwhile
    reg.install("small", bundles["small"], slot)
    assert slot.reporter.engine.rows_max == 3  # it serves with the cap in force when it took over
    with pytest.raises(ConfigError, match="a row cap must be >= 1, got 0"):
        reg.cap_rows("small", 0)
    assert reg.row_caps["small"] == 3  # refused before it could reach a later load


def test_a_switch_caps_the_next_variant_before_it_serves(setup, tmp_path, monkeypatch):
    """The policy's first tick loads and activates the chosen point's variant: it is capped at the point's batch
    size by the time it is active, not a moment later (a request admitted in between would share more rows)."""
    from edgekit.daemon.config import load_config
    from edgekit.daemon.metrics import Metrics
    from edgekit.daemon.policy import Signals
    from edgekit.daemon.policy_loop import PolicyLoop
    from edgekit.daemon.variants import VariantRegistry

    _, bundles, _ = setup
    write_profile(
        Profile([_point("alone", bundles["small"], 0.96, 3.0, 500, max_batch=1)], split={"name": "test", "count": 300}),
        tmp_path / "pareto.json",
    )
    config = tmp_path / "edgekitd.toml"
    config.write_text(
        f'[[variants]]\nname = "small"\nbundle = "{bundles["small"]}"\n'
        f'[policy]\nprofile = "{tmp_path / "pareto.json"}"\nmode = "fixed"\nfixed = "alone"\n'
    )
    cfg = load_config(config)
    registry = VariantRegistry(cfg)
    loop = PolicyLoop(cfg, registry, Metrics(), read_signals=Signals)
    at_activation = []
    activate = registry.activate

    def watched(name: str):  # the real switch, observed as it returns
        loaded = activate(name)
        at_activation.append(loaded.reporter.engine.rows_max)
        return loaded

    monkeypatch.setattr(registry, "activate", watched)
    assert loop.tick().point.id == "alone"
    assert at_activation == [1] and registry.peek("small").reporter.engine.rows_max == 1
