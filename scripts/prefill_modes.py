"""Piecewise vs whole-step prefill graphs, one llama-1b engine per mode in one process.

    python3 scripts/prefill_modes.py OUT.json [--model llama-1b] [--iters 20]

Per workload (one prompt of 32 / 512 / 2048 tokens, 32 prompts of 512 tokens): the wall time of
submitting the prompts and reading back their first tokens (median, min, max of ``--iters`` after 3
warm-ups), the engines measured in turns so drift hits both alike; the summed kernel time of one
step from the profiler; whether the first tokens agree between the modes; and the engine's prefill
graph counters (graphed vs eager steps). Prints a markdown table and writes the JSON."""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402

import tscompile  # noqa: E402
from prefill_kernels import kernels_of  # noqa: E402
from tscompile import SamplingParams  # noqa: E402
from tscompile.counters import counters  # noqa: E402

MODES = ("piecewise", "whole")


def first_tokens(llm, prompts):
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=1))
    return [o.outputs[0].token_ids[0] for o in outs]


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(llm, prompts):
    sync()
    t0 = time.perf_counter()
    first_tokens(llm, prompts)
    sync()
    return (time.perf_counter() - t0) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cuda", help="cpu runs the logic only (no graphs, no kernel table)")
    ap.add_argument("--lens", type=int, nargs="+", default=[32, 512, 2048], help="single-prompt lengths")
    ap.add_argument("--ttft", default="32x512", help="PROMPTSxTOKENS of the batched workload")
    args = ap.parse_args()
    workloads = {f"prefill_{n}": [[(j * 7) % 250 + 1 for j in range(n)]] for n in args.lens}
    n_prompts, n_tokens = (int(x) for x in args.ttft.split("x"))
    workloads[f"ttft_{args.ttft}"] = [[(i * 31 + j) % 250 + 1 for j in range(n_tokens)] for i in range(n_prompts)]
    engines, build_s = {}, {}
    for mode in MODES:
        t0 = time.perf_counter()
        engines[mode] = tscompile.LLM(args.model, attention_backend="triton", device=args.device,
                                      dtype="bfloat16" if args.device == "cuda" else "float32", max_num_seqs=32,
                                      max_model_len=2064, page_size=16, max_num_batched_tokens=16384,
                                      compile_options={"prefill_graph_mode": mode,
                                                       # only prefill is timed: one decode size compiles quickest
                                                       "decode_ladder": (1,)})
        build_s[mode] = time.perf_counter() - t0
    if args.device == "cuda":
        assert engines["whole"].runner.prefill.whole is not None, "the whole-step mode fell back to piecewise"
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__, "model": args.model,
              "build_seconds": build_s, "workloads": {}}
    rows = []
    for name, prompts in workloads.items():
        entry = {}
        tokens = {m: first_tokens(engines[m], prompts) for m in MODES}  # also the first compile/capture
        for m in MODES:
            for _ in range(2):
                first_tokens(engines[m], prompts)
        times = {m: [] for m in MODES}
        for _ in range(args.iters):
            for m in MODES:
                times[m].append(timed(engines[m], prompts))
        for m in MODES:
            counters.clear()
            table = kernels_of(lambda: first_tokens(engines[m], prompts), reps=3) if args.device == "cuda" else {}
            graphed = {k: counters[k] / 3 for k in ("prefill_graphed", "prefill_eager", "prefill_captures")}
            kernel_ms = sum(t for _, t in table.values()) / 1e3
            entry[m] = {"wall_ms": times[m], "median_ms": statistics.median(times[m]), "kernel_ms": kernel_ms,
                        "kernels": sum(c for c, _ in table.values()), "counters_per_run": graphed}
            rows.append((name, m, statistics.median(times[m]), min(times[m]), max(times[m]), kernel_ms,
                         entry[m]["kernels"], graphed["prefill_graphed"]))
        entry["first_tokens_equal"] = tokens["piecewise"] == tokens["whole"]
        report["workloads"][name] = entry
    lines = ["| workload | mode | wall ms (median) | min-max | kernel ms | kernels | graphed steps | tokens equal |",
             "|---|---|---|---|---|---|---|---|"]
    for name, m, med, lo, hi, kms, n, g in rows:
        same = report["workloads"][name]["first_tokens_equal"]
        lines.append(f"| {name} | {m} | {med:.3f} | {lo:.3f}-{hi:.3f} | {kms:.3f} | {n:.0f} | {g:.0f} | {same} |")
    print("\n".join(lines))
    report["table_md"] = "\n".join(lines)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
