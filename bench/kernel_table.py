"""Kernel tables: what one step of a workload runs, from ``torch.profiler``.

On CUDA the table lists device activities (kernels, memcpy, memset), graph-internal ones too: the
profiler sees the kernels a CUDA-graph replay runs. On the CPU there are no kernels: it lists the
profiler's CPU ops by self time (an op's time less its children's, so nested ops are not counted
twice).

Achieved bandwidth per kernel is given only where its bytes are known: a kernel that is the only
kernel launched by an aten matmul op (``MATMUL_OPS``) whose input shapes the profiler recorded; its
bytes are the op's inputs, read at least once, so the figure is a lower bound. A kernel launched
inside a CUDA graph replay or by Inductor's generated code (a fused Triton matmul) has no aten op
behind it: "-".

This module imports only torch and the standard library.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Callable

import torch

DEFAULT_STEPS = 3
DEFAULT_TOP = 15
# A pause longer than this between kernels is the host's: a step's CUDA graph runs its kernels a few
# us apart, while the host work between two profiled calls (admitting a request, its metadata, the
# read-back) takes 100 us or more. So kernels closer than this belong to one burst. On the H200 a
# decode step's graph was one burst, a bs=1 prefill three (its staging copies and its graph).
BURST_GAP_US = 20.0
MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"})
# element sizes of the dtype names the profiler records (c10's names); others fall back to the
# caller's dtype, the bench's one dtype for weights and activations
_ITEMSIZE = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "c10::Float8_e4m3fn": 1,
             "c10::Float8_e5m2": 1, "signed char": 1, "unsigned char": 1, "int": 4, "long int": 8}


@dataclass
class KernelStat:
    count: int = 0
    us: float = 0.0
    matmul_bytes: int = 0  # inputs of the launching matmul op, while every launch had one
    attributable: bool = True


def _synchronize(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()


def _activities(device_type: str) -> list:
    from torch.profiler import ProfilerActivity

    # the CPU activity also on CUDA: the aten ops that launched the kernels carry their input shapes
    return [ProfilerActivity.CPU, ProfilerActivity.CUDA] if device_type == "cuda" else [ProfilerActivity.CPU]


def new_profiler(device_type: str):
    """An unstarted ``torch.profiler.profile`` for ``device_type``; shapes recorded for the matmul bytes."""
    from torch.profiler import profile

    return profile(activities=_activities(device_type), record_shapes=True)


def _input_bytes(event, default_itemsize: int) -> int:
    """Bytes of a CPU op's tensor inputs (non-tensor arguments have an empty shape and are skipped)."""
    dtypes = list(getattr(event, "input_dtypes", None) or [])
    total = 0
    for i, shape in enumerate(event.input_shapes or []):
        if not shape:
            continue
        size = _ITEMSIZE.get(dtypes[i], default_itemsize) if i < len(dtypes) else default_itemsize
        total += math.prod(shape) * size
    return total


def _device_events(events) -> list:
    # a record_function range (Inductor's "## Call CompiledFxGraph ... ##" around each compiled graph
    # it runs) shows up on the device timeline too, spanning the kernels it launched: not a kernel
    return [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
            and not getattr(e, "is_user_annotation", False)]


@dataclass
class DeviceTimeline:
    busy_us: float  # the union of the kernels' intervals: kernels that overlap (PDL) count once
    bursts: list[tuple[float, float]]  # (span, busy) us of each run of kernels no pause splits


def _timeline(intervals: list[tuple[float, float]]) -> DeviceTimeline:
    """Busy time and bursts of device ``intervals`` (start, end) in us, in any order."""
    bursts: list[tuple[float, float]] = []
    start = end = burst_busy = None
    for lo, hi in sorted(intervals):
        if end is not None and lo - end > BURST_GAP_US:
            bursts.append((end - start, burst_busy))
            start = end = None
        if end is None:
            start, end, burst_busy = lo, hi, hi - lo
        elif hi > end:
            burst_busy += hi - max(lo, end)  # only the part past what is already covered
            end = hi
    if end is not None:
        bursts.append((end - start, burst_busy))
    return DeviceTimeline(sum(b for _, b in bursts), bursts)


def timeline_of(prof, device_type: str) -> DeviceTimeline | None:
    """The device timeline of a profile (CUDA only): busy time and bursts of its kernels and copies."""
    if device_type != "cuda":
        return None
    return _timeline([(k.time_range.start, k.time_range.end) for k in _device_events(prof.events())])


def _cuda_stats(events, default_itemsize: int) -> dict[str, KernelStat]:
    stats: dict[str, KernelStat] = collections.defaultdict(KernelStat)
    for k in _device_events(events):
        s = stats[k.name]
        s.count += 1
        s.us += k.time_range.end - k.time_range.start
    # The profiler hands each CPU op the device activities it launched (``FunctionEvent.kernels``, in
    # every torch this project supports; the per-event linked id behind it is public only from 2.13).
    # One kernel per op: a split-K matmul's second kernel would get bytes it did not read.
    ranges = {e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA
              and getattr(e, "is_user_annotation", False)}
    launches: collections.Counter = collections.Counter()
    matmul_bytes: collections.Counter = collections.Counter()
    for op in events:
        if op.device_type != torch.autograd.DeviceType.CPU or op.is_async or op.name not in MATMUL_OPS:
            continue
        kernels = [k for k in getattr(op, "kernels", None) or [] if k.name not in ranges]
        if len(kernels) == 1 and op.input_shapes:
            launches[kernels[0].name] += 1
            matmul_bytes[kernels[0].name] += _input_bytes(op, default_itemsize)
    for name, s in stats.items():
        s.attributable = launches[name] == s.count  # every launch of this kernel was a matmul op's only one
        s.matmul_bytes = matmul_bytes[name] if s.attributable else 0
    return dict(stats)


