"""Does a finished torch.profiler session slow the host work that follows it? The engine as ``tscompile
bench`` builds it (llama-1b, bf16, triton), one process: the bs=1 prefill's wall and host-until-launch
times, and a bs=1 decode's TPOT, before any profiler ran, then after ``--profiles`` profiler sessions
like the bench's kernel tables (``kernel_table.profile_calls``), then after a second round.

    python3 scripts/profiler_after_effect.py [--lens 32 128] [--iters 30] [--json PATH]

Why: the bench profiled each row right after its timed runs, so every later row of the same process
was timed after a profiler session; the 32-token prefill's host-until-launch varied 0.33-0.96 ms
between bench processes of the same code (bench/results/gpu-2026-12-03c/)."""
import argparse
import json
import statistics

import torch

from tscompile.bench import kernel_table, workloads


def _measure(runner, prompts: dict[int, list[int]], iters: int, decode_prompt: list[int]) -> dict:
    out = {}
    for length, prompt in prompts.items():
        walls, launches = [], []
        for _ in range(iters):
            walls.append(runner.run_prefill(prompt) * 1e3)
            launches.append(runner.host_launch_s * 1e3)
        out[f"prefill_{length}"] = {"wall_ms": statistics.median(walls), "host_until_launch_ms": statistics.median(launches),
                                    "wall_min_ms": min(walls), "host_min_ms": min(launches)}
    tpots = []
    for _ in range(3):
        run = runner.run_batch([decode_prompt], 64)
        tpots.append(run.decode_s / run.decode_steps * 1e3)
    out["decode_bs1_tpot_ms"] = statistics.median(tpots)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lens", type=int, nargs="+", default=[32, 128])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--profiles", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    device = torch.device(a.device)
    runner = workloads.bench_engine(a.model, device)
    prompts = {n: [(7 * i) % 1000 + 1 for i in range(n)] for n in a.lens}
    decode_prompt = [(3 * i) % 1000 + 1 for i in range(512 if device.type == "cuda" else 64)]
    for prompt in prompts.values():  # captures and warm-up
        for _ in range(3):
            runner.run_prefill(prompt)
    runner.run_batch([decode_prompt], 64)
    result = {"before": _measure(runner, prompts, a.iters, decode_prompt)}
    print("before any profiler:", json.dumps(result["before"]), flush=True)
    for round_ in (1, 2):
        for _ in range(a.profiles):
            kernel_table.profile_calls(lambda: runner.run_prefill(prompts[a.lens[0]]), 3, device.type)
        result[f"after_{round_}"] = _measure(runner, prompts, a.iters, decode_prompt)
        print(f"after {round_ * a.profiles} profiler sessions:", json.dumps(result[f"after_{round_}"]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
