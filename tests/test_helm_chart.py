"""packaging/helm/edgekit rendered by Helm's own Go code and checked against Kubernetes' own schemas, offline.

Helm: the `helm-python-sdk` wheel (the test extra) bundles libhelm_c, a C ABI over Helm's Go SDK (v4), and renders
a chart as `helm template` does, with the chart's values.schema.json enforced. Kubernetes: `kubernetes-validate`
ships the JSON schemas of every release it knows in its wheel; every manifest is validated strictly (no unknown
fields) against the oldest and the newest release the chart supports (Chart.yaml's kubeVersion). The ConfigMap's
edgekitd.toml is loaded by edgekitd's own `load_config`, with the trust Secret laid out as the pod sees it.
"""

from __future__ import annotations

import base64
import platform
import sys
from pathlib import Path

import pytest
import yaml

from edgekit.bundle.minisign import SecretKey
from edgekit.daemon.config import load_config

CHART = Path(__file__).resolve().parents[1] / "packaging" / "helm" / "edgekit"
KUBE_OLDEST, KUBE_NEWEST = "1.25.0", "1.37.0"  # Chart.yaml: kubeVersion ">= 1.25.0-0"; the newest schemas known

# helm-python-sdk 0.2.2 has wheels for Linux x86_64, macOS arm64 and Windows x64 only (pyproject's marker). Where
# it has one, a missing install is an error, never a skip.
_HAS_WHEEL = (sys.platform, platform.machine().lower()) in {
    ("linux", "x86_64"),
    ("darwin", "arm64"),
    ("win32", "amd64"),
}
if _HAS_WHEEL:
    import helm_python as helm
    import kubernetes_validate
else:  # pragma: no cover - a platform helm-python-sdk publishes no wheel for (e.g. Linux aarch64)
    helm = pytest.importorskip(
        "helm_python", reason=f"helm-python-sdk has no wheel for {sys.platform}/{platform.machine()}"
    )
    kubernetes_validate = pytest.importorskip("kubernetes_validate")

KEYS = {name: SecretKey.generate() for name in ("release-2026.pub", "release-2027.pub")}
FLEET = {  # canary + trust + OTLP on Jetson Orins
    "image": {"repository": "registry.local/edgekit", "tag": "0.1.0-orin", "python": "/opt/edgekit/bin/python"},
    "jetson": {"enabled": True},
    "runtimeClass": {"create": True},
    "canary": {"enabled": True, "image": {"tag": "0.2.0-orin"}, "config": {"rollout": {"canary_reports": 50}}},
    "config": {
        "scheduler": {"workers": 4},
        "rollout": {"canary_s": 900, "max_p95_ratio": 1.5, "drop_dir": "/var/lib/edgekit/drop"},
        "variants": [{"name": "chest", "bundle": "/var/lib/edgekit/bundles/chest.ekb"}],
        "models": {"active": "chest"},
    },
    "trust": {"publicKeys": {name: key.public().to_text() for name, key in KEYS.items()}},
    "telemetry": {"otlpEndpoint": "http://otel-collector.observability:4318", "resourceAttributes": {"site": "ward-3"}},
}
ORIN = {"kubernetes.io/os": "linux", "kubernetes.io/arch": "arm64", "edgekit.io/accelerator": "orin"}


def render(values: dict) -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values, name="fleet", namespace="edge", is_install=True)
    docs = []
    for path, text in sorted(files.items()):
        if path.endswith(".yaml"):
            docs += [doc for doc in yaml.safe_load_all(text) if doc]
    return docs


@pytest.fixture(scope="module")
def default() -> list[dict]:
    return render({})


@pytest.fixture(scope="module")
def fleet() -> list[dict]:
    return render(FLEET)


def one(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def expressions(ds: dict) -> list[dict]:
    """The node affinity's one term (the chart writes one: its expressions must all hold)."""
    affinity = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
    (term,) = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    return term["matchExpressions"]


def schedules(ds: dict, labels: dict[str, str]) -> bool:
    """Would the scheduler put this DaemonSet's pod on a node with these labels (nodeSelector and node affinity)?"""
    if any(labels.get(k) != v for k, v in ds["spec"]["template"]["spec"].get("nodeSelector", {}).items()):
        return False

    def holds(e: dict) -> bool:
        inside = labels.get(e["key"]) in e.get("values", [])
        return {"In": inside, "NotIn": not inside, "Exists": e["key"] in labels}[e["operator"]]

    return all(holds(e) for e in expressions(ds))


def materialise_config(docs: list[dict], ds: dict, root: Path) -> Path:
    """Lay out the DaemonSet's projected config volume under `root` as the kubelet would; the config file's path."""
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "config"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "config"]
    for source in volume["projected"]["sources"]:
        if "configMap" in source:
            data = one(docs, "ConfigMap", source["configMap"]["name"])["data"]
            items = {i["path"]: data[i["key"]].encode() for i in source["configMap"]["items"]}
        else:
            data = one(docs, "Secret", source["secret"]["name"])["data"]
            items = {i["path"]: base64.b64decode(data[i["key"]]) for i in source["secret"]["items"]}
        for path, content in items.items():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_bytes(content)
    flag = container["command"].index("--config") + 1
    config = Path(container["command"][flag])
    assert config.parent == Path(mount["mountPath"])  # the file the daemon is told to read is in the volume
    return root / config.name


