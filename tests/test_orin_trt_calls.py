"""Which TensorRT builder calls `edgekit engine build` makes, recorded by a stand-in `tensorrt` module.

This proves nothing about TensorRT: the stand-in accepts whatever it is given and its "engines" are bytes. What
it does check is edgekit's own logic around the builder: the strongly typed flag on 10.x and none on 11, the
manifest's profiles handed over shape by shape, the plan's workspace and optimisation level, the timing cache
kept beside the engine cache, the cache reused when up to date and rebuilt when a device fact changes, DLA
dropped on TensorRT 11.0, and the run side's first load building the engines into the state dir it is given
before it reads the cache. The real builder runs only on a Jetson (test_orin_engine.py, skipped here)."""

from __future__ import annotations

import json
import sys
import types

import pytest

from edgekit import names
from edgekit.build import build
from edgekit.bundle import load_bundle
from edgekit.targets.orin.device import DeviceFacts
from edgekit.targets.orin.engine_build import build_engines

FACTS = DeviceFacts("10.3.0", "R36.4.0", "87", "NVIDIA Jetson AGX Orin Developer Kit")


def stand_in(version: str, strongly_typed: bool = True):
    calls: list[tuple] = []
    trt = types.ModuleType("tensorrt")
    trt.__version__ = version
    flags = {"EXPLICIT_BATCH": 0, **({"STRONGLY_TYPED": 1} if strongly_typed else {})}
    trt.NetworkDefinitionCreationFlag = types.SimpleNamespace(**flags)
    trt.MemoryPoolType = types.SimpleNamespace(WORKSPACE="WORKSPACE")
    trt.BuilderFlag = types.SimpleNamespace(SPARSE_WEIGHTS="SPARSE_WEIGHTS", GPU_FALLBACK="GPU_FALLBACK")
    trt.DeviceType = types.SimpleNamespace(DLA="DLA", GPU="GPU")

    class Logger:
        WARNING = 2

        def __init__(self, level):
            pass

    class Profile:
        def __init__(self):
            self.shapes = {}

        def set_shape(self, name, lo, opt, hi):
            self.shapes[name] = (list(lo), list(opt), list(hi))

    class TimingCache:
        def serialize(self):
            return b"timing"

    class Config:
        def __init__(self):
            self.profiles, self.flags, self.__dict__["attrs"] = [], [], {}

        def __setattr__(self, k, v):
            if k in ("profiles", "flags"):
                object.__setattr__(self, k, v)
            else:
                calls.append(("config." + k, v))

        def set_memory_pool_limit(self, pool, size):
            calls.append(("workspace", pool, size))

        def set_flag(self, flag):
            calls.append(("flag", flag))

        def create_timing_cache(self, blob):
            calls.append(("timing_in", bytes(blob)))
            return TimingCache()

        def set_timing_cache(self, cache, ignore_mismatch):
            calls.append(("set_timing_cache", ignore_mismatch))

        def get_timing_cache(self):
            return TimingCache()

        def add_optimization_profile(self, p):
            self.profiles.append(p)

    class Builder:
        def __init__(self, logger):
            pass

        def create_network(self, flags):
            calls.append(("create_network", flags))
            return object()

        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network, config):
            calls.append(("build", [p.shapes for p in config.profiles]))
            return bytearray(b"engine")

    class OnnxParser:
        def __init__(self, network, logger):
            self.num_errors = 0

        def parse_from_file(self, path):
            calls.append(("parse", path))
            return True

    trt.Logger, trt.Builder, trt.OnnxParser = Logger, Builder, OnnxParser
    return trt, calls


@pytest.fixture(scope="module")
def orin_bundle(tmp_path_factory):
    return load_bundle(build("orin", tmp_path_factory.mktemp("trt-calls") / "orin", parity=False).bundle)


