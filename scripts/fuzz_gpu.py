"""The engine fuzz on compiled engines: many seeded compositions, two checks each.

    python3 scripts/fuzz_gpu.py OUT.json [--count 1000] [--max-seconds 420] [--device cuda]
    python3 scripts/fuzz_gpu.py /tmp/fuzz.json --device cpu --count 20      # the logic, on the CPU

1. Batched equals one at a time (``tests/fuzz_lib.py``): per page size (1, 16, 64) one compiled
   llama-tiny engine under pressure (4 sequences, a small token budget, a pool of one request)
   reused for every composition, against a compiled engine running each prompt alone.
2. Graph replay equals the run without graphs at the same padded size (``fuzz_lib.GraphCheck``):
   each composition runs again, from an empty prefix cache as the first run, on the same pressured
   engine with replay switched off
   (``llm.runner.graphs.replay = False``, the one switch of decode, whole-step prefill and
   piecewise graphs: the same ladder padding, the same metadata refresh, the same compiled step,
   launched without its graph); the tokens must be identical, the batched run must have replayed
   at least one graph and the rerun none (else the composition fails). With
   ``--bf16`` a bfloat16 engine (page size 16) is added on which only this check runs (another
   batch shape rounds differently in bfloat16, so batched-vs-single is not exact there).
3. With ``--speculative METHOD...`` (ngram, replay, draft_model): per method a float32 engine of
   page size 16 with speculative decoding, its verify windows replayed as (bs, N) graphs; its
   greedy compositions (``fuzz_lib``: speculation draws sampled tokens from other random numbers)
   are checked against the plain one-at-a-time engine and by the graph check (which turns a draft
   model's graphs off too, and wants every verify step replayed as a graph). ``--fused-verify``:
   those engines run ``KernelPolicy.fused_verify_attention``.

Prints a JSON summary (count, seconds, compile seconds, coverage, graph counters, failures) and
writes it to OUT.json. The exit status is 1 when any composition failed. On the CPU the engines
run eagerly (``--compile`` compiles them; slow) and there are no graphs to check.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # fuzz_lib lives with the tests

import torch  # noqa: E402

from fuzz_lib import (PAGE_SIZES, SPECULATIVE_CONFIGS, Coverage, Fuzzer, GraphCheck, build_engine,  # noqa: E402
                      pressured_spec, reference_spec)
from tscompile.counters import counters  # noqa: E402

GPU_MAX_NUM_SEQS = 4  # with decode_ladder (1, 2, 4): a batch of 3 replays the graph padded to 4
COMPILE_OPTIONS = {"decode_ladder": (1, 2, 4)}
MAX_FAILURES_KEPT = 20


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="where the JSON summary is written")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--count", type=int, default=1000, help="compositions to run (round robin over the engines)")
    ap.add_argument("--max-seconds", type=float, default=420.0,
                    help="stop drawing compositions after this long (compile included); the summary says so")
    ap.add_argument("--bf16", action="store_true", help="add a bfloat16 engine for the graph check alone")
    ap.add_argument("--compile", action="store_true", help="compile on the CPU too (on CUDA engines always compile)")
    ap.add_argument("--eager-reference", action="store_true",
                    help="run the one-at-a-time references eagerly (half the compiles; the oracle then also "
                         "spans compiled vs eager kernels, whose float32 rounding may differ)")
    ap.add_argument("--speculative", nargs="+", choices=sorted(SPECULATIVE_CONFIGS), default=[],
                    help="add a float32 engine with speculative decoding per method (page size 16, greedy "
                         "compositions)")
    ap.add_argument("--fused-verify", action="store_true",
                    help="the --speculative engines run KernelPolicy.fused_verify_attention (the verify window's "
                         "K/V rows written in its attention kernel, PDL)")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--page-sizes", type=int, nargs="+", default=list(PAGE_SIZES))
    ap.add_argument("--cpu-threads", type=int, default=1,
                    help="torch intra-op threads (the engines are tiny: more threads only spin on a busy host)")
    return ap.parse_args(argv)


def make_engine_factory(args, dtype, on_cuda, built: list, *, compiled: bool, kernels: dict | None = None):
    kw = dict(device=args.device, dtype=dtype, attention_backend="triton" if on_cuda else "torch",
              enforce_eager=not compiled)
    if compiled:
        kw["compile_options"] = {**COMPILE_OPTIONS, **({"kernels": kernels} if kernels else {})}

    def make(spec):
        start = time.perf_counter()
        llm = build_engine(spec, **kw)
        llm.fuzz_name = f"{spec.name}/{str(dtype).removeprefix('torch.')}{'' if compiled else '/eager'}"
        built.append({"engine": llm.fuzz_name, "build_seconds": round(time.perf_counter() - start, 2)})
        return llm

    return make


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.cpu_threads)
    start = time.perf_counter()
    on_cuda = torch.device(args.device).type == "cuda"
    if on_cuda and not torch.cuda.is_available():
        raise SystemExit("fuzz_gpu: --device cuda but no CUDA device; pass --device cpu to run the logic on the CPU")
    graph_check = GraphCheck()
    compiled = on_cuda or args.compile
    built = []
    make32 = make_engine_factory(args, torch.float32, on_cuda, built, compiled=compiled)
    make_reference = make_engine_factory(args, torch.float32, on_cuda, built,
                                         compiled=compiled and not args.eager_reference)
    fuzzers, references = [], {}
    for p in args.page_sizes:
        spec = pressured_spec("llama-tiny", p, max_num_seqs=GPU_MAX_NUM_SEQS)
        references[p] = make_reference(reference_spec("llama-tiny", p))
        fuzzers.append(Fuzzer(spec, make32, reference=references[p], extra=graph_check if on_cuda else None))
    make_speculative = (make_engine_factory(args, torch.float32, on_cuda, built, compiled=compiled,
                                            kernels={"fused_verify_attention": True})
                        if args.fused_verify else make32)
    for method in args.speculative:
        spec = pressured_spec("llama-tiny", 16, max_num_seqs=GPU_MAX_NUM_SEQS)
        spec = replace(spec, name=f"{spec.name}/{method}", speculative_config=SPECULATIVE_CONFIGS[method])
        if 16 not in references:
            references[16] = make_reference(reference_spec("llama-tiny", 16))
        fuzzers.append(Fuzzer(spec, make_speculative, reference=references[16], extra=graph_check if on_cuda else None))
    if args.bf16:
        make16 = make_engine_factory(args, torch.bfloat16, on_cuda, built, compiled=compiled)
        spec = pressured_spec("llama-tiny", 16, max_num_seqs=GPU_MAX_NUM_SEQS)
        fuzzers.append(Fuzzer(replace(spec, oracle="none"), make16, extra=graph_check if on_cuda else None))
    setup_seconds = time.perf_counter() - start
    failures, ran, stopped_early = [], 0, False
    for i in range(args.count):
        if time.perf_counter() - start > args.max_seconds:
            stopped_early = True
            break
        seed = args.first_seed + i
        fuzzer = fuzzers[i % len(fuzzers)]
        failure = fuzzer.check(seed)
        ran += 1
        if failure is not None:
            failures.append(f"seed {seed} on {fuzzer.llm.fuzz_name}:\n{failure}")
            print(failures[-1], file=sys.stderr, flush=True)
        if (i + 1) % 100 == 0:
            print(f"{i + 1} compositions, {time.perf_counter() - start:.0f} s, {len(failures)} failed",
                  file=sys.stderr, flush=True)
    coverage = Coverage()
    for f in fuzzers:
        coverage.merge(f.coverage)
    engines = [f.llm for f in fuzzers] + [f.reference for f in fuzzers if f.reference is not None]
    summary = {
        "device": torch.cuda.get_device_name() if on_cuda else "cpu",
        "torch": torch.__version__,
        "count": ran,
        "count_requested": args.count,
        "stopped_early_at_max_seconds": stopped_early,
        "seconds": round(time.perf_counter() - start, 1),
        "setup_seconds": round(setup_seconds, 1),
        "compile_seconds": round(sum(e.compile_seconds for e in engines), 1),
        "capture_seconds": round(sum(e.capture_seconds for e in engines), 1),
        "engines": built,
        "per_engine_compositions": {f.llm.fuzz_name: f.coverage.counts["compositions"] for f in fuzzers},
        "coverage": dict(coverage.counts),
        "graph_check": ({"compositions": graph_check.compositions, "graphs_on": dict(graph_check.graphs_on),
                         "graphs_off": dict(graph_check.graphs_off),
                         "totals": {k: counters[k] for k in ("decode_replays", "decode_captures", "prefill_replays",
                                                              "prefill_captures")}}
                        if on_cuda else "skipped: no CUDA graphs on the CPU"),
        "num_failures": len(failures),
        "failures": failures[:MAX_FAILURES_KEPT],
    }
    text = json.dumps(summary, indent=1)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
