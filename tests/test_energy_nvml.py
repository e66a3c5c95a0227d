"""NVML's total-energy counter: the counter logic as pure functions here; the meter itself only on a machine with
nvidia-ml-py and an NVIDIA GPU (skipped elsewhere, naming what is missing)."""

import importlib.util
import time

import pytest

from edgekit.energy import MeterReadError, MeterUnavailableError, NvmlMeter, Sampler
from edgekit.energy.counters import Unwrapper

HAS_PYNVML = importlib.util.find_spec("pynvml") is not None


def test_the_mj_counter_accumulates_and_a_driver_reload_is_refused():
    u = Unwrapper(1_000_000, None)  # mJ since the driver loaded; 64-bit: no wrap range
    assert u.update(1_002_500) == 2_500
    assert u.update(1_010_000) == 10_000
    with pytest.raises(MeterReadError, match="reset"):
        u.update(40)  # the driver was reloaded: the counter restarted


@pytest.mark.skipif(HAS_PYNVML, reason="nvidia-ml-py is installed: the missing-library message is not shown here")
def test_without_nvidia_ml_py_the_meter_says_how_to_get_it():
    with pytest.raises(MeterUnavailableError) as e:
        NvmlMeter()
    assert "pip install nvidia-ml-py" in str(e.value) and e.value.path == "pynvml"


def _gpu_meter():
    if not HAS_PYNVML:
        pytest.skip("nvidia-ml-py (pynvml) is not installed")
    try:
        return NvmlMeter(0)
    except MeterUnavailableError as e:
        pytest.skip(f"no NVIDIA GPU with an energy counter: {e}")


def test_a_real_gpu_counts_energy_and_the_sampler_integrates_it():
    m = _gpu_meter()
    assert m.source == "measured:nvml:gpu0"
    first = m.read()
    assert first.watts > 0 and first.energy_j >= 0
    with Sampler([m], 0.05) as s, s.window() as w:
        time.sleep(0.5)
    assert w.source == "measured:nvml:gpu0"
    assert 0 < w.joules < 2000 * w.seconds  # an idle-to-busy GPU draws between 0 and 2 kW