def _cpu_stats(events, default_itemsize: int) -> dict[str, KernelStat]:
    stats: dict[str, KernelStat] = collections.defaultdict(KernelStat)
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU or e.is_async:
            continue
        s = stats[e.name]
        s.count += 1
        s.us += e.self_cpu_time_total
        if e.name in MATMUL_OPS and e.input_shapes:
            s.matmul_bytes += _input_bytes(e, default_itemsize)
        else:
            s.attributable = False
    return stats


def stats_of(prof, device_type: str, default_itemsize: int = 2) -> dict[str, KernelStat]:
    """Per kernel (CUDA) or op (CPU) name: launches, summed microseconds, attributable matmul bytes."""
    events = prof.events()
    if device_type == "cuda":
        return _cuda_stats(events, default_itemsize)
    return _cpu_stats(events, default_itemsize)


def kernel_times(fn: Callable[[], object], reps: int = DEFAULT_STEPS) -> dict[str, tuple[float, float]]:
    """CUDA kernels of ``fn``, per call: name -> (launches, microseconds). The scripts' probe."""
    prof = new_profiler("cuda")
    torch.cuda.synchronize()
    with prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return {name: (s.count / reps, s.us / reps) for name, s in stats_of(prof, "cuda").items()}


class StepWindow:
    """Profiles steps ``start .. start + count - 1`` of a runner's decode loop, which calls
    ``before(i)`` and ``after(i)`` around its decode step ``i``; ``finish`` stops a window the run
    ended inside (fewer decode steps than asked for)."""

    def __init__(self, device_type: str, start: int, count: int):
        self.device_type, self.start, self.count = device_type, start, count
        self.prof = new_profiler(device_type)
        self.steps = 0
        self._running = False

    def before(self, i: int) -> None:
        if i == self.start:
            _synchronize(self.device_type)  # the earlier steps' kernels stay out of the window
            self.prof.start()
            self._running = True

    def after(self, i: int) -> None:
        if self._running:
            self.steps += 1
            if self.steps == self.count:
                self.finish()

    def finish(self) -> None:
        if self._running:
            _synchronize(self.device_type)
            self.prof.stop()
            self._running = False


def profile_calls(fn: Callable[[], object], reps: int, device_type: str):
    """A stopped profiler over ``reps`` calls of ``fn`` (one call = one step)."""
    prof = new_profiler(device_type)
    _synchronize(device_type)
    with prof:
        for _ in range(reps):
            fn()
        _synchronize(device_type)
    return prof


def table(stats: dict[str, KernelStat], steps: int, device_type: str, top: int,
          step_bytes: int | None = None, timeline: DeviceTimeline | None = None) -> dict:
    """The JSON of one row's kernel table: per step figures of every kernel summed, the ``top``
    kernels by time, and the step's achieved bandwidth (``step_bytes`` / summed kernel time).

    With the profile's ``timeline``: the device's busy time per step, and where the profile holds one
    burst per step, a step's span on the device from its first kernel's start to its last kernel's
    end; the span less the busy time is the pauses between the step's kernels."""
    total_us = sum(s.us for s in stats.values())
    ranked = sorted(stats.items(), key=lambda kv: -kv[1].us)
    rows = []
    for name, s in ranked[:top]:
        gbps = s.matmul_bytes / (s.us * 1e-6) / 1e9 if s.attributable and s.matmul_bytes and s.us > 0 else None
        rows.append({"name": name, "count_per_step": s.count / steps, "us_per_step": s.us / steps,
                     "share_pct": 100.0 * s.us / total_us if total_us > 0 else None, "gbps": gbps})
    kernel_ms = total_us / steps / 1e3
    return {"activity": "cuda kernels" if device_type == "cuda" else "cpu ops (self time)", "steps": steps,
            "top_n": top, "distinct": len(stats), "kernels_per_step": sum(s.count for s in stats.values()) / steps,
            "kernel_ms_per_step": kernel_ms, "step_bytes": step_bytes,
            "step_gbps": step_bytes / (kernel_ms * 1e-3) / 1e9 if step_bytes and kernel_ms > 0 else None,
            "top": rows, **_timeline_fields(timeline, steps)}


def _timeline_fields(timeline: DeviceTimeline | None, steps: int) -> dict:
    if timeline is None:
        return {}
    fields = {"device_busy_ms_per_step": timeline.busy_us / steps / 1e3, "device_bursts": len(timeline.bursts),
              "device_span_ms_per_step": None, "device_pause_ms_per_step": None}
    if len(timeline.bursts) == steps and steps > 0:
        span = sum(s for s, _ in timeline.bursts)
        fields["device_span_ms_per_step"] = span / steps / 1e3
        fields["device_pause_ms_per_step"] = (span - timeline.busy_us) / steps / 1e3
    return fields
