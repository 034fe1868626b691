"""Why does the bs=1 prefill's host time differ between processes of the same code? One llama-1b engine
as ``tscompile bench`` builds it (bf16, triton), in one process: the 32-token prefill's wall and
host-until-launch medians and the host time per phase of the launching step, under several conditions
in turn, beside this process's CPU and a pure-Python and a torch host micro-benchmark.

    python3 scripts/host_spread.py [--len 32] [--iters 60] [--json PATH]

Run it as several processes in one GPU call: if the spread follows the micro-benchmarks, the process
runs on a slower core (placement, clocks), not slower code; if it follows one phase, that phase is the
one to fix. Conditions, in this order: ``base``, ``gc_off`` (``gc.disable()``), ``base_again``,
``gc_frozen`` (``gc.collect(); gc.freeze()``, what vLLM does after capture), ``pinned`` (the process
pinned to the CPU it was on). The phase wrappers add about a microsecond each.

Why: the 32-token prefill's host-until-launch read 0.28-0.96 ms in bench processes of the same code
(bench/results/gpu-2026-12-03c/, same-lease-d9df463/), a third of the row's wall time."""
import argparse
import collections
import gc
import json
import os
import statistics
import time

import torch

from tscompile.bench import workloads

TIMES: dict[str, list[float]] = collections.defaultdict(list)
GC_RUNS = collections.Counter()
GC_SECONDS = [0.0, 0.0]  # total, and the start time of the collection under way


def _timed(obj, name: str, label: str) -> None:
    # looked up per call: ``measure`` clears TIMES, so a bound list's append would record into a dropped list
    workloads.time_method(obj, name, lambda seconds: TIMES[label].append(seconds))


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        GC_RUNS[info["generation"]] += 1
        GC_SECONDS[1] = time.perf_counter()
    else:
        GC_SECONDS[0] += time.perf_counter() - GC_SECONDS[1]


def current_cpu() -> int:
    """The CPU this process last ran on (field 39 of /proc/self/stat)."""
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


def python_us() -> float:
    """Median microseconds of a fixed pure-Python loop: this core's speed for interpreter work."""
    times = []
    for _ in range(30):
        start = time.perf_counter()
        acc = 0
        for i in range(20000):
            acc += i * i
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def torch_host_us(device: torch.device) -> float:
    """Median microseconds of a small pinned upload and an empty: the host side of a torch call."""
    src = torch.arange(256, dtype=torch.int32).pin_memory() if device.type == "cuda" else torch.arange(256)
    dst = torch.empty(256, dtype=torch.int32, device=device)
    times = []
    for _ in range(200):
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.empty(64, device=device)
        times.append(time.perf_counter() - start)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def measure(runner, prompt: list[int], iters: int) -> dict:
    TIMES.clear()
    GC_RUNS.clear()
    GC_SECONDS[0] = 0.0
    walls, launches = [], []
    for _ in range(iters):
        walls.append(runner.run_prefill(prompt) * 1e3)
        launches.append(runner.host_launch_s * 1e3)
    phases = {k: statistics.median(v) * 1e3 * (len(v) / iters) for k, v in TIMES.items()}
    return {"wall_ms": statistics.median(walls), "host_until_launch_ms": statistics.median(launches),
            "host_min_ms": min(launches), "host_max_ms": max(launches), "cpu": current_cpu(),
            "gc_runs": dict(GC_RUNS), "gc_ms_per_prefill": GC_SECONDS[0] * 1e3 / iters,
            "phases_ms_median_x_calls": phases}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--len", type=int, default=32)
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--json", default=None)
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default="triton")
    a = p.parse_args()
    device = torch.device(a.device)
    runner = workloads.bench_engine(a.model, device, backend=a.backend)
    llm = runner.llm
    prompt = [(7 * i) % 1000 + 1 for i in range(a.len)]
    for _ in range(10):
        runner.run_prefill(prompt)
    wrapped = [(llm, "add_request", "add_request"), (llm, "step", "step"), (llm.scheduler, "schedule", "schedule"),
               (llm.runner, "launch", "launch"), (llm.runner.prefill.whole, "stage", "stage"),
               (llm.runner.attention, "publish_extend_metadata", "publish"),
               (llm.runner.staging, "fill_sampling", "sampling"), (llm.runner.staging, "upload", "upload"),
               (torch.cuda.CUDAGraph, "replay", "replay")]
    for obj, name, label in wrapped:
        if obj is not None and hasattr(obj, name):
            _timed(obj, name, label)
    gc.callbacks.append(_on_gc)
    out = {"pid": os.getpid(), "cpus_allowed": len(os.sched_getaffinity(0)), "loadavg": os.getloadavg(),
           "gc_counts_at_start": gc.get_count(), "gc_tracked_objects": len(gc.get_objects()),
           "python_us": python_us(), "torch_host_us": torch_host_us(device), "conditions": {}}
    conds = out["conditions"]
    conds["base"] = measure(runner, prompt, a.iters)
    gc.disable()
    conds["gc_off"] = measure(runner, prompt, a.iters)
    gc.enable()
    conds["base_again"] = measure(runner, prompt, a.iters)
    gc.collect()
    gc.freeze()
    conds["gc_frozen"] = measure(runner, prompt, a.iters)
    gc.unfreeze()
    os.sched_setaffinity(0, {current_cpu()})
    conds["pinned"] = measure(runner, prompt, a.iters)
    out["python_us_after"] = python_us()
    print(json.dumps({k: v for k, v in out.items() if k != "conditions"}), flush=True)
    for name, c in conds.items():
        phases = ", ".join(f"{k} {v:.3f}" for k, v in sorted(c["phases_ms_median_x_calls"].items(), key=lambda kv: -kv[1]))
        print(f"{name}: wall {c['wall_ms']:.3f} ms, host until launch {c['host_until_launch_ms']:.3f} "
              f"({c['host_min_ms']:.3f}-{c['host_max_ms']:.3f}), cpu {c['cpu']}, gc {c['gc_runs']} "
              f"{c['gc_ms_per_prefill']:.3f} ms per prefill; {phases}",
              flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
