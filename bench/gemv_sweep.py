"""``tscompile bench --gemv-sweep --model M``: time the Triton skinny matmul (``triton_gemv.gemv``)
against cuBLAS on the projection shapes of a model, at a few row counts, and say which launch table
entries the timings support.

The launch tables of ``custom_ops/triton_gemv.py`` (``DECODE_GEMV_CONFIGS`` at one row,
``BATCH_GEMV_CONFIGS`` at 2-32) list a launch only where a sweep on the GPU they apply to measured it
faster than cuBLAS; this is that sweep, for any model the engine builds (a preset or a checkpoint
directory: its weight shapes are read from the model built on the meta device, no weight is made).
Its JSON is what ``decode_table_from_sweep`` / ``batch_table_from_sweep`` read, and the markdown ends
with the table entries they give.

What is measured: bf16 (``--dtype``) ``out[M, N] = x[M, K] @ w[N, K].T`` with ``w`` as ``nn.Linear``
stores it, ``w`` random / sqrt(K) so outputs are about N(0, 1) for every K. On CUDA each timed call
reads a weight evicted from L2 since its last use: the timed function cycles over enough
independent weight copies to pass ``ROTATE_BYTES`` (4x an H200's 50 MB L2), and times are the median
of CUDA-graph replays (``triton.testing.do_bench_cudagraph``): device time per call without launch
overhead. On the CPU (the Triton interpreter) the same loop runs with wall-clock times, which say
nothing about a GPU: that path exists so the sweep's logic is tested without one.

Before timing, every launch's output (poisoned with NaN first) is compared with the float32 product;
a launch off by more than ``MAX_DIFF``, or one that fails to compile or launch, is recorded as such
and never picked.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
import torch.nn.functional as F

from tscompile.custom_ops import triton_gemv as tg
from tscompile.utils import resolve_device, resolve_dtype

from . import environment, report

ROTATE_BYTES = 200 << 20  # weight bytes each timed loop cycles through: 4x the H200's 50 MB L2
MAX_COPIES = 64  # below 3 MB a weight cycles through fewer than ROTATE_BYTES (the L2 may then serve some)
MAX_DIFF = 5e-2  # outputs ~N(0, 1): bf16 rounding of |y| < 8 is <= 0.016; a lost K chunk is ~1
REP_MS = 3  # per do_bench_cudagraph replay
CPU_REPEATS = 3
MODES = ("acc", "fma", "dot")
DEFAULT_ROWS = (1, 2, 4, 8)

# (BLOCK_N, BLOCK_K, num_warps, num_stages, mode) per kind of launch; each runs at split-K 1 and at
# the automatic split (``auto_split``), and in its "_sum" form at SUM_SPLITS (the partials summed by
# the last program of a column block). "fma": narrow column blocks with long contiguous K segments;
# "dot": 32-128 column weight tiles as the tensor-core operand (M padded to 16).
TILES = {
    "fma": [(4, 512, 4, 2, "fma"), (8, 512, 4, 2, "fma"), (16, 256, 4, 2, "fma")],
    "dot": [(64, 128, 4, 4, "dot"), (64, 256, 4, 3, "dot"), (128, 128, 8, 3, "dot"), (32, 128, 4, 4, "dot")],
    # "acc" (Inductor's GEMV reduction: the whole [M, BLOCK_N, BLOCK_K] product carried across K,
    # reduced once) at split 1: the launches coordinate-descent tuning chose for Inductor's one-row
    # llama-8b projections on the H200, and narrower ones whose accumulator fits at more rows
    "acc": [(1, 512, 8, 1, "acc"), (1, 2048, 8, 1, "acc"), (2, 4096, 8, 1, "acc"), (2, 4096, 16, 1, "acc"),
            (4, 4096, 4, 1, "acc"), (4, 2048, 16, 1, "acc"), (2, 2048, 8, 1, "acc"), (4, 1024, 8, 1, "acc"),
            (8, 512, 8, 1, "acc")],
}
SUM_SPLITS = (2, 4, 8)
FMA_MAX_ROWS = 8  # "fma" holds M x BLOCK_N x BLOCK_K products per chunk: past 8 rows only "dot" pays
DOT_SUM_MIN_ROWS = 8  # below it the split's in-kernel sum never beat split 1 on the H200
# the "acc" accumulator a thread may hold: Inductor's tuned one-row launch (4, 4096, 4 warps) holds 128
ACC_FLOATS_PER_THREAD = 128


def acc_fits(m: int, block_n: int, block_k: int, warps: int) -> bool:
    """Whether an "acc" launch's float32 accumulator (M padded to a power of two, x BLOCK_N x
    BLOCK_K) stays within ``ACC_FLOATS_PER_THREAD`` per thread: past that it spills to local memory."""
    return tg._next_pow2(m) * block_n * block_k <= ACC_FLOATS_PER_THREAD * 32 * warps


def launches(m: int, n: int, k: int, modes=MODES) -> list[tuple]:
    """The launches timed at ``m`` rows of an ``[n, k]`` weight: the module's default first, then each
    tile of ``modes`` (above), at split 1, the automatic split and (where it pays) its "_sum" splits."""
    configs = [tg.default_config(m, n, k)]

    def summed(block_n, block_k, warps, stages, mode, splits):
        # one launch per split the kernel would run (``split_layout`` reduces a split that would leave
        # programs without a K chunk): the same kernel timed twice would pick between its own noise
        effective = {}
        for s in sorted(set(splits) - {1}):
            effective.setdefault(tg.split_layout(k, block_k, s)[0], s)
        return [(block_n, block_k, s, warps, stages, f"{mode}_sum") for runs, s in effective.items() if runs > 1]

    for mode in modes:
        for block_n, block_k, warps, stages, _ in TILES[mode]:
            if mode == "fma" and m > FMA_MAX_ROWS:
                continue
            if mode == "acc":
                if acc_fits(m, block_n, block_k, warps):
                    configs += [(block_n, block_k, 1, warps, stages, "acc"),
                                *summed(block_n, block_k, warps, stages, "acc", SUM_SPLITS)]
                continue
            auto = tg.auto_split(n, k, block_n, block_k)
            configs += [(block_n, block_k, split, warps, stages, mode) for split in (1, auto)]
            if mode == "fma" or m >= DOT_SUM_MIN_ROWS:
                configs += summed(block_n, block_k, warps, stages, mode, (*SUM_SPLITS, auto))
    return list(dict.fromkeys(configs))


def projection_shapes(model: str) -> dict[tuple[int, int], list[str]]:
    """``(N, K)`` of every ``nn.Linear`` weight of ``model`` (a preset or a checkpoint directory; the
    model is built on the meta device) -> the projections with that shape, layer indices dropped
    (``layers.attention.wqkv``). A tied LM head is the embedding's shape."""
    from tscompile.models import model_config
    from tscompile.models.checkpoint import native_model

    with torch.device("meta"):
        net = native_model(model_config(model))
    shapes: dict[tuple[int, int], list[str]] = {}
    for name, module in net.named_modules():
        if isinstance(module, torch.nn.Linear):
            proj = ".".join(p for p in name.split(".") if not p.isdigit())
            names = shapes.setdefault(tuple(module.weight.shape), [])
            if proj not in names:
                names.append(proj)
    return shapes


