"""Time the Triton extend kernels on the GPU: the paged one (`paged_extend`, `_extend_kernel`) against
the dense-new-row one (`triton_extend.dense_extend`), over each kernel's launch-configuration grid.

    python scripts/extend_sweep.py [out.json]        (about 2-3 minutes on an H200, mostly ~50 compiles)

Data: bf16, page size 16, prompts without a cached prefix, the llama-1b and llama-8b attention shapes
at one 2048-token prompt, 32 prompts of 512 tokens and one of 512. q, k, v come from one fused
projection output as in the model (q, k contiguous as after rotary embeddings, v a strided view), and
k/v are written into the paged cache first, so both kernels see the same keys. Before timing, every
new-kernel configuration's output is compared with the old kernel's (max abs diff; a configuration
off by more than MAX_DIFF is reported and never picked as best). torch's fused causal SDPA on the same
dense data is timed as a reference for what a flash kernel gets from the hardware. Times are the
median of CUDA-graph replays (triton.testing.do_bench_cudagraph), so they are GPU time per call.

Causal FLOPs per layer: 4 * (L * (L + 1) / 2) * Hq * D per prompt. Prints one line per (shape,
workload) and, per head_dim, the new configuration with the best mean ratio to the per-row best (the
candidate for `triton_extend.EXTEND_DENSE_CONFIGS`); writes everything to one JSON."""
import itertools, json, sys, time

import torch
import torch.nn.functional as F
import triton.testing

from tscompile.custom_ops import triton_attention as ta
from tscompile.custom_ops import triton_extend as te

SHAPES = {"llama-1b": (32, 8, 64), "llama-8b": (32, 8, 128)}  # Hq, Hkv, head_dim
WORKLOADS = {"1x2048": [2048], "32x512": [512] * 32, "1x512": [512]}
PAGE = 16
DEVICE = "cuda"  # tests run the script's logic on tiny shapes under the CPU interpreter
TARGET_TFLOPS = {"llama-1b": 250, "llama-8b": 350}  # at 1x2048
MAX_DIFF = 3e-2  # bf16 outputs of two correct kernels differ by a few 1e-3

# (rows = query positions x padded GQA group, keys per tile, warps, stages). Every configuration costs
# two compiles per head_dim (one request and 32 requests specialise differently), which dominate the
# run time, so both grids are pruned. The old kernel's full grid was swept before: next to its
# shipped EXTEND_CONFIGS it runs that sweep's best at 1x2048.
OLD_GRID = {64: [(64, 128, 4, 3)], 128: [(128, 128, 8, 3)]}
# The new kernel: 64-row tiles with 4 warps, 128- and 256-row tiles with 8 (4 warps on 128 x 128
# score tiles only at head_dim 64, where the accumulator leaves the registers for it).
_NEW_COMMON = [(64, 64, 4, 2), (64, 128, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2),
               (128, 128, 8, 3), (256, 64, 8, 2), (256, 64, 8, 3)]
NEW_GRID = {64: _NEW_COMMON + [(128, 128, 4, 3), (128, 64, 4, 3), (256, 128, 8, 2)], 128: _NEW_COMMON + [(128, 64, 4, 3)]}


def inputs(q_lens, hq, hkv, d):
    t, b = sum(q_lens), len(q_lens)
    max_pages = max(-(-n // PAGE) for n in q_lens)
    num_pages = b * max_pages + 1
    g = torch.Generator(device=DEVICE).manual_seed(0)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEVICE, dtype=torch.bfloat16, generator=g)
    q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=1))
    q, k = q.contiguous(), k.contiguous()  # rotary embeddings make new tensors; v stays a view
    k_cache = torch.randn(num_pages, PAGE, hkv, d, device=DEVICE, dtype=torch.bfloat16, generator=g)
    v_cache = torch.randn_like(k_cache)
    pages = torch.randperm(num_pages - 1, device=DEVICE, generator=g)[: b * max_pages] + 1
    page_table = pages.view(b, max_pages).to(torch.int32)
    write_loc = torch.cat([page_table[i, torch.arange(n, device=DEVICE) // PAGE].long() * PAGE
                           + torch.arange(n, device=DEVICE) % PAGE for i, n in enumerate(q_lens)])
    ta.write_kv(k, v, k_cache, v_cache, write_loc)
    seq_lens = torch.tensor(q_lens, dtype=torch.int32, device=DEVICE)
    qo_indptr = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32, device=DEVICE)
    return dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, page_table=page_table, seq_lens=seq_lens,
                qo_indptr=qo_indptr, scale=d ** -0.5)


