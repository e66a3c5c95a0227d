"""The Jetson power mode (nvpmodel): which budget the board runs under, recorded beside every energy figure.

Three texts say it, read in this order:
- `nvpmodel -q` prints `NV Power Mode: <NAME>` and the mode id on the next line (after any `NVPM WARN` lines);
  it is run only when asked (`run=True`), on the real root, with a timeout, and only if it is on PATH;
- `/var/lib/nvpmodel/status` (`pmode:0002 fmode:quiet`), the mode nvpmodel last set, named through the conf;
- `/etc/nvpmodel.conf` (`< POWER_MODEL ID=2 NAME=MODE_30W >` ... `< PM_CONFIG DEFAULT=2 >`): the default mode,
  which is the mode of a board nobody switched.
The mode matters for the Pareto front: on AGX Orin MAXN is not the most energy-efficient mode, so a profile
measured in one mode says little about another.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from edgekit.energy.sysfs import optional_text, under

CONF = "/etc/nvpmodel.conf"
STATUS = "/var/lib/nvpmodel/status"
_MODEL = re.compile(r"<\s*POWER_MODEL\s+ID=(\d+)\s+NAME=([^\s>]+)\s*>")
_DEFAULT = re.compile(r"<\s*PM_CONFIG\s+DEFAULT=(\d+)\s*>")


@dataclass(frozen=True)
class PowerMode:
    id: int | None
    name: str | None
    source: str  # which text said it


def parse_query(text: str) -> PowerMode | None:
    """`nvpmodel -q` output."""
    m = re.search(r"NV Power Mode:\s*(\S+)\s*\n\s*(\d+)", text)
    if m:
        return PowerMode(int(m.group(2)), m.group(1), "nvpmodel -q")
    m = re.search(r"NV Power Mode:\s*(\S+)", text)
    return PowerMode(None, m.group(1), "nvpmodel -q") if m else None


def parse_conf(text: str) -> tuple[dict[int, str], int | None]:
    """The modes (id -> name) and the default id of an nvpmodel.conf."""
    modes = {int(i): name for i, name in _MODEL.findall(text)}
    m = _DEFAULT.search(text)
    return modes, int(m.group(1)) if m else None


def parse_status(text: str) -> int | None:
    m = re.search(r"pmode:(\d+)", text)
    return int(m.group(1)) if m else None


def power_mode(root: str | Path = "/", *, run: bool = False, timeout_s: float = 5.0) -> PowerMode | None:
    """The current mode, or None on a machine without nvpmodel."""
    if run and Path(root) == Path("/") and shutil.which("nvpmodel"):
        try:
            out = subprocess.run(["nvpmodel", "-q"], capture_output=True, text=True, timeout=timeout_s)
            mode = parse_query(out.stdout + out.stderr)
            if mode is not None:
                return mode
        except (OSError, subprocess.SubprocessError):
            pass
    conf = optional_text(under(root, CONF))
    modes, default = parse_conf(conf) if conf else ({}, None)
    status = optional_text(under(root, STATUS))
    current = parse_status(status) if status else None
    if current is not None:
        return PowerMode(current, modes.get(current), f"{STATUS} + {CONF}" if modes else STATUS)
    if default is not None:
        return PowerMode(default, modes.get(default), f"{CONF} (default mode)")
    return None
