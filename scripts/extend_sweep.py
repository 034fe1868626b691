"""Sweep the Triton extend kernel's launch configuration on the GPU (`scripts/gpu_check.sh sweep`).

Times `paged_extend` alone (bf16, page size 16, prompts without a cached prefix) for the llama-1b
and llama-8b attention shapes at one 2048-token prompt and at 32 prompts of 512 tokens, for every
configuration in the grid below, next to the shipped configuration and torch's fused causal SDPA on
the same (dense) data as a reference. Causal FLOPs per layer: 4 * (L * (L + 1) / 2) * Hq * D per
prompt. Writes one JSON (argv[1]) and prints a table with the best configuration per row."""
import itertools, json, sys

import torch
import torch.nn.functional as F
import triton.testing

from tscompile.custom_ops import triton_attention as ta

SHAPES = {"llama-1b": (32, 8, 64), "llama-8b": (32, 8, 128)}  # Hq, Hkv, head_dim
WORKLOADS = {"1x2048": [2048], "32x512": [512] * 32, "1x512": [512]}
GRID = list(itertools.product((64, 128, 256), (32, 64, 128), (4, 8), (2, 3)))
PAGE = 16


def inputs(q_lens, hq, hkv, d):
    t, b = sum(q_lens), len(q_lens)
    max_pages = max(-(-n // PAGE) for n in q_lens)
    num_pages = b * max_pages + 1
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k_cache = torch.randn(num_pages, PAGE, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v_cache = torch.randn_like(k_cache)
    pages = torch.randperm(num_pages - 1, device="cuda", generator=g)[: b * max_pages] + 1
    page_table = pages.view(b, max_pages).to(torch.int32)
    seq_lens = torch.tensor(q_lens, dtype=torch.int32, device="cuda")
    qo_indptr = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    return q, k_cache, v_cache, out, page_table, seq_lens, qo_indptr


def causal_flops(q_lens, hq, d):
    return sum(4 * (n * (n + 1) / 2) * hq * d for n in q_lens)


def main(out_path):
    shipped = dict(ta.EXTEND_CONFIGS)
    rows = []
    for (model, (hq, hkv, d)), (wname, q_lens) in itertools.product(SHAPES.items(), WORKLOADS.items()):
        args = inputs(q_lens, hq, hkv, d)
        flops = causal_flops(q_lens, hq, d)
        results = {}
        for cfg in [shipped[d]] + GRID:
            if cfg in results:
                continue
            ta.EXTEND_CONFIGS[d] = cfg
            try:
                ms = triton.testing.do_bench(lambda: ta.paged_extend(*args, 0.125), warmup=10, rep=40)
            except Exception as e:  # e.g. out of shared memory for the biggest tiles
                print(f"  {model} {wname} {cfg}: {type(e).__name__}", flush=True)
                continue
            results[cfg] = ms
        ta.EXTEND_CONFIGS[d] = shipped[d]
        # reference: torch's fused causal attention per prompt over dense K/V (no paging)
        qs = [torch.randn(1, hq, n, d, device="cuda", dtype=torch.bfloat16) for n in q_lens]
        ks = [torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16) for n in q_lens]

        def sdpa():
            for q, k in zip(qs, ks):
                F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
        sdpa_ms = triton.testing.do_bench(sdpa, warmup=10, rep=40)
        best = min(results, key=results.get)
        row = {"model": model, "workload": wname, "flops": flops, "shipped": list(shipped[d]),
               "shipped_ms": results[shipped[d]], "best": list(best), "best_ms": results[best],
               "sdpa_ms": sdpa_ms, "all": {",".join(map(str, c)): v for c, v in results.items()}}
        rows.append(row)
        tf = lambda ms: flops / ms / 1e9
        print(f"{model:9s} {wname:7s} shipped {shipped[d]} {results[shipped[d]] * 1e3:8.1f} us "
              f"({tf(results[shipped[d]]):5.0f} TFLOP/s) | best {best} {results[best] * 1e3:8.1f} us "
              f"({tf(results[best]):5.0f}) | torch sdpa {sdpa_ms * 1e3:8.1f} us ({tf(sdpa_ms):5.0f})", flush=True)
    with open(out_path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "extend_sweep.json")
