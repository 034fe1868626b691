"""Time the Triton skinny matmul (`triton_gemv.gemv`) against cuBLAS on the decode projections.

    python scripts/gemv_sweep.py [out.json]        (about 60-90 s on an H200 before the "acc" tiles, about half of it ~33 compiles)
    GEMV_SWEEP_ONLY=llama-8b/qkv,llama-8b/o GEMV_SWEEP_ROWS=1 GEMV_SWEEP_ACC_ONLY=1 python scripts/gemv_sweep.py
        (a short call: those shapes, those M, only the module default and the "acc" tiles; the JSON is
        rewritten after every shape, so a call cut off at its deadline still returns what it measured)
    python scripts/gemv_sweep.py --decode-table out.json [--min-speedup 1.02]
        (no GPU: prints ``triton_gemv.DECODE_GEMV_CONFIGS`` as the sweep's M = 1 picks, each shape whose
        best Triton launch beat cuBLAS by at least that factor; the others stay cuBLAS. The engine
        reads the same table straight from the JSON with TSCOMPILE_GEMV_TABLE=out.json)

Data: bf16, out[M, N] = x[M, K] @ w[N, K].T with w as nn.Linear stores it, for the llama-1b and
llama-8b projection shapes (fused qkv, o, fused gate/up, down, LM head) at M = 1, 2, 4, 8 rows (the
decode batch; GEMV_SWEEP_ROWS=16,32 for the 32-token prefill's). w is randn / sqrt(K), so outputs
are about N(0, 1) and an absolute tolerance means the same thing for every K.

What is measured: DRAM reads, not L2 hits. The H200's L2 (50 MB) holds the 8-34 MB weights of the
small projections, and a CUDA-graph loop over one weight would time L2 bandwidth. Every timed
function therefore rotates over enough independent weight copies to exceed ROTATE_BYTES (4x L2):
the graph unrolls its calls, each on the next copy, so each call's weight was evicted since its
last use. x and the output stay cache-resident, as in the model. Times are the median of CUDA-graph
replays (triton.testing.do_bench_cudagraph), so they are GPU time per call without launch overhead;
bytes moved = the weight + x + out, TB/s = those bytes over that time.

Compared: torch's `x @ w.T` and `F.linear(x, w)` (cuBLAS), and the Triton kernel over TILE_GRID, each
tile at split-K 1 and at the automatic split (`triton_gemv.auto_split`: enough programs for the
GPU when N's column blocks alone are too few), plus the module's current default. Before timing,
every output (cuBLAS's too) is compared with `x.float() @ w.float().T`; a Triton config off by more
than MAX_DIFF is reported and never picked. Prints one line per (shape, M) and per shape the config
with the best mean ratio to each row's best (a candidate launch for that shape);
writes everything to one JSON."""
import itertools, json, os, time

import torch
import torch.nn.functional as F
import triton
import triton.testing

from tscompile.custom_ops import triton_gemv as tg

SHAPES = {  # proj: (N, K) of the [N, K] weight
    "llama-1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
                 "lm_head": (128256, 2048)},
    "llama-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                 "lm_head": (128256, 4096)},
}
ROWS = (1, 2, 4, 8)
DEVICE = "cuda"  # tests run the script's logic on tiny shapes under the CPU interpreter
DTYPE = torch.bfloat16
ROTATE_BYTES = 200 << 20  # weight bytes each timed loop cycles through: 4x the H200's 50 MB L2
MAX_COPIES = 64
MAX_DIFF = 5e-2  # outputs ~N(0, 1): bf16 rounding of |y| < 8 is <= 0.016; a lost K chunk is ~1
REP_MS = 3  # per do_bench_cudagraph replay (10 replays per measurement): ~640 measurements

# (BLOCK_N, BLOCK_K, num_warps, num_stages, mode); each is run at split-K 1 and at the automatic
# split. Pruned to keep compiles (one per tile x power-of-two M x split or not for "fma", one per
# tile x split or not for "dot", which pads M to 16) near 33. "fma": narrow column blocks with long
# contiguous K segments (wider blocks hold M x BLOCK_N x BLOCK_K products per chunk in registers);
# "dot": 64/128-column weight tiles as the tensor-core operand (32 columns: the pre-Hopper mma).
# Each tile also runs in its "_sum" form (below): one more compile per tile and padded row count.
TILE_GRID = [
    (4, 512, 4, 2, "fma"), (8, 512, 4, 2, "fma"), (16, 256, 4, 2, "fma"),
    (64, 128, 4, 4, "dot"), (64, 256, 4, 3, "dot"), (128, 128, 8, 3, "dot"), (32, 128, 4, 4, "dot"),
]


