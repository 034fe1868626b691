"""Where the host time of a bs=1 prefill goes on the GPU: the engine as ``tscompile bench`` builds it
(llama-1b, bf16, triton, bs up to 32), then per prefill the host time in each phase of the step that
launches it, from perf_counter wrappers around the engine's own methods.

    python3 scripts/prefill_host_phases.py [prompt_len ...] [--iters N] [--json PATH]

Phases (nested ones are listed under their parent): ``add_request``; the launching ``step`` with
``schedule``, ``launch`` and inside it ``stage`` (the metadata into the bucket's staging and its
upload), ``publish`` (the attention metadata views), ``sampling`` (fill + upload of the sampling
inputs) and ``replay`` (``CUDAGraph.replay``); then the rest until the token is back (``finish``).
The wrappers add about a microsecond each."""
import argparse
import collections
import json

import torch

from tscompile.bench import workloads

TIMES: dict[str, float] = collections.defaultdict(float)


def _timed(obj, name: str, label: str) -> None:
    def record(seconds: float) -> None:
        TIMES[label] += seconds

    workloads.time_method(obj, name, record)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("lens", type=int, nargs="*", default=[32, 128, 512])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    runner = workloads.bench_engine("llama-1b", "cuda")
    llm = runner.llm
    out = {}
    for length in a.lens:
        prompt = [(7 * i) % 1000 + 1 for i in range(length)]
        for _ in range(5):
            runner.run_prefill(prompt)
        TIMES.clear()
        wrapped = [(llm, "add_request", "add_request"), (llm, "step", "step"), (llm.scheduler, "schedule", "schedule"),
                   (llm.runner, "launch", "launch"), (llm.runner.prefill.whole, "stage", "stage"),
                   (llm.runner.attention, "publish_extend_metadata", "publish"),
                   (llm.runner.staging, "fill_sampling", "sampling"), (llm.runner.staging, "upload", "sampling"),
                   (torch.cuda.CUDAGraph, "replay", "replay")]
        wrapped = [w for w in wrapped if w[0] is not None]  # no whole-step prefill: its phases stay out
        saved = [(obj, name, getattr(obj, name)) for obj, name, _ in wrapped]
        for obj, name, label in wrapped:
            _timed(obj, name, label)
        walls, launches = [], []
        for _ in range(a.iters):
            walls.append(runner.run_prefill(prompt))
            launches.append(runner.host_launch_s)
        for obj, name, fn in saved:
            setattr(obj, name, fn)
        per = {k: v / a.iters * 1e3 for k, v in TIMES.items()}
        walls.sort()
        launches.sort()
        out[length] = {"wall_ms_median": walls[len(walls) // 2] * 1e3,
                       "host_until_launch_ms_median": launches[len(launches) // 2] * 1e3, "phases_ms_mean": per}
        print(f"{length} tokens: wall {out[length]['wall_ms_median']:.3f} ms, host until launch "
              f"{out[length]['host_until_launch_ms_median']:.3f}; mean per prefill (all step calls): "
              + ", ".join(f"{k} {v:.3f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1])), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
