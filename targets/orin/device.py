"""What an engine is bound to: the TensorRT version, the L4T (JetPack) release, the GPU's SM and the device, read
from the machine, and the state directory engines are cached under.

A TensorRT engine is only valid for the TensorRT that built it and the GPU it was tuned on, so these facts are the
engine cache's key and are stored beside every engine; one copied from another JetPack is refused naming what
differs (`engine_cache.check_facts`). The file readers take a `root` so tests read a fixture tree with the real
layout (`etc/nv_tegra_release`, `proc/device-tree/model`).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

L4T_RELEASE = "etc/nv_tegra_release"
DEVICE_MODEL = "proc/device-tree/model"
_L4T = re.compile(r"#\s*R(\d+)\s*\(release\),\s*REVISION:\s*([0-9.]+)")


@dataclass(frozen=True)
class DeviceFacts:
    tensorrt: str
    l4t: str | None  # "R36.4.0"; None: not a Jetson (no /etc/nv_tegra_release)
    sm: str | None  # "87" for Orin's Ampere GPU; None: no GPU visible
    device: str | None  # "NVIDIA Jetson AGX Orin Developer Kit"

    def key(self) -> str:
        """A folder name: readable, and a hash so that two devices never share one."""
        slug = re.sub(r"[^a-z0-9]+", "-", (self.device or "unknown").lower()).strip("-")[:40]
        digest = hashlib.sha256(repr(sorted(asdict(self).items())).encode()).hexdigest()[:8]
        return f"trt{self.tensorrt}-{self.l4t or 'no-l4t'}-sm{self.sm or 'none'}-{slug}-{digest}"

    def to_dict(self) -> dict:
        return asdict(self)

    def differences(self, other: DeviceFacts) -> list[str]:
        labels = {"tensorrt": "TensorRT", "l4t": "L4T", "sm": "SM", "device": "device"}
        a, b = self.to_dict(), other.to_dict()
        return [f"{labels[k]} {a[k]} (this device: {b[k]})" for k in labels if a[k] != b[k]]


def read_l4t(root: str | Path = "/") -> str | None:
    """The L4T release from `/etc/nv_tegra_release` ("# R36 (release), REVISION: 4.0, ..." -> "R36.4.0")."""
    path = Path(root) / L4T_RELEASE
    try:
        first = path.read_text(errors="replace").splitlines()[0]
    except (OSError, IndexError):
        return None
    m = _L4T.search(first)
    return f"R{m.group(1)}.{m.group(2)}" if m else None


def read_device_model(root: str | Path = "/") -> str | None:
    try:
        return (Path(root) / DEVICE_MODEL).read_bytes().rstrip(b"\x00").decode(errors="replace").strip() or None
    except OSError:
        return None


def cuda_device(cudart, index: int = 0) -> tuple[str, str]:
    """(SM as "87", device name) of CUDA device `index`, through cuda-python."""
    err, props = cudart.cudaGetDeviceProperties(index)
    if int(err) != 0:
        raise RuntimeError(f"cudaGetDeviceProperties failed: {err}")
    name = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
    return f"{props.major}{props.minor}", name.rstrip("\x00")


def current_facts(root: str | Path = "/", *, tensorrt_version: str | None = None, gpu=None) -> DeviceFacts:
    """This machine's facts. `tensorrt_version` and `gpu` ((sm, name)) default to asking TensorRT and CUDA."""
    if tensorrt_version is None:
        from .trt_import import import_tensorrt

        tensorrt_version = import_tensorrt().__version__
    if gpu is None:
        from .trt_import import import_cudart

        gpu = cuda_device(import_cudart())
    sm, cuda_name = gpu
    return DeviceFacts(tensorrt_version, read_l4t(root), sm, read_device_model(root) or cuda_name)


def state_dir(explicit: str | Path | None = None) -> Path:
    """Where engines are cached: `explicit`, $EDGEKIT_STATE_DIR, $XDG_STATE_HOME/edgekit or ~/.local/state/edgekit
    (edgekitd passes its own state directory, /var/lib/edgekit)."""
    if explicit is not None:
        return Path(explicit)
    if os.environ.get("EDGEKIT_STATE_DIR"):
        return Path(os.environ["EDGEKIT_STATE_DIR"])
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "edgekit"