# "acc" (Inductor's GEMV reduction form) at the launches coordinate-descent tuning chose for the tuned
# static-cache baseline's llama-8b bs=1 projections on the H200 (bench/results/same-lease-b0f9ede/,
# its autotuned_kernels), split 1 as there, and only at M <= ACC_MAX_ROWS: its float32 accumulator
# holds M x BLOCK_N x BLOCK_K products.
ACC_TILES = [
    (1, 512, 8, 1, "acc"), (1, 2048, 8, 1, "acc"), (2, 4096, 8, 1, "acc"), (2, 4096, 16, 1, "acc"),
    (4, 4096, 4, 1, "acc"), (4, 2048, 16, 1, "acc"),
]
ACC_MAX_ROWS = 2
# "fma" holds M x BLOCK_N x BLOCK_K products per chunk in registers: past 8 rows (GEMV_SWEEP_ROWS=16,32,
# the 32-token prefill's question) only the tensor-core "dot" tiles are worth a compile
FMA_MAX_ROWS = 8


# The "_sum" modes (the split partials summed by the last program of each column block, no second
# kernel): each tile also at these splits (and the automatic one). "dot_sum" from 8 rows (the decode
# batch and the 32-token prefill, where cuBLAS's small projections read at 1.4-3.2 TB/s on the H200
# and the two-kernel split lost to split 1 by 2-3 us: bench/results/same-lease-ec654af/call1/
# gemv_sweep.json); "fma_sum" and "acc_sum" wherever their tiles run.
SUM_SPLITS = (2, 4, 8)
DOT_SUM_MIN_ROWS = 8


def _env_list(name):
    return [v.strip() for v in os.environ.get(name, "").split(",") if v.strip()]


ONLY = set(_env_list("GEMV_SWEEP_ONLY"))  # "model/proj" names; empty: every shape
if _env_list("GEMV_SWEEP_ROWS"):
    ROWS = tuple(int(m) for m in _env_list("GEMV_SWEEP_ROWS"))
ACC_ONLY = os.environ.get("GEMV_SWEEP_ACC_ONLY", "0") == "1"


def configs_for(m, n, k):
    """The shape's Triton configs: the module default first, then each tile at split 1 and auto
    ("fma" tiles only at M <= FMA_MAX_ROWS), then (at M <= ACC_MAX_ROWS) the "acc" tiles at split 1;
    each "fma" tile, each "dot" tile from DOT_SUM_MIN_ROWS rows and each "acc" tile also in its
    "_sum" form at SUM_SPLITS and the automatic split (the partials summed in the kernel)."""
    cfgs = [tg.default_config(m, n, k)]

    def summed(block_n, block_k, warps, stages, mode, splits):
        return [(block_n, block_k, split, warps, stages, f"{mode}_sum") for split in sorted(set(splits) - {1})]

    for block_n, block_k, warps, stages, mode in [] if ACC_ONLY else TILE_GRID:
        if mode == "fma" and m > FMA_MAX_ROWS:
            continue
        auto = tg.auto_split(n, k, block_n, block_k)
        cfgs += [(block_n, block_k, split, warps, stages, mode) for split in (1, auto)]
        if mode == "fma" or m >= DOT_SUM_MIN_ROWS:
            cfgs += summed(block_n, block_k, warps, stages, mode, (*SUM_SPLITS, auto))
    if m <= ACC_MAX_ROWS:
        for block_n, block_k, warps, stages, mode in ACC_TILES:
            cfgs += [(block_n, block_k, 1, warps, stages, mode), *summed(block_n, block_k, warps, stages, mode, SUM_SPLITS)]
    return list(dict.fromkeys(cfgs))


