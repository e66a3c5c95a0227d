"""Bundle rollouts on the device (daemon/rollout.py, daemon/slots.py): a new bundle is verified, staged, gated (its
own reference outputs, a quality floor) and switched to; its canary window commits it or rolls it back by itself,
energy judged against the profile or else the previous bundle; refusals leave the live bundle serving; and
`kill -9` at every step leaves the daemon serving the old bundle or the committed new one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from bundle_tamper import altered_embeddings, rewrite

pytest.importorskip("fastapi")

from edgekit.bundle import load_bundle, pack_bundle  # noqa: E402
from edgekit.daemon.config import RolloutSettings, load_config  # noqa: E402
from edgekit.daemon.rollout import Rollout, RolloutBusyError, RolloutError  # noqa: E402
from edgekit.daemon.slots import SlotDir  # noqa: E402
from edgekit.daemon.testing import DaemonProcess, write_tiny_model  # noqa: E402
from edgekit.daemon.variants import VariantRegistry  # noqa: E402
from edgekit.pareto import Point, Profile, write_profile  # noqa: E402
from edgekit.reference import REFERENCE_ROLE  # noqa: E402

SAMPLES = Path(__file__).resolve().parents[1] / "models" / "samples"


@pytest.fixture(scope="module")
def bundles(tiny_orin_bundles, tmp_path_factory):
    """v1 (the cpu bundle the config names), v2 (another model for cpu, as an .ekb), and an orin .ekb."""
    from edgekit.build import build

    root = tmp_path_factory.mktemp("rollout")
    orin, v1 = tiny_orin_bundles
    v2 = build("cpu", root / "v2", model_dir=write_tiny_model(root / "model2", seed=5, max_new_tokens=8), parity=False)
    return {"v1": v1, "v2": pack_bundle(v2.bundle, root / "v2.ekb"), "orin": pack_bundle(orin, root / "orin.ekb")}


def _config(tmp_path: Path, v1: Path, rollout: str = "") -> Path:
    path = tmp_path / "edgekitd.toml"
    path.write_text(
        f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n[rollout]\n{rollout}\n'
        f'[[variants]]\nname = "a"\nbundle = "{v1}"\n'
    )
    return path


class Steps:
    def __init__(self):
        self.seen: list[tuple[str, str]] = []

    def __call__(self, variant: str, step: str) -> None:
        self.seen.append((variant, step))


def _rollout(tmp_path, v1, **settings) -> tuple[Rollout, VariantRegistry, Steps]:
    cfg = load_config(_config(tmp_path, v1))
    registry = VariantRegistry(cfg)
    steps = Steps()
    rollout = Rollout(cfg.state_dir, registry, lambda: RolloutSettings(**settings), steps)
    rollout.recover()
    return rollout, registry, steps


def test_a_bad_canary_rolls_back_by_itself_and_a_good_one_commits(bundles, tmp_path):
    rollout, registry, steps = _rollout(tmp_path, bundles["v1"], canary_reports=10, min_reports=4)
    v1, v2 = registry.get("a").digest, load_bundle(bundles["v2"]).digest
    for _ in range(10):  # the live bundle's own recent figures: the canary's baseline
        rollout.observe_report("a", True, 100.0, 0.5)
    out = rollout.install("a", bundles["v2"])
    assert out["phase"] == "canary" and out["bundle"] == v2 and "warm_ms" in out["gate"]
    assert out["gate"]["reference"]["checked"] and out["gate"]["reference"]["tokens_compared"] > 0
    assert registry.get("a").digest == v2 and registry.get("a").reporter.bundle.digest == v2
    with pytest.raises(RolloutBusyError):
        rollout.install("a", bundles["v2"])
    for _ in range(3):
        rollout.observe_report("a", True, 110.0, 0.5)
    rollout.observe_report("a", True, 400.0, 0.5)  # p95 of the window: 400 ms, over 2x the baseline's 100
    assert registry.get("a").digest == v1
    state = SlotDir(tmp_path / "state", "a").read()
    assert state.phase == "rolled_back" and state.live is None and "p95 latency" in state.history[-1]["reason"]
    assert [s for _, s in steps.seen] == ["staged", "gated", "switched", "rolled_back"]
    assert list((tmp_path / "state" / "variants" / "a" / "slots").iterdir()) == []  # the failed slot is gone

    rollout.install("a", bundles["v2"])
    for _ in range(10):
        rollout.observe_report("a", True, 120.0, 0.55)
    state = SlotDir(tmp_path / "state", "a").read()
    assert state.phase == "committed" and state.live.digest == v2 and state.previous.factory
    assert registry.get("a").digest == v2
    assert rollout.describe("a")["live"]["digest"] == v2
    # by hand: back to the config's bundle
    assert rollout.rollback("a", "by hand")["bundle"] == v1 and registry.get("a").digest == v1
    with pytest.raises(RolloutError) as err:
        rollout.rollback("a", "again")
    assert err.value.code == "nothing_to_roll_back"


def test_a_report_counts_for_the_bundle_that_wrote_it(bundles, tmp_path):
    """Reports begun before a switch (or a rollback) finish after it: each counts for the bundle that wrote it, or
    not at all, so one bundle is never judged, nor made a baseline, by another's reports."""
    rollout, registry, _ = _rollout(tmp_path, bundles["v1"], canary_reports=10, min_reports=4)
    v1, v2 = registry.get("a").digest, load_bundle(bundles["v2"]).digest
    for _ in range(10):
        rollout.observe_report("a", True, 100.0, None, None, v1)
    rollout.install("a", bundles["v2"])
    for _ in range(5):  # begun on v1, finished in v2's window
        rollout.observe_report("a", True, 900.0, None, None, v1)
    assert rollout.windows["a"].reports == 0
    for _ in range(3):
        rollout.observe_report("a", True, 110.0, None, None, v2)
    rollout.observe_report("a", True, 400.0, None, None, v2)  # over 2x the baseline's p95: rolled back
    assert registry.get("a").digest == v1
    for _ in range(20):  # v2's last reports, finished after the rollback
        rollout.observe_report("a", True, 5000.0, None, None, v2)
    baseline = rollout.baselines["a"]
    assert baseline.digest == v1 and baseline.reports == 10 and baseline.p95() == 100.0


