"""The Debian package, the OCI image and the booted end-to-end test (packaging/).

The quick tests check what the packaging says against the tree (Depends derived, overrides justified, versions in
step, the GPU drop-in's exposure) and run the two build-time generators. The full run (build the .deb, lintian,
boot it with systemd-nspawn, build and run the image, upgrade and purge) takes about 12 minutes on 2 cores and
runs only when asked: EDGEKIT_PACKAGING=1 python -m pytest tests/test_packaging_deb.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "packaging"
DEBIAN = PKG / "deb" / "debian"


def _script_module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --- what the packaging says --------------------------------------------------------------------------------------
def test_every_lintian_override_carries_a_comment_that_justifies_it():
    lines = (DEBIAN / "edgekit.lintian-overrides").read_text().splitlines()
    overrides = 0
    for i, line in enumerate(lines):
        if not line.strip() or line.startswith("#"):
            continue
        overrides += 1
        comment = []
        for above in reversed(lines[:i]):
            if not above.startswith("#"):
                break
            comment.append(above)
        assert len(" ".join(comment)) >= 40, f"override without a justifying comment: {line!r}"
    assert overrides >= 1


def test_depends_are_derived_not_written_by_hand():
    control = (DEBIAN / "control").read_text()
    depends = re.search(r"^Depends:(.*(?:\n .*)*)", control, re.M).group(1)
    names = [d.strip() for d in depends.replace("\n", " ").split(",")]
    assert {"${shlibs:Depends}", "${python:Depends}", "${misc:Depends}"} <= set(names)
    # the only literal one is the maintainer scripts' own tool (lintian asks for it)
    assert [n for n in names if not n.startswith("${")] == ["adduser"]
    assert re.search(r"^Architecture: any$", control, re.M)


def test_the_changelog_is_at_the_version_pyproject_declares():
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    first = (DEBIAN / "changelog").read_text().splitlines()[0]
    version = re.match(r"edgekit \(([^)]+)\)", first).group(1)
    assert version.rsplit("-", 1)[0] == declared


def test_every_file_the_package_installs_from_the_tree_exists():
    for name in ("edgekit.install", "edgekit.examples"):
        for line in (DEBIAN / name).read_text().splitlines():
            if line.strip():
                assert (REPO / line.split()[0]).is_file(), line


def test_the_shipped_dicom_dropin_is_what_the_generator_prints_for_the_docs_example(tmp_path):
    """packaging/systemd/edgekitd-dicom.conf and the drop-in docs/dicom-networking.md shows are both the generator's
    output for the docs' worked example config: none of the three can change without the others."""
    doc = (REPO / "docs" / "dicom-networking.md").read_text()
    toml = re.search(r"\*\*edgekitd\*\* \(`/etc/edgekit/edgekitd.toml`\):\n\n```toml\n(.*?)```", doc, re.S).group(1)
    config = tmp_path / "edgekitd.toml"
    config.write_text(toml)
    args = [sys.executable, "-m", "edgekit.daemon", "--config", str(config), "--print-dicom-dropin"]
    printed = subprocess.run(args, capture_output=True, text=True, check=True, timeout=60).stdout
    assert "IPAddressAllow=localhost" in printed and "PrivateNetwork=no" in printed
    assert (PKG / "systemd" / "edgekitd-dicom.conf").read_text() == printed
    assert f"```ini\n{printed}```" in doc