def weight_copies(n, k):
    """Independent weights whose total passes ROTATE_BYTES (one if a single one already does)."""
    size = n * k * torch.finfo(DTYPE).bits // 8
    count = min(MAX_COPIES, max(1, -(-ROTATE_BYTES // size)))
    g = torch.Generator(device=DEVICE).manual_seed(n * 7 + k)
    return [torch.randn(n, k, device=DEVICE, dtype=DTYPE, generator=g) * k ** -0.5 for _ in range(count)]


def rotating(call, weights):
    """fn() for the timer: each call uses the next weight copy (a CUDA graph unrolls the calls)."""
    it = itertools.cycle(weights)
    return lambda: call(next(it))


def max_diff(x, ref):
    diff = (x.float() - ref.float()).abs()
    return float("inf") if diff.isnan().any() else diff.max().item()


def run_triton(x, w, out, cfg):
    tg.gemv(x, w, out, config=cfg)


def bench(fn):
    # replayed from a CUDA graph: GPU time without launch overhead, which would dominate 2-20 us
    # kernels (the Triton kernel is graph-safe by contract; cuBLAS is captured as usual)
    return triton.testing.do_bench_cudagraph(fn, rep=REP_MS, return_mode="median")


def sweep_shape(model, proj, n, k):
    weights = weight_copies(n, k)
    rows = []
    for m in ROWS:
        g = torch.Generator(device=DEVICE).manual_seed(m)
        x = torch.randn(m, k, device=DEVICE, dtype=DTYPE, generator=g)
        ref = x.float() @ weights[0].float().T
        nbytes = (n * k + m * k + m * n) * torch.finfo(DTYPE).bits // 8
        row = {"model": model, "proj": proj, "n": n, "k": k, "m": m, "bytes": nbytes, "copies": len(weights),
               "torch": {}, "triton": {}}
        for name, fn in (("matmul", lambda w: x @ w.T), ("linear", lambda w: F.linear(x, w))):
            row["torch"][name] = {"max_diff": max_diff(fn(weights[0]), ref), "ms": bench(rotating(fn, weights))}
        for cfg in configs_for(m, n, k):
            out = torch.full((m, n), float("nan"), device=DEVICE, dtype=DTYPE)
            try:
                run_triton(x, weights[0], out, cfg)
                entry = {"max_diff": max_diff(out, ref)}
                entry["ms"] = bench(rotating(lambda w: run_triton(x, w, out, cfg), weights))
            except Exception as e:  # e.g. out of shared memory or registers for a big tile
                entry = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
            row["triton"][cfg] = entry
        rows.append(row)
    return rows


def timed(results, ok=lambda e: True):
    return {c: e["ms"] for c, e in results.items() if "ms" in e and ok(e)}


def correct(e):
    return e["max_diff"] <= MAX_DIFF


def report_row(row):
    tbs = lambda ms: row["bytes"] / ms / 1e9  # noqa: E731
    torch_ms = timed(row["torch"])
    parts = [f"{row['model']:9s} {row['proj']:8s} N={row['n']:6d} K={row['k']:5d} M={row['m']}"]
    parts += [f"{name} {ms * 1e3:6.1f} us ({tbs(ms):4.2f} TB/s)" for name, ms in torch_ms.items()]
    ok = timed(row["triton"], correct)
    if ok:
        best = min(ok, key=ok.get)
        cublas = min(torch_ms.values())
        parts.append(f"triton best {best} {ok[best] * 1e3:6.1f} us ({tbs(ok[best]):4.2f} TB/s)")
        parts.append(f"speedup vs cuBLAS {cublas / ok[best]:.2f}x")
    else:
        parts.append("no correct Triton config")
    print(" | ".join(parts), flush=True)
    for cfg, e in row["triton"].items():
        if "error" in e or not correct(e):
            print(f"    triton {cfg}: {e.get('error') or 'max diff %.3g > %g' % (e['max_diff'], MAX_DIFF)}")
    for name, e in row["torch"].items():
        if e["max_diff"] > MAX_DIFF:
            print(f"    torch {name}: max diff {e['max_diff']:.3g} > {MAX_DIFF}")


def best_overall(rows):
    """The Triton config with the best mean (time / the row's best Triton time) over a shape's M
    rows, among those that ran correctly on every row."""
    ok = [timed(r["triton"], correct) for r in rows]
    common = set.intersection(*(set(t) for t in ok)) if ok else set()
    score = {c: sum(t[c] / min(t.values()) for t in ok) / len(ok) for c in common}
    return (min(score, key=score.get), score) if score else (None, score)


def main(out_path):
    t0 = time.time()
    rows, summary = [], {}
    for model, projs in SHAPES.items():
        for proj, (n, k) in projs.items():
            if ONLY and f"{model}/{proj}" not in ONLY:
                continue
            mine = sweep_shape(model, proj, n, k)
            for row in mine:
                report_row(row)
                row["elapsed_s"] = time.time() - t0
            best, score = best_overall(mine)
            speedups = {}
            for r in mine:
                ms = timed(r["triton"], correct).get(best)
                speedups[r["m"]] = min(timed(r["torch"]).values()) / ms if ms else None
            # per M, the best correct launch against cuBLAS: M = 1 is the bs=1 decode row ("acc" runs
            # there too), M = 32 the 32-token prefill's
            by_m = {}
            for r in mine:
                ok = timed(r["triton"], correct)
                pick = min(ok, key=ok.get) if ok else None
                cublas = min(timed(r["torch"]).values())
                by_m[r["m"]] = {"best": pick, "us": ok[pick] * 1e3 if pick else None, "cublas_us": cublas * 1e3,
                                "speedup": cublas / ok[pick] if pick else None}
                if pick:
                    print(f"{model}/{proj}: best at M={r['m']} {pick} {ok[pick] * 1e3:.1f} us against cuBLAS "
                          f"{cublas * 1e3:.1f} us ({cublas / ok[pick]:.2f}x)", flush=True)
            one = by_m.get(1, {})
            summary[f"{model}/{proj}"] = {"n": n, "k": k, "best_overall": best, "mean_ratio": score.get(best),
                                          "speedup_vs_cublas_by_m": speedups, "best_by_m": by_m,
                                          "best_m1": one.get("best"), "best_m1_us": one.get("us"),
                                          "cublas_m1_us": one.get("cublas_us"), "speedup_m1": one.get("speedup")}
            shown = " ".join(f"M={m}:{s:.2f}x" for m, s in speedups.items() if s)
            print(f"{model}/{proj}: best config over M {best} (mean ratio to per-row best "
                  f"{score.get(best, float('nan')):.3f}) -> the candidate for ({n}, {k}); vs cuBLAS {shown}",
                  flush=True)
            rows += mine
            write_json(out_path, rows, summary, time.time() - t0)
    print(f"total {time.time() - t0:.0f} s")


def write_json(out_path, rows, summary, elapsed_s):
    key = lambda c: ",".join(map(str, c))  # noqa: E731
    rows = [{**r, "triton": {key(c): e for c, e in r["triton"].items()}} for r in rows]
    with open(out_path, "w") as f:
        json.dump({"rows": rows, "summary": summary, "tile_grid": TILE_GRID, "acc_tiles": ACC_TILES,
                   "rotate_bytes": ROTATE_BYTES, "elapsed_s": elapsed_s, "only": sorted(ONLY),
                   "rows_m": list(ROWS), "acc_only": ACC_ONLY,
                   "max_diff": MAX_DIFF, "default_tiles": tg.DEFAULT_TILES,
                   "target_programs": tg.TARGET_PROGRAMS}, f, indent=1)


def print_decode_table(path: str, min_speedup: float) -> None:
    with open(path) as f:
        result = json.load(f)
    table = tg.decode_table_from_sweep(result, min_speedup)
    by_shape = {(s["n"], s["k"]): (name, s) for name, s in result["summary"].items()}
    print("DECODE_GEMV_CONFIGS: dict[tuple[int, int], tuple] = {")
    for shape, cfg in table.items():
        name, s = by_shape[shape]
        print(f"    {shape}: {cfg},  # {name}: {s['best_m1_us']:.1f} us (cuBLAS {s['cublas_m1_us']:.1f})")
    print("}")
    left = [f"{name} ({s['speedup_m1']:.2f}x)" for name, s in result["summary"].items()
            if (s["n"], s["k"]) not in table and s.get("speedup_m1")]
    if left:
        print(f"# cuBLAS kept (below {min_speedup}x): " + ", ".join(left))


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Time triton_gemv against cuBLAS (GPU), or print the "
                                                 "decode table a sweep's JSON gives (no GPU).")
    parser.add_argument("out", nargs="?", default="gemv_sweep.json", help="the sweep's JSON")
    parser.add_argument("--decode-table", metavar="SWEEP_JSON", help="print DECODE_GEMV_CONFIGS from this sweep")
    parser.add_argument("--min-speedup", type=float, default=tg.TABLE_MIN_SPEEDUP,
                        help="a shape leaves cuBLAS only if its launch was at least this much faster")
    args = parser.parse_args()
    if args.decode_table:
        print_decode_table(args.decode_table, args.min_speedup)
    else:
        main(args.out)