def test_errors_deliveries_and_time_each_end_a_window(bundles, tmp_path):
    rollout, registry, _ = _rollout(tmp_path, bundles["v1"], canary_reports=50, min_reports=4, canary_s=60)
    rollout.install("a", bundles["v2"])
    for ok in (True, False, False, True):
        rollout.observe_report("a", ok, 100.0, None)
    assert "error rate 2/4" in SlotDir(tmp_path / "state", "a").read().history[-1]["reason"]
    rollout.install("a", bundles["v2"])
    for ok in (True, False, False):
        rollout.observe_delivery("a", ok)
    assert SlotDir(tmp_path / "state", "a").read().phase == "canary"  # 3 settled: under min_reports
    rollout.observe_delivery("a", False)
    assert "SR delivery rate 1/4" in SlotDir(tmp_path / "state", "a").read().history[-1]["reason"]
    rollout.install("a", bundles["v2"])
    started = SlotDir(tmp_path / "state", "a").read().canary_started
    assert rollout.judge("a", now=started + 30) is None
    assert rollout.judge("a", now=started + 61) == "committed"  # no traffic: committed when the time is up


def test_refusals_leave_the_live_bundle_and_nothing_staged(bundles, tmp_path):
    rollout, registry, steps = _rollout(tmp_path, bundles["v1"], gate_split=None)
    v1 = registry.get("a").digest
    with pytest.raises(RolloutError, match="target orin; variant 'a' serves cpu") as err:
        rollout.install("a", bundles["orin"])
    assert err.value.code == "wrong_target"
    truncated = tmp_path / "truncated.ekb"
    truncated.write_bytes(bundles["v2"].read_bytes()[:-4096])
    with pytest.raises(Exception, match="zip|truncated|archive"):
        rollout.install("a", truncated)
    assert registry.get("a").digest == v1 and steps.seen == []
    assert list((tmp_path / "state" / "variants" / "a" / "slots").iterdir()) == []


def test_the_quality_gate_refuses_a_bundle_under_the_floor(bundles, tmp_path, synth_split3):
    rollout, registry, steps = _rollout(tmp_path, bundles["v1"], gate_split=synth_split3, gate_min_f1=1.01)
    v1 = registry.get("a").digest
    with pytest.raises(RolloutError, match="finding F1 .* under gate_min_f1 1.01") as err:
        rollout.install("a", bundles["v2"])
    assert err.value.code == "gate_failed" and registry.get("a").digest == v1
    assert [s for _, s in steps.seen] == ["staged", "gate_failed"]
    assert SlotDir(tmp_path / "state", "a").read().staged is None