@pytest.mark.parametrize("version", [KUBE_OLDEST, KUBE_NEWEST])
def test_every_manifest_validates_strictly_against_the_oldest_and_newest_kubernetes(default, fleet, version):
    kinds = set()
    for doc in default + fleet + render({"stateVolume": {"persistentVolumeClaim": {"claimName": "edgekit-state"}}}):
        kubernetes_validate.validate(doc, version, strict=True)
        kinds.add(doc["kind"])
    assert kinds == {"DaemonSet", "ConfigMap", "Secret", "RuntimeClass"}
    with pytest.raises(kubernetes_validate.ValidationError):  # strict: an unknown field is refused
        bad = one(default, "DaemonSet", "fleet-edgekitd")
        kubernetes_validate.validate({**bad, "spec": {**bad["spec"], "replicas": 2}}, version, strict=True)


def test_helm_lints_the_chart_strictly_and_its_schema_refuses_bad_values():
    for version in (KUBE_OLDEST, KUBE_NEWEST):
        report = helm.lint(CHART, FLEET, strict=True, kube_version=f"v{version}")
        assert report["errors"] == [] and all(m["severity"] < 2 for m in report["messages"]), report
    for bad in (
        {"runAsUser": 0},  # never root
        {"trust": {"publicKeys": {"release.pub": "not a key"}}},
        {"config": {"trust": {"public_keys": ["/elsewhere.pub"]}}},  # the chart owns [trust]
        {"config": {"daemon": {"state_dir": "/data"}}},  # and the mounts' paths
        {"telemetry": {"otlpEndpoint": "collector:4318"}},
    ):
        with pytest.raises(helm.HelmValuesError):
            render(bad)


def test_the_default_is_one_daemonset_on_every_linux_node_with_the_socket_on_the_host(default):
    assert sorted(d["kind"] for d in default) == ["ConfigMap", "DaemonSet"]
    ds = one(default, "DaemonSet", "fleet-edgekitd")
    pod = ds["spec"]["template"]["spec"]
    assert schedules(ds, {"kubernetes.io/os": "linux"}) and not schedules(ds, {"kubernetes.io/os": "windows"})
    assert "runtimeClassName" not in pod
    (container,) = pod["containers"]
    limits = container["resources"]["limits"]
    assert "nvidia.com/gpu" not in limits and limits["memory"] == "4Gi"
    assert not any(e["name"].startswith("OTEL_") for e in container["env"])
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["socket"]["hostPath"] == {"path": "/run/edgekit", "type": "DirectoryOrCreate"}
    assert volumes["state"]["hostPath"] == {"path": "/var/lib/edgekit", "type": "DirectoryOrCreate"}
    assert pod["securityContext"]["runAsNonRoot"] and container["securityContext"]["readOnlyRootFilesystem"]
    with pytest.raises(helm.HelmValuesError):  # the renderer runs the chart's values.schema.json
        render({"runAsUser": 0})


def test_the_default_config_is_one_edgekitd_accepts(default, tmp_path):
    ds = one(default, "DaemonSet", "fleet-edgekitd")
    cfg = load_config(materialise_config(default, ds, tmp_path))
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert cfg.socket.parent == Path(mounts["socket"]) and cfg.state_dir == Path(mounts["state"])
    assert cfg.rollout.drop_dir == Path(mounts["state"]) / "drop"
    assert cfg.trusted_keys == () and cfg.workers == 8


def test_canary_ring_beside_the_main_one(fleet):
    main, canary = one(fleet, "DaemonSet", "fleet-edgekitd"), one(fleet, "DaemonSet", "fleet-edgekitd-canary")
    selectors = [d["spec"]["selector"]["matchLabels"] for d in (main, canary)]
    assert selectors[0] != selectors[1]
    for ds, selector in zip((main, canary), selectors, strict=True):
        assert selector.items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    ring = lambda ds: next(e for e in expressions(ds) if e["key"] == "ring")  # noqa: E731
    assert ring(canary) == {"key": "ring", "operator": "In", "values": ["canary"]}
    assert ring(main) == {"key": "ring", "operator": "NotIn", "values": ["canary"]}
    # Every Orin on a supported JetPack runs exactly one of them; anything else runs neither.
    for labels, expected in (
        ({**ORIN, "edgekit.io/jetpack": "6.2"}, "main"),
        ({**ORIN, "edgekit.io/jetpack": "6.1", "ring": "stable"}, "main"),
        ({**ORIN, "edgekit.io/jetpack": "6.2", "ring": "canary"}, "canary"),
        ({**ORIN, "edgekit.io/jetpack": "5.1.3", "ring": "canary"}, None),  # an older JetPack
        ({**ORIN, "edgekit.io/jetpack": "6.2", "kubernetes.io/arch": "amd64"}, None),
        ({"kubernetes.io/os": "linux", "kubernetes.io/arch": "arm64", "edgekit.io/jetpack": "6.2"}, None),
    ):
        chosen = [name for name, ds in (("main", main), ("canary", canary)) if schedules(ds, labels)]
        assert chosen == ([expected] if expected else []), labels
    images = [ds["spec"]["template"]["spec"]["containers"][0]["image"] for ds in (main, canary)]
    assert images == ["registry.local/edgekit:0.1.0-orin", "registry.local/edgekit:0.2.0-orin"]