def test_the_gpu_dropin_keeps_the_exposure_at_most_2(tmp_path):
    """The Jetson drop-in merged onto the installed unit, scored offline as systemd would load them."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    system = tmp_path / "lib/systemd/system"
    system.mkdir(parents=True)
    for unit in ("edgekitd.service", "edgekitd.socket"):
        shutil.copy(PKG / "systemd" / unit, system / unit)

    def score() -> float:
        out = subprocess.run(
            ["systemd-analyze", "security", "--offline=true", f"--root={tmp_path}", "edgekitd.service"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        return float(re.search(r"Overall exposure level for edgekitd.service: ([0-9.]+)", out.stdout).group(1))

    plain = score()
    dropin = tmp_path / "etc/systemd/system/edgekitd.service.d/gpu.conf"
    dropin.parent.mkdir(parents=True)
    shutil.copy(PKG / "systemd" / "edgekitd-gpu.conf", dropin)
    gpu = score()
    assert plain <= 1.0 and gpu <= 2.0
    assert gpu > plain  # the drop-in was read: it opens devices, so the score must rise


def test_the_man_page_generator_lists_subcommands_and_writes_a_page(tmp_path):
    manpage = _script_module(DEBIAN / "manpage.py")
    env = {**os.environ, "TYPER_USE_RICH": "0"}
    text = subprocess.run(
        [sys.executable, "-I", "-m", "edgekit.cli.app", "bundle", "--help"], capture_output=True, text=True, env=env
    ).stdout
    assert {"inspect", "verify", "pack", "unpack"} <= set(manpage.subcommands(text))
    assert "Examples:" not in manpage.subcommands(text)
    if shutil.which("help2man") is None:
        pytest.skip("help2man is not installed (apt-get install help2man)")
    out = tmp_path / "edgekitd.1"
    subprocess.run(
        [sys.executable, str(DEBIAN / "manpage.py"), "--version-of", "edgekit", "-o", str(out), "--"]
        + [sys.executable, "-I", "-m", "edgekit.daemon"],
        check=True,
        timeout=120,
    )
    page = out.read_text()
    assert page.startswith('.\\" DO NOT MODIFY') and '.TH EDGEKITD "1"' in page
    assert "\\-\\-state\\-dir" in page and "edgekit(1)" in page


def test_the_copyright_generator_names_each_bundled_distribution_and_its_license():
    out = subprocess.run(
        [sys.executable, str(DEBIAN / "bundled_copyright.py"), "--site", "/usr/lib/edgekit/lib/python3/site-packages"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    paragraphs = [p for p in out.split("\n\n") if p.strip()]
    by_name = {re.search(r"^ (\S+) \S+, bundled", p, re.M).group(1).lower(): p for p in paragraphs}
    assert "edgekit" not in by_name  # edgekit's own paragraph is the static one
    for name in ("numpy", "onnxruntime", "fastapi"):
        assert name in by_name, sorted(by_name)
        assert re.search(r"^License: \S", by_name[name], re.M) and "Files: usr/lib/edgekit/" in by_name[name]


# --- the full run (opt-in) ---------------------------------------------------------------------------------------
TOOLS = {
    "dpkg-buildpackage": "dpkg-dev",
    "dh_virtualenv": "dh-virtualenv",
    "help2man": "help2man",
    "lintian": "lintian",
    "debootstrap": "debootstrap",
    "systemd-nspawn": "systemd-container",
    "nsenter": "util-linux",
    "buildah": "buildah",
    "umoci": "umoci",
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if os.environ.get("EDGEKIT_PACKAGING") != "1":
        pytest.skip("the .deb build + boot + image run takes ~12 min: set EDGEKIT_PACKAGING=1 to run it")
    missing = [f"{tool} ({pkg})" for tool, pkg in TOOLS.items() if shutil.which(tool) is None]
    if missing:
        pytest.skip("missing: " + ", ".join(missing))
    if os.geteuid() != 0:
        pytest.skip("needs root (dpkg-buildpackage as root, debootstrap, systemd-nspawn, buildah)")
    out = tmp_path_factory.mktemp("deb")
    subprocess.run([str(PKG / "build-deb"), "-o", str(out), "--level", "1"], check=True, timeout=1800)
    (deb,) = out.glob("edgekit_*.deb")
    return deb


@pytest.mark.slow
def test_the_deb_has_the_layout_debian_expects_and_lintian_passes_it(built):
    lint = (built.parent / "lintian.txt").read_text()
    assert not [line for line in lint.splitlines() if line.startswith(("E:", "W:"))]
    listing = subprocess.run(["dpkg-deb", "-c", str(built)], capture_output=True, text=True, check=True).stdout
    for path in (
        "./usr/lib/edgekit/bin/python",
        "./usr/bin/edgekit ->",
        "./usr/bin/edgekitd ->",
        "./usr/share/edgekit/radreport-tiny/model.safetensors",
        "./etc/edgekit/edgekitd.toml",
        "./lib/systemd/system/edgekitd.service",
        "./lib/systemd/system/edgekitd.socket",
        "./usr/share/man/man1/edgekit.1.gz",
        "./usr/share/man/man1/edgekitd.1.gz",
        "./usr/share/doc/edgekit/copyright",
        "./usr/share/doc/edgekit/changelog.Debian.gz",
        "./usr/share/doc/edgekit/examples/edgekitd-dicom.conf",
    ):
        assert path in listing, path
    assert "./opt/" not in listing and "torch/" not in listing
    assert "site-packages/edgekit/models/radreport_tiny/weights -> " in listing  # importlib.resources still finds it
    field = subprocess.run(["dpkg-deb", "-f", str(built), "Depends", "Architecture"], capture_output=True, text=True)
    arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True).stdout.strip()
    assert "libc6" in field.stdout and re.search(r"python3\.\d+", field.stdout)
    assert f"Architecture: {arch}" in field.stdout


@pytest.mark.slow
def test_the_deb_boots_and_passes_every_end_to_end_check(built, tmp_path):
    figures = tmp_path / "figures.json"
    subprocess.run(
        [str(PKG / "e2e" / "boot-test"), str(built), "--json", str(figures), "--python", sys.executable],
        check=True,
        timeout=1800,
    )
    fig = json.loads(figures.read_text())
    assert len(fig["passed"]) == 14
    assert "ingest in worker processes" in fig["passed"]  # studies decoded off the daemon's interpreter
    assert fig["exposure"]["installed_unit"] <= 1.0 and fig["exposure"]["with_gpu_dropin"] <= 2.0
    assert fig["exposure"]["with_dicom_dropin"] <= 1.5 and fig["cstore_to_stow_s"] > 0


@pytest.mark.slow
def test_the_image_builds_from_the_deb_and_answers_a_report(built, tmp_path):
    subprocess.run(
        [str(PKG / "container" / "build-image"), str(built), "-o", str(tmp_path), "--python", sys.executable],
        check=True,
        timeout=1800,
    )
    fig = json.loads((tmp_path / "image.json").read_text())
    assert fig["uid"] != 0 and fig["report_s"] > 0


@pytest.mark.slow
def test_an_upgrade_keeps_the_edited_conffile_and_a_purge_leaves_nothing(built, tmp_path):
    subprocess.run(
        [str(PKG / "build-deb"), "-o", str(tmp_path), "--level", "1", "--revision", "+rebuild1", "--no-lintian"],
        check=True,
        timeout=1800,
    )
    (new,) = tmp_path.glob("edgekit_*+rebuild1_*.deb")
    subprocess.run([str(PKG / "e2e" / "upgrade-test"), str(built), str(new)], check=True, timeout=1800)


# --- the Helm chart ------------------------------------------------------------------------------------------------
CHART = PKG / "helm" / "edgekit"


def test_the_helm_chart_renders_a_daemonset_with_a_hostpath_socket_and_limits():
    """Rendered by Helm's own Go code (helm-python-sdk, the test extra: no helm binary); tests/test_helm_chart.py
    validates every manifest against Kubernetes' schemas and loads the rendered config with edgekitd's reader."""
    import platform

    schema = json.loads((CHART / "values.schema.json").read_text())
    values = (CHART / "values.yaml").read_text()
    for key in schema["required"]:  # every required top-level key has a default
        assert re.search(rf"^{key}:", values, re.M), key
    if (sys.platform, platform.machine()) == ("linux", "x86_64"):  # a wheel exists: missing is an error
        import helm_python as helm
    else:
        helm = pytest.importorskip("helm_python", reason=f"helm-python-sdk has no wheel for {platform.machine()}")
    report = helm.lint(CHART, strict=True)
    assert report["errors"] == [], report
    with helm.Chart.load(CHART) as chart:
        for jetson in (False, True):
            out = chart.render({"jetson": {"enabled": jetson}}, name="fleet")["edgekit/templates/daemonset.yaml"]
            assert "kind: DaemonSet" in out and "hostPath:" in out and "path: /run/edgekit" in out
            assert "limits:" in out and "memory: 4Gi" in out
            assert ("nvidia.com/gpu: 1" in out) == jetson and ("runtimeClassName: nvidia" in out) == jetson
        with pytest.raises(helm.HelmValuesError, match="runAsUser"):  # the schema refuses root
            chart.render({"runAsUser": 0}, name="fleet")