def test_a_dropped_bundle_is_installed_and_a_refused_one_says_why(bundles, tmp_path):
    drop = tmp_path / "drop"
    (drop / "a").mkdir(parents=True)
    rollout, registry, _ = _rollout(tmp_path, bundles["v1"], drop_dir=drop)
    shutil.copy(bundles["orin"], drop / "a" / "orin.ekb")
    rollout.tick()
    assert (drop / "a" / "orin.ekb.refused").is_file()
    assert (drop / "a" / "orin.ekb.refused.txt").read_text().startswith("wrong_target:")
    shutil.copy(bundles["v2"], drop / "a" / "v2.ekb")
    rollout.tick()
    assert not (drop / "a" / "v2.ekb").exists()  # moved into the slots
    assert registry.get("a").digest == load_bundle(bundles["v2"]).digest


@pytest.mark.parametrize("failpoint", ["received", "staged", "gated", "switched", "committed"])
def test_kill_9_at_every_step_serves_the_old_or_the_committed_bundle(bundles, tmp_path, failpoint):
    config = _config(tmp_path, bundles["v1"], "canary_reports = 1\nmin_reports = 1\n")
    v1, v2 = load_bundle(bundles["v1"]).digest, load_bundle(bundles["v2"]).digest
    d = DaemonProcess(tmp_path / "state", config=config, env={"EDGEKIT_FAILPOINT": failpoint}).start()
    try:
        try:
            reply = d.client.request(
                "POST",
                "/v1/variants/a/bundles",
                bundles["v2"].read_bytes(),
                {"Content-Type": "application/octet-stream"},
            )
            assert reply.status == 200, reply.body  # the failpoint after the switch: the canary's first report kills
            d.client.report(SAMPLES / "cr_chest" / "image.dcm", "Cough.")
        except OSError:
            pass  # the connection died with the daemon
        assert d.proc.wait(60) == -9
    finally:
        d.kill()
    with DaemonProcess(tmp_path / "state", config=config).start() as again:
        variants = again.client.get("/v1/variants").json()["variants"]
        slots = variants[0]["slots"]
        served = v2 if failpoint == "committed" else v1
        assert (slots["live"] or {"digest": v1})["digest"] == served
        assert slots["phase"] in ({"committed"} if failpoint == "committed" else {"idle", "rolled_back"})
        assert again.client.report(SAMPLES / "cr_chest" / "image.dcm", "Cough.").status == 200
        assert (
            again.client.get("/v1/variants").json()["variants"][0]["model"]
            == load_bundle(bundles["v2"] if served == v2 else bundles["v1"]).name
        )
    variant_dir = tmp_path / "state" / "variants" / "a"
    names = {p.name for p in (variant_dir / "slots").iterdir()}
    assert not any(n.startswith(".incoming-") for n in names)  # no half-written file survives a restart
    assert len(names) == (failpoint == "committed")  # only a committed slot is kept; a killed rollout's is removed
    if (variant_dir / "state.json").exists():  # none when it died before staging
        assert json.loads((variant_dir / "state.json").read_text())["phase"] != "canary"


def test_the_reference_check_refuses_altered_weights_and_passes_an_older_bundle(bundles, tmp_path, caplog):
    """Weights changed and the manifest written again (every checksum passes): the bundle's own reference outputs
    catch it before the switch. A bundle built before reference.json existed passes, and the log says so."""
    rollout, registry, steps = _rollout(tmp_path, bundles["v1"])
    v1 = registry.get("a").digest
    weights = altered_embeddings(bundles["v2"], tmp_path / "w")
    bad = pack_bundle(rewrite(bundles["v2"], tmp_path / "bad", replace={"embed_tokens": weights}), tmp_path / "b.ekb")
    with pytest.raises(RolloutError, match=r"reference\.json: case .* differs at token position \d+") as err:
        rollout.install("a", bad)
    assert err.value.code == "gate_failed" and registry.get("a").digest == v1
    assert [s for _, s in steps.seen] == ["staged", "gate_failed"]
    assert "reference.json" in SlotDir(tmp_path / "state", "a").read().history[-1]["reason"]

    old = pack_bundle(rewrite(bundles["v2"], tmp_path / "old", drop=(REFERENCE_ROLE,)), tmp_path / "old.ekb")
    with caplog.at_level("INFO", logger="edgekitd"):
        out = rollout.install("a", old)
    assert out["gate"]["reference"] == {"checked": False, "note": "no reference outputs"}
    assert any("no reference outputs" in r.getMessage() for r in caplog.records)
    assert registry.get("a").digest == load_bundle(old).digest


