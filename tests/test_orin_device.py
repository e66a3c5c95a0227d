"""What engines are keyed by and refused on: device facts read from a fixture tree with the Jetson's real layout
(`etc/nv_tegra_release`, `proc/device-tree/model`), the cache folder per (TensorRT, L4T, SM, device), engines
copied from another JetPack refused in one line naming the file, atomic writes. No TensorRT needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgekit.bundle.io import replace_bytes
from edgekit.targets.orin.device import DeviceFacts, current_facts, read_device_model, read_l4t, state_dir
from edgekit.targets.orin.engine_cache import EngineCache, EngineMismatchError, bundle_id, check_folder

R36_4 = (
    "# R36 (release), REVISION: 4.0, GCID: 37537400, BOARD: generic, EABI: aarch64, DATE: Fri Sep 13 04:36:44 UTC 2024"
)
AGX = b"NVIDIA Jetson AGX Orin Developer Kit\x00"


def jetson_root(tmp_path: Path, release: str = R36_4 + "\n", model: bytes = AGX) -> Path:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "nv_tegra_release").write_text(release + "# KERNEL_VARIANT: oot\n")
    (root / "proc" / "device-tree").mkdir(parents=True)
    (root / "proc" / "device-tree" / "model").write_bytes(model)
    return root


def test_facts_come_from_the_jetson_files(tmp_path):
    root = jetson_root(tmp_path)
    assert read_l4t(root) == "R36.4.0" and read_device_model(root) == "NVIDIA Jetson AGX Orin Developer Kit"
    facts = current_facts(root, tensorrt_version="10.3.0.30", gpu=("87", "Orin"))
    assert facts == DeviceFacts("10.3.0.30", "R36.4.0", "87", "NVIDIA Jetson AGX Orin Developer Kit")
    bare = tmp_path / "laptop"
    bare.mkdir()
    assert read_l4t(bare) is None and read_device_model(bare) is None
    assert current_facts(bare, tensorrt_version="10.3.0", gpu=("89", "NVIDIA RTX 4090")).device == "NVIDIA RTX 4090"
    (bare / "etc").mkdir()
    (bare / "etc" / "nv_tegra_release").write_text("garbage\n")
    assert read_l4t(bare) is None


def test_every_fact_changes_the_cache_folder(tmp_path):
    base = DeviceFacts("10.3.0", "R36.4.0", "87", "NVIDIA Jetson AGX Orin Developer Kit")
    variants = [
        DeviceFacts("10.3.1", "R36.4.0", "87", base.device),
        DeviceFacts("10.3.0", "R36.3.0", "87", base.device),
        DeviceFacts("10.3.0", "R36.4.0", "86", base.device),
        DeviceFacts("10.3.0", "R36.4.0", "87", "NVIDIA Jetson Orin NX Engineering Reference Developer Kit"),
    ]
    folders = {EngineCache(tmp_path, "b", f).folder for f in [base, *variants]}
    assert len(folders) == 5
    assert base.key().startswith("trt10.3.0-R36.4.0-sm87-nvidia-jetson-agx-orin")
    a, b = EngineCache(tmp_path, "b", base), EngineCache(tmp_path, "b", variants[0])
    assert a.timing_cache.parent == a.folder.parent.parent  # beside the engine folders
    assert a.timing_cache != b.timing_cache  # a TensorRT version's own timing cache


def _engine_folder(cache: EngineCache, facts: DeviceFacts) -> None:
    from edgekit.bundle import sha256_file

    cache.folder.mkdir(parents=True)
    engines = {}
    for role in ("vision_encoder", "embed_tokens", "decoder"):
        path = cache.engine(role)
        replace_bytes(path, role.encode() * 100)
        engines[role] = {"file": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}
    cache.write_meta({"bundle": cache.bundle, "facts": facts.to_dict(), "engines": engines})


def test_engines_from_another_jetpack_are_refused_naming_the_file(tmp_path):
    here = current_facts(jetson_root(tmp_path), tensorrt_version="10.3.0", gpu=("87", "Orin"))
    older = DeviceFacts("10.3.0", "R36.3.0", "87", here.device)
    copied = EngineCache(tmp_path / "state", "bundle-1", older)
    _engine_folder(copied, older)  # built on JetPack 6.0 (L4T R36.3), then copied to this R36.4 device
    with pytest.raises(EngineMismatchError) as err:
        check_folder(copied.folder, here, "bundle-1")
    line = str(err.value)
    assert line.startswith(str(copied.meta_path)) and "\n" not in line
    assert "L4T R36.3.0 (this device: R36.4.0)" in line and "edgekit engine build" in line
    mine = EngineCache(tmp_path / "state", "bundle-1", here)
    assert not (tmp_path / "state" / "engines" / "bundle-1" / here.key()).exists()
    with pytest.raises(EngineMismatchError, match="engines exist for other devices or JetPacks"):
        mine.require()
    _engine_folder(mine, here)
    assert mine.is_complete() and mine.require()["facts"]["l4t"] == "R36.4.0"
    mine.engine("decoder").write_bytes(b"corrupted")
    with pytest.raises(EngineMismatchError, match=r"does not match its record \(decoder\)"):
        mine.require()
    with pytest.raises(EngineMismatchError, match="another bundle or plan"):
        check_folder(copied.folder, older, "bundle-2")


def test_atomic_writes_leave_nothing_half_written(tmp_path):
    out = tmp_path / "e" / "decoder.plan"
    assert replace_bytes(out, [b"ab", memoryview(b"cd")]) == 4 and out.read_bytes() == b"abcd"

    def failing():
        yield b"x" * 10
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        replace_bytes(out, failing())
    assert out.read_bytes() == b"abcd" and sorted(p.name for p in out.parent.iterdir()) == ["decoder.plan"]


def test_bundle_id_follows_the_graphs_and_the_plan(tmp_path):
    from edgekit.bundle import write_bundle

    def bundle(decoder: bytes):
        src = tmp_path / f"src-{decoder.decode()}"
        src.mkdir()
        comps = {}
        for role, name in {"vision_encoder": "v.onnx", "embed_tokens": "e.onnx", "decoder": "d.onnx"}.items():
            (src / name).write_bytes(decoder if role == "decoder" else b"same")
            comps[role] = src / name
        from edgekit.bundle import load_bundle

        return load_bundle(
            write_bundle(tmp_path / src.name / "b", comps, name="m", target="orin", required_roles=()),
            required_roles=(),
        )

    a, b = bundle(b"one"), bundle(b"two")
    assert bundle_id(a, {"x": 1}) != bundle_id(b, {"x": 1}) and bundle_id(a, {"x": 1}) != bundle_id(a, {"x": 2})
    assert bundle_id(a, {"x": 1}) == bundle_id(a, {"x": 1}) and bundle_id(a, {}).startswith("m-")


def test_state_dir_order(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEKIT_STATE_DIR", str(tmp_path / "env"))
    assert state_dir(tmp_path / "flag") == tmp_path / "flag" and state_dir() == tmp_path / "env"
    monkeypatch.delenv("EDGEKIT_STATE_DIR")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert state_dir() == tmp_path / "xdg" / "edgekit"
    assert json.dumps(DeviceFacts("10.3", None, None, None).to_dict())