def test_jetson_runtime_class_and_the_device_plugins_gpu(fleet):
    assert one(fleet, "RuntimeClass", "nvidia")["handler"] == "nvidia"
    for name in ("fleet-edgekitd", "fleet-edgekitd-canary"):
        pod = one(fleet, "DaemonSet", name)["spec"]["template"]["spec"]
        assert pod["runtimeClassName"] == "nvidia"
        (container,) = pod["containers"]
        assert container["resources"]["limits"] == {"cpu": "2", "memory": "4Gi", "nvidia.com/gpu": 1}
        assert pod["securityContext"]["supplementalGroups"] == [44, 109]
        assert container["readinessProbe"]["exec"]["command"][0] == "/opt/edgekit/bin/python"


def test_the_trust_secret_is_mounted_where_each_rings_config_says_the_keys_are(fleet, tmp_path):
    secret = one(fleet, "Secret", "fleet-edgekitd-trust")
    assert sorted(secret["data"]) == sorted(KEYS)
    for name, window in (("fleet-edgekitd", 20), ("fleet-edgekitd-canary", 50)):
        ds = one(fleet, "DaemonSet", name)
        cfg = load_config(materialise_config(fleet, ds, tmp_path / name))
        assert sorted(k.id_hex for k in cfg.trusted_keys) == sorted(k.public().id_hex for k in KEYS.values())
        assert cfg.rollout.canary_reports == window and cfg.rollout.canary_s == 900 and cfg.rollout.max_p95_ratio == 1.5
        assert cfg.workers == 4 and isinstance(cfg.workers, int)  # Helm's numbers are floats; the TOML's are not
        assert [v.name for v in cfg.variants] == ["chest"] and cfg.active_variant == "chest"
        assert cfg.socket == Path("/run/edgekit/edgekitd.sock")
        annotations = ds["spec"]["template"]["metadata"]["annotations"]
        assert {"checksum/config", "checksum/trust"} <= set(annotations)


def test_otlp_endpoint_and_resource_as_the_standard_variables(fleet):
    for name, ring in (("fleet-edgekitd", "main"), ("fleet-edgekitd-canary", "canary")):
        (container,) = one(fleet, "DaemonSet", name)["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4318"
        assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf" and env["OTEL_SERVICE_NAME"] == "edgekitd"
        attrs = dict(kv.split("=", 1) for kv in env["OTEL_RESOURCE_ATTRIBUTES"].split(","))
        assert attrs == {
            "k8s.node.name": "$(NODE_NAME)",
            "k8s.pod.name": "$(POD_NAME)",
            "k8s.namespace.name": "edge",
            "edgekit.ring": ring,
            "site": "ward-3",
        }
        names = [e["name"] for e in container["env"]]  # $(VAR) expands only variables defined before it
        assert names.index("NODE_NAME") < names.index("OTEL_RESOURCE_ATTRIBUTES")


def test_the_state_dir_may_be_any_volume():
    docs = render({"stateVolume": {"persistentVolumeClaim": {"claimName": "edgekit-state"}}})
    pod = one(docs, "DaemonSet", "fleet-edgekitd")["spec"]["template"]["spec"]
    (state,) = [v for v in pod["volumes"] if v["name"] == "state"]
    assert state == {"name": "state", "persistentVolumeClaim": {"claimName": "edgekit-state"}}


def test_every_shape_of_edgekitd_toml_survives_the_chart(tmp_path):
    """Array tables, inline tables, arrays of inline tables, large integers and fractions, as load_config reads them."""
    config = {
        "variants": [{"name": "x1", "bundle": "/b/x1", "settings": {"sparsity_target": 0.38, "dss": True}}],
        "dimse": {"enabled": True, "ae_title": "EDGEKIT", "allowed": [{"ae_title": "ORTHANC", "host": "*"}]},
        "destinations": [{"name": "pacs", "kind": "stow", "url": "http://pacs:8042/dicom-web", "timeout_s": 30}],
        "limits": {"max_upload_bytes": 8589934592},
        "engine": {"latency_target_ms": 37.5},
    }
    docs = render({"config": config})
    cfg = load_config(materialise_config(docs, one(docs, "DaemonSet", "fleet-edgekitd"), tmp_path))
    assert cfg.variants[0].settings == {"sparsity_target": 0.38, "dss": True}
    assert [p.ae_title for p in cfg.dicom.allowed] == ["ORTHANC"] and cfg.dicom.destinations[0].timeout_s == 30
    assert cfg.max_upload_bytes == 8589934592 and cfg.latency_target_ms == 37.5
