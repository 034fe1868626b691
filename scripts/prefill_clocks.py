"""Where does a bs=1 prefill's wall time go beyond the host's pre-launch work and the kernels the
profiler times? The engine as ``tscompile bench`` builds it, one prompt length, in one process:

- per prefill the wall (CUDA events, as the bench), the host's time until launch, and the whole-step
  graph's own device time (CUDA events recorded just before and after ``CUDAGraph.replay``);
- the GPU's SM clock, power and throttle reasons sampled by ``nvidia-smi`` every 20 ms meanwhile;
- the same prefills again with a pause between them (``--pause-ms``), so the GPU idles between steps;
- one profiled prefill: the kernels' summed time, as the bench's kernel tables count it.

    python3 scripts/prefill_clocks.py [--model llama-8b] [--len 2048] [--iters 10] [--json PATH]

Why: llama-8b's 2048-token prefill read 48.44-49.71 ms of wall against 45.0-45.3 ms of kernels under
the profiler and 0.85 ms of host work (bench/results/gpu-2026-12-03c/ and gpu-2026-12-04/); llama-1b's
rows add up (wall = host + kernels)."""
import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time

import torch

from tscompile.bench import workloads

REPLAYS: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []


def _time_replays() -> None:
    replay = torch.cuda.CUDAGraph.replay

    def timed(graph):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay(graph)
        end.record()
        REPLAYS.append((start, end))

    torch.cuda.CUDAGraph.replay = timed


def _sample_gpu(path: str) -> subprocess.Popen:
    fields = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"
    return subprocess.Popen(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-lms", "20"],
                            stdout=open(path, "w"), stderr=subprocess.DEVNULL)


def _gpu_summary(path: str) -> dict:
    clocks, powers, reasons = [], [], set()
    for line in open(path):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 5:
            continue
        try:
            clocks.append(float(parts[1]))
            powers.append(float(parts[2]))
        except ValueError:
            continue
        reasons.add(parts[4])
    if not clocks:
        return {}
    return {"samples": len(clocks), "sm_clock_mhz_median": statistics.median(clocks), "sm_clock_mhz_min": min(clocks),
            "sm_clock_mhz_max": max(clocks), "power_w_median": statistics.median(powers), "power_w_max": max(powers),
            "throttle_reasons": sorted(reasons)}


def _run(runner, prompt: list[int], iters: int, pause_s: float, sample_path: str) -> dict:
    sampler = _sample_gpu(sample_path)
    time.sleep(0.3)
    walls, hosts, graphs = [], [], []
    try:
        for _ in range(iters):
            REPLAYS.clear()
            walls.append(runner.run_prefill(prompt) * 1e3)
            hosts.append(runner.host_launch_s * 1e3)
            graphs.append(sum(s.elapsed_time(e) for s, e in REPLAYS))
            if pause_s:
                time.sleep(pause_s)
    finally:
        sampler.terminate()
        sampler.wait()
    return {"wall_ms": statistics.median(walls), "wall_min_ms": min(walls), "wall_max_ms": max(walls),
            "host_until_launch_ms": statistics.median(hosts), "graph_replay_ms": statistics.median(graphs),
            "replays_per_prefill": len(REPLAYS), "gpu": _gpu_summary(sample_path)}


def _profiled_kernels_ms(runner, prompt: list[int]) -> float:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        runner.run_prefill(prompt)
    total_us = sum(e.device_time_total for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
                   and e.device_time_total and not e.key.startswith("cuda"))
    return total_us / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-8b")
    p.add_argument("--len", type=int, default=2048)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--pause-ms", type=float, default=300.0)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    device = torch.device("cuda")
    runner = workloads.bench_engine(a.model, device, max_num_seqs=64)
    prompt = [(7 * i) % 1000 + 1 for i in range(a.len)]
    for _ in range(3):
        runner.run_prefill(prompt)
    _time_replays()
    tmp = tempfile.mkdtemp()
    out = {"model": a.model, "len": a.len, "iters": a.iters,
           "back_to_back": _run(runner, prompt, a.iters, 0.0, os.path.join(tmp, "b2b.csv")),
           "paused": _run(runner, prompt, a.iters, a.pause_ms / 1e3, os.path.join(tmp, "paused.csv"))}
    out["profiled_kernels_ms"] = _profiled_kernels_ms(runner, prompt)
    print(json.dumps(out, indent=1), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
