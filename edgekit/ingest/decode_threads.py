"""How many threads a study's JPEG 2000 decode may use: every CPU alone, a share when several decode at once.

JPEG 2000 is decoded by Pillow's OpenJPEG first (`decode.py`), which reads its thread count from OPJ_NUM_THREADS at
each decode; edgekit sets it. pydicom's first choice, GDCM, spreads each frame over as many threads as it sees CPUs:
sooner alone, but with ingest processes decoding side by side those threads cost CPU that other studies need
(`bench/j2k_decoders.py`). A deployment that sets OPJ_NUM_THREADS itself (systemd's Environment=, a container's env)
keeps its value. Free of pydicom and numpy: the CLI sets this before any command runs.
"""

from __future__ import annotations

import os

from edgekit.cpus import usable_cpus

THREADS_ENV = "OPJ_NUM_THREADS"
_written: str | None = None  # the value set_threads last wrote; any other value is the deployment's


def _deployments() -> bool:
    value = os.environ.get(THREADS_ENV)
    return value is not None and value != _written


def decode_threads(busy: int = 1) -> int:
    """OpenJPEG threads for one study's decode while `busy` studies (this one included) decode at once: the CPUs
    this process may keep busy (its affinity within its CPU quota: `edgekit.cpus`), shared among them, at least
    one."""
    return max(1, usable_cpus() // max(1, busy))


def set_threads(threads: int) -> None:
    """OpenJPEG's thread count for the decodes that follow, unless the deployment set OPJ_NUM_THREADS itself.

    setenv races getenv in other threads, so call it only where no other thread of this process decodes: an ingest
    worker between studies, a command before it starts threads."""
    global _written
    if not _deployments():
        _written = str(max(1, threads))
        os.environ[THREADS_ENV] = _written


def child_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a process this one starts: without the OPJ_NUM_THREADS this process set for itself, which the child
    would take for the deployment's own and keep."""
    if _written is not None and env.get(THREADS_ENV) == _written:
        env = {k: v for k, v in env.items() if k != THREADS_ENV}
    return env
