"""Kernel table of prefill steps, through the public `LLM` API only, so any source tree can run it
(`scripts/gpu_check.sh kernels` runs it per tree of COMPARE_TREES and writes one JSON per tree).

Per workload: wall time of the step (median of 10), the summed kernel time, and the top kernels
with their per-step time and count; the JSON keeps every kernel for a diff between trees."""
import json, statistics, sys, time

# run against the tree on PYTHONPATH, not the editable install of this checkout
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]

import torch

import tscompile
from tscompile import SamplingParams


def run_once(llm, prompts):
    for p in prompts:
        llm.add_request(p, SamplingParams(max_new_tokens=1))
    while llm.has_unfinished():
        llm.step()
    if hasattr(llm, "sync"):
        llm.sync()


def _kernel_table_module():
    """This checkout's bench/kernel_table.py, by file path: the trees this script compares may predate it."""
    import importlib.util, pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "kernel_table.py"
    spec = importlib.util.spec_from_file_location("bench_kernel_table", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up while the class is built
    spec.loader.exec_module(module)
    return module


def kernels_of(fn, reps=3):
    """CUDA kernels of ``fn``, per call: name -> (launches, microseconds)."""
    return _kernel_table_module().kernel_times(fn, reps)


def main(out_path):
    workloads = {"prefill_2048": [[(j * 7) % 1000 + 1 for j in range(2048)]],
                 "prefill_32": [[(j * 7) % 1000 + 1 for j in range(32)]],
                 "ttft_32x512": [[(i * 31 + j) % 1000 + 1 for j in range(512)] for i in range(32)]}
    llm = tscompile.LLM("llama-1b", attention_backend="triton", dtype="bfloat16", max_num_seqs=32,
                        max_model_len=2064, page_size=16, max_num_batched_tokens=16384)
    report = {}
    for name, prompts in workloads.items():
        for _ in range(3):
            run_once(llm, prompts)
        times = []
        for _ in range(10):
            torch.cuda.synchronize(); t0 = time.perf_counter()
            run_once(llm, prompts)
            torch.cuda.synchronize(); times.append((time.perf_counter() - t0) * 1e3)
        table = kernels_of(lambda: run_once(llm, prompts))
        total = sum(t for _, t in table.values()) / 1e3
        count = sum(c for c, _ in table.values())
        print(f"== {name}: wall median {statistics.median(times):.3f} ms (min {min(times):.3f}); "
              f"{count:.0f} kernels, {total:.3f} ms summed kernel time", flush=True)
        for k, (c, t) in sorted(table.items(), key=lambda kv: -kv[1][1])[:25]:
            print(f"  {t:9.1f} us  x{c:4.0f}  {k[:120]}", flush=True)
        report[name] = {"wall_ms": times, "kernel_ms": total, "kernels": count,
                        "table": {k: [c, t] for k, (c, t) in table.items()}}
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