def causal_flops(q_lens, hq, d):
    return sum(4 * (n * (n + 1) / 2) * hq * d for n in q_lens)


def run_old(a, out, cfg, d):
    shipped = ta.EXTEND_CONFIGS[d]
    ta.EXTEND_CONFIGS[d] = cfg
    try:
        ta.paged_extend(a["q"], a["k_cache"], a["v_cache"], out, a["page_table"], a["seq_lens"], a["qo_indptr"],
                        a["scale"])
    finally:
        ta.EXTEND_CONFIGS[d] = shipped


def run_new(a, out, cfg):
    te.dense_extend(a["q"], a["k"], a["v"], a["k_cache"], a["v_cache"], out, a["page_table"], a["seq_lens"],
                    a["qo_indptr"], a["scale"], config=cfg)


def sdpa_fn(a, q_lens, hq, d):
    """torch's fused causal attention over the same dense q/k/v, one batched call when the prompts
    have equal lengths; returns (fn, its output as [T, Hq, D] after one run)."""
    views = []
    bounds = list(itertools.accumulate([0] + q_lens))
    groups = [(0, len(q_lens))] if len(set(q_lens)) == 1 else [(i, i + 1) for i in range(len(q_lens))]
    for lo, hi in groups:
        n = q_lens[lo]
        rows = slice(bounds[lo], bounds[hi])
        views.append(tuple(a[x][rows].reshape(hi - lo, n, -1, d).transpose(1, 2) for x in ("q", "k", "v")))

    def fn():
        return [F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=a["scale"], enable_gqa=True)
                for q, k, v in views]
    out = torch.cat([o.transpose(1, 2).reshape(-1, hq, d) for o in fn()])
    return fn, out


def max_diff(x, ref):
    diff = (x.float() - ref.float()).abs()
    return float("inf") if diff.isnan().any() else diff.max().item()


def bench(fn):
    # replayed from a CUDA graph: GPU time without Triton's per-launch host cost, which would
    # otherwise dominate the 20-us 1x512 rows (both kernels are graph-safe by contract)
    return triton.testing.do_bench_cudagraph(fn, rep=10, return_mode="median")


def sweep_row(model, wname, q_lens, hq, hkv, d):
    a = inputs(q_lens, hq, hkv, d)
    flops = causal_flops(q_lens, hq, d)
    old_out = torch.full_like(a["q"], float("nan"))
    run_old(a, old_out, ta.EXTEND_CONFIGS[d], d)
    sdpa, sdpa_out = sdpa_fn(a, q_lens, hq, d)
    row = {"model": model, "workload": wname, "flops": flops, "old": {}, "new": {},
           "old_vs_sdpa_max_diff": max_diff(old_out, sdpa_out)}
    old_cfgs = list(dict.fromkeys([ta.EXTEND_CONFIGS[d]] + OLD_GRID[d]))
    new_cfgs = list(dict.fromkeys([te.EXTEND_DENSE_CONFIGS[d]] + NEW_GRID[d]))
    for cfg in old_cfgs:
        out = torch.empty_like(a["q"])
        try:
            row["old"][cfg] = {"ms": bench(lambda: run_old(a, out, cfg, d))}
        except Exception as e:  # e.g. out of shared memory for the biggest tiles
            row["old"][cfg] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
    for cfg in new_cfgs:
        out = torch.full_like(a["q"], float("nan"))
        try:
            run_new(a, out, cfg)
            entry = {"max_diff_vs_old": max_diff(out, old_out)}
            entry["ms"] = bench(lambda: run_new(a, out, cfg))
        except Exception as e:
            entry = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
        row["new"][cfg] = entry
    row["sdpa_ms"] = bench(sdpa)
    return row


def timed(results, ok=lambda e: True):
    return {c: e["ms"] for c, e in results.items() if "ms" in e and ok(e)}


