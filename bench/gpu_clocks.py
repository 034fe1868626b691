"""The GPU's SM clock and power while a row's timed runs ran, sampled by ``nvidia-smi`` beside them.

Why: on the H200 the bench's llama-8b 2048-token prefill rows ran at a median SM clock of 1575 MHz
back to back (the power cap held it down: throttle reason 0x4, "SW power cap") and 1965 MHz with a
pause between prefills: 48.3 against 43.5 ms of wall for the same graph. A row's figure is only
comparable with another run's at the same clocks, so every CUDA row records them. ``nvidia-smi`` rather than NVML bindings: it ships with the
driver, where ``pynvml`` is an extra package the GPU machines may lack.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile

import torch

SAMPLE_MS = 20
FIELDS = "clocks.sm,power.draw,clocks_throttle_reasons.active"
SW_POWER_CAP = 0x4  # nvmlClocksThrottleReasonSwPowerCap
HW_SLOWDOWN = 0x8 | 0x40 | 0x80  # HW slowdown, HW thermal, HW power brake


def summarize(lines: list[str]) -> dict | None:
    """Median / min SM clock (MHz), median / max power (W) and how many samples were power- or
    hardware-throttled, from ``nvidia-smi --format=csv,noheader,nounits`` lines of ``FIELDS``;
    None without a readable sample."""
    clocks, powers, capped, slowed = [], [], 0, 0
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            clock, power, reasons = float(parts[0]), float(parts[1]), int(parts[2], 16)
        except ValueError:  # "[N/A]", a header, a cut line
            continue
        clocks.append(clock)
        powers.append(power)
        capped += bool(reasons & SW_POWER_CAP)
        slowed += bool(reasons & HW_SLOWDOWN)
    if not clocks:
        return None
    return {"samples": len(clocks), "sm_mhz_median": statistics.median(clocks), "sm_mhz_min": min(clocks),
            "power_w_median": statistics.median(powers), "power_w_max": max(powers),
            "power_capped_share": capped / len(clocks), "hw_slowdown_share": slowed / len(clocks)}


def _smi_index(device: torch.device) -> str:
    """The ``nvidia-smi -i`` of a torch CUDA device: its entry of CUDA_VISIBLE_DEVICES where that is set."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible[index] if index < len(visible) else str(index)


class ClockSampler:
    """``with ClockSampler(device) as s: ...`` then ``s.summary`` (None off CUDA, without
    ``nvidia-smi``, or with no sample in time)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.summary: dict | None = None
        self._proc = None
        self._file = None

    def __enter__(self) -> "ClockSampler":
        smi = shutil.which("nvidia-smi")
        if self.device.type != "cuda" or smi is None:
            return self
        self._file = tempfile.TemporaryFile(mode="w+")
        try:
            self._proc = subprocess.Popen(
                [smi, f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits", "-lms", str(SAMPLE_MS),
                 "-i", _smi_index(self.device)], stdout=self._file, stderr=subprocess.DEVNULL)
        except OSError:
            self._proc = None
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._file.seek(0)
        self.summary = summarize(self._file.read().splitlines())
        self._file.close()