def test_builder_calls_on_tensorrt_10(orin_bundle, tmp_path, monkeypatch):
    trt, calls = stand_in("10.3.0.30")
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    meta = build_engines(orin_bundle, state=str(tmp_path), facts=FACTS)
    assert [c for c in calls if c[0] == "create_network"] == [("create_network", 1 << 1)] * 3
    assert [c[1].rsplit("/", 1)[-1] for c in calls if c[0] == "parse"] == [
        names.GRAPH_FILES[r] for r in names.GRAPH_ROLES
    ]
    assert ("workspace", "WORKSPACE", 1024 << 20) in calls and ("config.builder_optimization_level", 3) in calls
    assert ("flag", "SPARSE_WEIGHTS") not in calls and ("set_timing_cache", False) in calls
    decoder_profiles = [c[1] for c in calls if c[0] == "build"][2]
    manifest = orin_bundle.manifest.runtime["profiles"]["decoder"]
    assert decoder_profiles == [
        {n: (s["min"], s["opt"], s["max"]) for n, s in prof["shapes"].items()} for prof in manifest
    ]
    timing = tmp_path / "engines" / "timing-trt10.3.0-sm87.cache"
    assert timing.read_bytes() == b"timing"
    assert set(meta["engines"]) == set(names.GRAPH_ROLES) and meta["peak_host_rss_mib"] > 0
    assert [c for c in calls if c[0] == "timing_in"][0] == ("timing_in", b"")  # first build: an empty cache

    calls.clear()
    assert build_engines(orin_bundle, state=str(tmp_path), facts=FACTS)["up_to_date"] is True
    assert not [c for c in calls if c[0] == "build"]
    newer = DeviceFacts(FACTS.tensorrt, "R36.4.3", FACTS.sm, FACTS.device)  # a JetPack update
    build_engines(orin_bundle, state=str(tmp_path), facts=newer)
    assert len([c for c in calls if c[0] == "build"]) == 3 and ("timing_in", b"timing") in calls


def test_tensorrt_11_is_strongly_typed_only_and_has_no_dla(orin_bundle, tmp_path, monkeypatch):
    trt, calls = stand_in("11.0.0", strongly_typed=False)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    said = []
    overrides = {"devices": {"vision_encoder": "dla"}, "dla_core": 0}
    build_engines(orin_bundle, state=str(tmp_path), facts=FACTS, overrides=overrides, say=said.append)
    assert [c for c in calls if c[0] == "create_network"] == [("create_network", 0)] * 3
    assert not [c for c in calls if c[0] == "config.default_device_type"]
    assert any("has no DLA support" in m for m in said)
    trt10, calls10 = stand_in("10.3.0")
    monkeypatch.setitem(sys.modules, "tensorrt", trt10)
    build_engines(orin_bundle, state=str(tmp_path / "10"), facts=FACTS, overrides=overrides)
    assert ("config.default_device_type", "DLA") in calls10 and ("flag", "GPU_FALLBACK") in calls10
    assert ("config.DLA_core", 0) in calls10


def stand_in_cudart(calls: list) -> dict[str, types.ModuleType]:
    """cuda-python's runtime as far as the first load needs it: the device's SM and name, and a stream that fails
    to be created, so the backend stops right after it has accepted the engine cache (nothing runs)."""
    rt = types.ModuleType("cuda.bindings.runtime")
    props = types.SimpleNamespace(major=8, minor=7, name=b"Orin (stand-in)")
    rt.cudaGetDeviceProperties = lambda index: (0, props)

    def stream_create():
        calls.append(("cudaStreamCreate",))
        return (1, None)  # an error code

    rt.cudaStreamCreate = stream_create
    bindings = types.ModuleType("cuda.bindings")
    bindings.runtime = rt
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings
    return {"cuda": cuda, "cuda.bindings": bindings, "cuda.bindings.runtime": rt}


def test_the_first_load_builds_the_engines_into_the_state_dir_then_reuses_them(orin_bundle, tmp_path, monkeypatch):
    """edgekitd's first start: the run side builds what the cache lacks before the backend reads the cache."""
    from edgekit.errors import EdgekitError
    from edgekit.plugins import load_backend
    from edgekit.target import RuntimeOptions

    trt, calls = stand_in("10.3.0")
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    for name, module in stand_in_cudart(calls).items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setenv("EDGEKIT_STATE_DIR", str(tmp_path / "default"))  # not used: the options name a state dir
    options = RuntimeOptions(state_dir=tmp_path / "state")
    with pytest.raises(EdgekitError, match="CUDA call failed"):  # past the cache check: the engines were accepted
        load_backend(orin_bundle, options)
    kinds = [c[0] for c in calls]
    assert kinds.count("build") == 3 and kinds.index("cudaStreamCreate") > max(
        i for i, k in enumerate(kinds) if k == "build"
    )
    (record,) = (tmp_path / "state").glob("engines/*/*/engines.json")
    assert set(json.loads(record.read_text())["engines"]) == set(names.GRAPH_ROLES)
    assert not (tmp_path / "default").exists()

    calls.clear()
    with pytest.raises(EdgekitError, match="CUDA call failed"):
        load_backend(orin_bundle, options)
    assert [c[0] for c in calls] == ["cudaStreamCreate"]  # current engines: no build, no parse