def _profile(path: Path, digest: str, energy_j: float, source: str = "measured:rapl") -> Path:
    def point(i: int, joules: float) -> Point:
        return Point(
            id=f"v2[{i}]",
            bundle="v2.ekb",
            bundle_digest=digest,
            target="cpu",
            settings={"max_new_tokens": 8 * (i + 1)},
            f1=0.5,
            f1_ci=(0.4, 0.6),
            hallucination_rate=0.0,
            latency_p50_ms=100.0,
            latency_p95_ms=120.0,
            energy_j=joules,
            energy_source=source,
            peak_rss_mib=100.0,
            count=3,
        )

    return write_profile(Profile([point(0, energy_j / 2), point(1, energy_j)]), path)


def test_the_canary_judges_energy_against_the_profile_else_the_previous_bundle(bundles, tmp_path):
    v2 = load_bundle(bundles["v2"]).digest
    profile = _profile(tmp_path / "pareto.json", v2, energy_j=0.2)
    rollout, _, _ = _rollout(tmp_path, bundles["v1"], canary_reports=10, min_reports=4, profile=profile)
    for _ in range(10):  # the previous bundle: 0.5 J a report
        rollout.observe_report("a", True, 100.0, 0.5, "measured:rapl")
    out = rollout.install("a", bundles["v2"])
    baseline = {
        "kind": "profile",
        "energy_j": 0.2,
        "energy_source": "measured:rapl",
        "detail": "pareto.json point v2[1]",
    }
    assert out["energy_baseline"] == baseline  # of the bundle's two points, the costlier
    assert SlotDir(tmp_path / "state", "a").read().energy_baseline == baseline
    shown = rollout.describe("a")  # what GET /v1/variants shows as the variant's slots
    assert shown["energy_baseline"] == baseline and shown["canary"]["energy_against"].startswith("the profile's")
    assert "energy baseline profile: 0.2 J/report" in shown["history"][-1]["reason"]
    for _ in range(4):  # 0.4 J: under the previous bundle's 0.5, but twice the profile's
        rollout.observe_report("a", True, 100.0, 0.4, "measured:rapl")
    state = SlotDir(tmp_path / "state", "a").read()
    assert state.phase == "rolled_back"
    assert "energy 0.4 J/report above 1.5x the profile's (measured:rapl) 0.2 J" in state.history[-1]["reason"]

    # no profile: the previous bundle's measured figure, which the same 0.4 J holds
    (tmp_path / "b").mkdir()
    rollout, _, _ = _rollout(tmp_path / "b", bundles["v1"], canary_reports=10, min_reports=4)
    for _ in range(10):
        rollout.observe_report("a", True, 100.0, 0.5, "measured:rapl")
    out = rollout.install("a", bundles["v2"])
    assert out["energy_baseline"]["kind"] == "previous_bundle" and out["energy_baseline"]["energy_j"] == 0.5
    assert "no profile configured" in out["energy_baseline"]["detail"]
    for _ in range(10):
        rollout.observe_report("a", True, 100.0, 0.4, "measured:rapl")
    state = SlotDir(tmp_path / "b" / "state", "a").read()
    assert state.phase == "committed" and state.energy_baseline["kind"] == "previous_bundle"
    assert json.loads(state.history[-1]["reason"])["energy_against"] == "the previous bundle's measured"


def test_a_profile_figure_from_another_meter_is_not_compared():
    from edgekit.daemon.canary import PREVIOUS, PROFILE, EnergyBaseline, Figures, breach

    window, previous = Figures(), Figures()
    for _ in range(5):
        window.reports += 1
        window.energy_j.append(0.4)
        previous.energy_j.append(0.5)
    window.energy_sources.add("measured:tegrastats")
    estimated = EnergyBaseline(PROFILE, 0.1, "estimated:orin-agx-64gb:MAXN")
    assert estimated.against(window, previous) == (0.5, "the previous bundle's measured")
    assert breach(window, previous, RolloutSettings(min_reports=5), energy=estimated) is None
    same = EnergyBaseline(PROFILE, 0.1, "measured:tegrastats")
    assert "the profile's" in breach(window, previous, RolloutSettings(min_reports=5), energy=same)
    assert EnergyBaseline(PREVIOUS, None).against(window, previous)[0] == 0.5


def test_the_profile_defaults_to_the_policys(tmp_path):
    path = tmp_path / "edgekitd.toml"
    path.write_text('[rollout]\nprofile = "fleet/pareto.json"\n')
    assert load_config(path).rollout.profile == tmp_path / "fleet" / "pareto.json"
    path.write_text("[rollout]\ncanary_reports = 3\n")
    cfg = load_config(path, {"policy_profile": tmp_path / "pareto.json"})
    assert cfg.rollout.profile == tmp_path / "pareto.json" and cfg.rollout.canary_reports == 3
