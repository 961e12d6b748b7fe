"""GPU busy share over a timed run, sampled from NVML in a background thread.

NVML's ``utilization.gpu`` is the share of its last sample period (1/6 s to 1 s,
by GPU) in which at least one kernel ran.  Sampled every ``period_s`` over a run,
its mean says how much of the run's wall time the GPU had work queued; the rest is
host-side time (scheduling, waits on transfers, Python) that no kernel change can win
back.  Used by ``scripts/kv_tier_bench.py`` to tell a slower config's extra wall time
apart: more or longer engine steps with the GPU busy, or the GPU idle between them.

Off the GPU (no NVML, no device), :class:`GpuBusySampler` records nothing and
:meth:`GpuBusySampler.summary` returns ``None`` fields: the benchmark still runs.
"""

from __future__ import annotations

import threading
from typing import Callable


def summarize(samples: list[float]) -> dict:
    """Mean, p10 and count of utilization samples (percent, 0-100); ``None`` fields
    when there are none."""
    if not samples:
        return {"gpu_busy_pct": None, "gpu_busy_p10": None, "gpu_busy_samples": 0}
    xs = sorted(float(x) for x in samples)
    for x in xs:
        if not 0.0 <= x <= 100.0:
            raise ValueError(f"utilization sample {x} outside 0..100")
    return {"gpu_busy_pct": sum(xs) / len(xs), "gpu_busy_p10": xs[int(0.1 * (len(xs) - 1))],
            "gpu_busy_samples": len(xs)}


def nvml_reader(device_index: int = 0) -> Callable[[], float] | None:
    """A function returning the GPU's current utilization (percent), or ``None`` when
    NVML or the device is not there."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        pynvml.nvmlDeviceGetUtilizationRates(h)
    except Exception:  # no NVML library, no driver, no such device
        return None
    return lambda: float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)


class GpuBusySampler:
    """``with GpuBusySampler() as s: run(); s.summary()`` samples ``read()`` every
    ``period_s`` in a daemon thread while the block runs."""

    def __init__(self, read: Callable[[], float] | None = None, period_s: float = 0.1,
                 device_index: int = 0):
        self.read = read if read is not None else nvml_reader(device_index)
        self.period_s = float(period_s)
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self.read())
            except Exception:  # a failed NVML read loses one sample, not the run
                pass
            self._stop.wait(self.period_s)

    def __enter__(self) -> "GpuBusySampler":
        if self.read is not None:
            self._thread = threading.Thread(target=self._loop, name="gpu-busy", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def summary(self) -> dict:
        return summarize(self.samples)