def report_row(row, d):
    tf = lambda ms: row["flops"] / ms / 1e9  # noqa: E731
    old, new = timed(row["old"]), timed(row["new"], lambda e: e["max_diff_vs_old"] <= MAX_DIFF)
    shipped, default = ta.EXTEND_CONFIGS[d], te.EXTEND_DENSE_CONFIGS[d]
    parts = [f"{row['model']:9s} {row['workload']:7s}"]
    if shipped in old:
        parts.append(f"old shipped {shipped} {old[shipped] * 1e3:7.1f} us ({tf(old[shipped]):4.0f} TFLOP/s)")
    if old:
        best = min(old, key=old.get)
        parts.append(f"old best {best} {old[best] * 1e3:7.1f} ({tf(old[best]):4.0f})")
    if default in new:
        parts.append(f"new default {default} {new[default] * 1e3:7.1f} ({tf(new[default]):4.0f})")
    if new:
        best = min(new, key=new.get)
        parts.append(f"new best {best} {new[best] * 1e3:7.1f} ({tf(new[best]):4.0f})")
    parts.append(f"sdpa {row['sdpa_ms'] * 1e3:7.1f} ({tf(row['sdpa_ms']):4.0f})")
    diff = row["new"].get(default, {}).get("max_diff_vs_old", float("nan"))
    parts.append(f"max|new {default} - old| {diff:.1e} max|old - sdpa| {row['old_vs_sdpa_max_diff']:.1e}")
    print(" | ".join(parts), flush=True)
    for cfg, e in row["new"].items():
        if "error" in e or e["max_diff_vs_old"] > MAX_DIFF:
            print(f"    new {cfg}: {e.get('error') or 'max diff vs old %.3g > %g' % (e['max_diff_vs_old'], MAX_DIFF)}")


def best_overall(rows):
    """The new configuration with the best mean (time / the row's best time) over a head_dim's rows,
    among those that ran correctly on every row."""
    ok = [timed(r["new"], lambda e: e["max_diff_vs_old"] <= MAX_DIFF) for r in rows]
    common = set.intersection(*(set(t) for t in ok)) if ok else set()
    score = {c: sum(t[c] / min(t.values()) for t in ok) / len(ok) for c in common}
    return (min(score, key=score.get), score) if score else (None, score)


def main(out_path):
    t0 = time.time()
    rows = []
    for (model, (hq, hkv, d)), (wname, q_lens) in itertools.product(SHAPES.items(), WORKLOADS.items()):
        row = sweep_row(model, wname, q_lens, hq, hkv, d)
        report_row(row, d)
        row["elapsed_s"] = time.time() - t0
        rows.append(row)
    summary = {}
    for model, (hq, hkv, d) in SHAPES.items():
        mine = [r for r in rows if r["model"] == model]
        best, score = best_overall(mine)
        big = next(r for r in mine if r["workload"] == "1x2048")
        tf = lambda ms: big["flops"] / ms / 1e9  # noqa: E731
        new_1x2048 = timed(big["new"], lambda e: e["max_diff_vs_old"] <= MAX_DIFF)
        old_1x2048 = timed(big["old"])
        summary[model] = {"head_dim": d, "new_best_overall": best, "mean_ratio": score.get(best),
                          "new_best_1x2048_tflops": tf(min(new_1x2048.values())) if new_1x2048 else None,
                          "old_best_1x2048_tflops": tf(min(old_1x2048.values())) if old_1x2048 else None,
                          "target_tflops": TARGET_TFLOPS[model]}
        s = summary[model]
        print(f"{model}: new kernel best over the workloads {best} (mean ratio to per-row best "
              f"{score.get(best, float('nan')):.3f}) -> EXTEND_DENSE_CONFIGS[{d}] candidate; 1x2048 best new "
              f"{s['new_best_1x2048_tflops'] or 0:.0f} vs old {s['old_best_1x2048_tflops'] or 0:.0f} TFLOP/s "
              f"(target {s['target_tflops']})", flush=True)
    print(f"total {time.time() - t0:.0f} s")
    key = lambda c: ",".join(map(str, c))  # noqa: E731
    for r in rows:
        r["old"] = {key(c): e for c, e in r["old"].items()}
        r["new"] = {key(c): e for c, e in r["new"].items()}
    with open(out_path, "w") as f:
        json.dump({"rows": rows, "summary": summary, "old_shipped": {d: ta.EXTEND_CONFIGS[d] for d in (64, 128)},
                   "new_default": {d: te.EXTEND_DENSE_CONFIGS[d] for d in (64, 128)}}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "extend_sweep.json")