def _weights(n: int, k: int, dtype: torch.dtype, device: torch.device, rotate: bool) -> list[torch.Tensor]:
    """Independent weights whose total passes ROTATE_BYTES on CUDA (one on the CPU)."""
    size = n * k * dtype.itemsize
    count = min(MAX_COPIES, max(1, -(-ROTATE_BYTES // size))) if rotate else 1
    gen = torch.Generator(device=device).manual_seed(n * 7 + k)
    return [torch.randn(n, k, device=device, dtype=dtype, generator=gen) * k ** -0.5 for _ in range(count)]


def _timer(device: torch.device):
    """fn -> seconds per call: CUDA-graph replays on CUDA, the median of a few wall-clock calls else."""
    if device.type == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench_cudagraph(fn, rep=REP_MS, return_mode="median") * 1e-3

    def wall(fn):
        fn()
        times = []
        for _ in range(CPU_REPEATS):
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
        return statistics.median(times)

    return wall


def _cycling(call, weights):
    """fn() for the timer: each call uses the next weight copy (a CUDA graph unrolls the calls)."""
    it = itertools.cycle(weights)
    return lambda: call(next(it))


def max_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (out.float() - ref).abs()
    return float("inf") if bool(diff.isnan().any()) else float(diff.max())


def sweep_shape(n: int, k: int, rows, modes, dtype: torch.dtype, device: torch.device) -> list[dict]:
    """One row per M: cuBLAS's time (``x @ w.T`` and ``F.linear``) and every launch's, or its error."""
    weights = _weights(n, k, dtype, device, rotate=device.type == "cuda")
    timer = _timer(device)
    out_rows = []
    for m in rows:
        gen = torch.Generator(device=device).manual_seed(1000 + m)
        x = torch.randn(m, k, device=device, dtype=dtype, generator=gen)
        ref = x.float() @ weights[0].float().T
        row = {"n": n, "k": k, "m": m, "bytes": (n * k + m * k + m * n) * dtype.itemsize, "copies": len(weights),
               "cublas": {}, "triton": {}}
        for name, fn in (("matmul", lambda w: x @ w.T), ("linear", lambda w: F.linear(x, w))):
            row["cublas"][name] = {"max_diff": max_diff(fn(weights[0]), ref), "s": timer(_cycling(fn, weights))}
        for config in launches(m, n, k, modes):
            out = torch.full((m, n), float("nan"), device=device, dtype=dtype)
            key = ",".join(map(str, config))
            try:
                tg.gemv(x, weights[0], out, config=config)
                entry = {"launch": list(config), "max_diff": max_diff(out, ref)}
                if entry["max_diff"] <= MAX_DIFF:
                    entry["s"] = timer(_cycling(lambda w, c=config, o=out: tg.gemv(x, w, o, config=c), weights))
            except Exception as exc:  # a tile past the shared memory or registers: recorded, never picked
                entry = {"launch": list(config), "error": f"{type(exc).__name__}: {str(exc)[:160]}"}
            row["triton"][key] = entry
        out_rows.append(row)
    return out_rows


def summarize(rows: list[dict]) -> dict:
    """One shape's rows -> the ``summary`` entry the table readers take: per M the best correct launch
    and its speedup over cuBLAS's best, and the M = 1 fields."""
    by_m = {}
    for r in rows:
        timed = [e for e in r["triton"].values() if "s" in e]
        cublas = min(e["s"] for e in r["cublas"].values())
        pick = min(timed, key=lambda e: e["s"]) if timed else None
        by_m[str(r["m"])] = {"best": pick["launch"] if pick else None, "us": pick["s"] * 1e6 if pick else None,
                             "cublas_us": cublas * 1e6, "speedup": cublas / pick["s"] if pick else None}
    one = by_m.get("1", {})
    return {"n": rows[0]["n"], "k": rows[0]["k"], "best_by_m": by_m, "best_m1": one.get("best"),
            "best_m1_us": one.get("us"), "cublas_m1_us": one.get("cublas_us"), "speedup_m1": one.get("speedup")}


def check_args(args: argparse.Namespace) -> tuple[list[int], list[str]]:
    """The sweep's rows and modes from the flags, or ValueError('tscompile: ...')."""
    try:
        rows = [int(m) for m in str(args.gemv_rows).split(",")] if args.gemv_rows else list(DEFAULT_ROWS)
    except ValueError:
        raise ValueError(f"tscompile: --gemv-rows {args.gemv_rows!r} must be comma-separated row counts "
                         f"(e.g. 1,4)") from None
    bad = [m for m in rows if not 1 <= m <= tg.MAX_ROWS]
    if bad:
        raise ValueError(f"tscompile: --gemv-rows {bad} outside [1, {tg.MAX_ROWS}] (the kernel's row limit; "
                         f"more rows are a GEMM): pass row counts in that range")
    modes = list(args.gemv_modes or MODES)
    for flag in ("speculative", "prefix_workload", "hf_model", "merge", "compare", "modes", "package"):
        if getattr(args, flag, None):
            raise ValueError(f"tscompile: --gemv-sweep times kernels alone and runs no engine; leave out "
                             f"--{flag.replace('_', '-')}")
    return sorted(set(rows)), modes


def run(args: argparse.Namespace) -> int:
    rows_m, modes = check_args(args)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype or ("bfloat16" if device.type == "cuda" else "float32"), device)
    shapes = projection_shapes(args.model)
    if args.gemv_shapes:
        wanted = set(args.gemv_shapes)
        every = sorted(p for names in shapes.values() for p in names)
        shapes = {s: names for s, names in shapes.items() if wanted & set(names)}
        if not shapes:
            raise ValueError(f"tscompile: --gemv-shapes {sorted(wanted)} names no projection of {args.model}; "
                             f"its projections: {every}")
    began = time.perf_counter()
    rows, summary = [], {}
    for (n, k), names in shapes.items():
        mine = sweep_shape(n, k, rows_m, modes, dtype, device)
        label = f"{args.model}/{'+'.join(names)}"
        for r in mine:
            r["shape"] = label
        rows += mine
        summary[label] = summarize(mine)
        print(f"bench: {label} [{n}, {k}] swept at M = {rows_m} ({time.perf_counter() - began:.0f} s)", flush=True)
    result = {"date": report.now_iso(), "env": environment.environment(device), "model": args.model,
              "device": str(device), "dtype": str(dtype).removeprefix("torch."), "rows_m": rows_m, "modes": modes,
              "max_diff": MAX_DIFF, "rotate_bytes": ROTATE_BYTES, "elapsed_s": time.perf_counter() - began,
              "rows": rows, "summary": summary,
              "args": {k: v for k, v in vars(args).items() if not callable(v)}}
    md = markdown(result)
    report.write_outputs(result, md, args)
    print(md)
    return 0


def markdown(result: dict) -> str:
    lines = [f"## GEMV launch sweep: {result['model']}, {result['device']}, {result['dtype']}", "",
             report.machine_line(result), "",
             "| projections | N | K | M | cuBLAS us | best launch | us | vs cuBLAS | launches correct / timed |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        s = result["summary"][r["shape"]]["best_by_m"][str(r["m"])]
        ok = sum("s" in e for e in r["triton"].values())
        best = ",".join(map(str, s["best"])) if s["best"] else "-"
        us = f"{s['us']:.1f}" if s["us"] is not None else "-"
        vs = f"{s['speedup']:.2f}x" if s["speedup"] else "-"
        lines.append(f"| {r['shape'].split('/', 1)[1]} | {r['n']} | {r['k']} | {r['m']} | {s['cublas_us']:.1f} | "
                     f"`{best}` | {us} | {vs} | {ok} / {len(r['triton'])} |")
    decode = tg.decode_table_from_sweep(result)
    batch = tg.batch_table_from_sweep(result)
    lines += ["", f"Launch table entries these timings support (a launch at least {tg.TABLE_MIN_SPEEDUP}x "
                  f"faster than cuBLAS; the tables apply on {', '.join(tg.DECODE_GEMV_DEVICES)}):", "", "```python"]
    lines += ([f"DECODE_GEMV_CONFIGS[{shape}] = {config}" for shape, config in decode.items()]
              or ["# DECODE_GEMV_CONFIGS: none"])
    lines += [f"BATCH_GEMV_CONFIGS[{key}] = {config}" for key, config in batch.items()] or ["# BATCH_GEMV_CONFIGS: none"]
    lines += ["```", "", "Times: CUDA-graph replays over weights evicted from L2 (on CUDA); on the CPU wall-clock "
              "times of the Triton interpreter, which say nothing about a GPU."]
    return "\n".join(lines)
