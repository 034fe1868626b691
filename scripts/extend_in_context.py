"""Time the dense extend kernel alone and in a step's surroundings, to find where its in-engine time goes.

    python3 scripts/extend_in_context.py [--configs 64,64,4,2 128,64,8,3 ...]   # $OUT/extend_in_context.{json,md}

Why: at llama-8b's shape (32 query / 8 KV heads of 128) one 2048-token prompt's extend attention took
100.8 us per layer in scripts/extend_sweep.py (341 TFLOP/s, the same launch replayed on the same
inputs) but 130 us per layer inside the engine's prefill step (264 TFLOP/s, 4158 us over 32 layers;
bench/results/llama-8b-fdfb5a4/), against a 350 TFLOP/s target. The engine's launch has nearly the
same grid (token bucket 2048; request bucket 2, the prompt and one empty padded request: 1040
programs against 1032). This script separates the candidates, each as one CUDA graph of --layers
launches, the kernel's own time read from torch.profiler:

    hot      one layer's inputs replayed --layers times (what extend_sweep.py timed)
    layers   a separate q/k/v and cache per layer (no layer finds the previous one's bytes in L2)
    engine   ``layers`` with the engine's launch: new K/V rows written by the kernel (write_loc),
             padding rows zeroed, a page table as wide as the engine's (--max-kv positions) and the
             request bucket's empty second request (null table row, length 0, no query rows)
    mlp      ``engine`` with a llama-8b MLP's matmuls (gate/up, SiLU-mul, down) between launches, so
             the kernel runs among the step's other work (L2 contents, clocks) as in the engine

Each configuration (--configs, (rows, keys per tile, warps, stages); the first is the shipped one) is
first checked against the float32 torch oracle on layer 0 (``custom_ops.attention._torch_extend``,
after the kernel has written the new rows); one that does not compile or match is listed with its
error and not timed. Every configuration is timed under ``mlp`` and the shipped one under all four.
Nothing here changes a default. On the CPU (tests) the same checks run under TRITON_INTERPRET=1 on a
tiny shape and the time is wall time without graphs or profiler.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

from tscompile.bench.graph_timing import capture_graph, replay_us
from tscompile.custom_ops import attention as torch_attention
from tscompile.custom_ops import triton_extend as te
from tscompile.utils import cdiv

CONDITIONS = ("hot", "layers", "engine", "mlp")
KERNEL = "_extend_dense_kernel"


def causal_flops(tokens: int, hq: int, d: int) -> float:
    return 4 * (tokens * (tokens + 1) / 2) * hq * d


def make_layer(a, gen, device, dtype) -> dict:
    """One layer's inputs for one prompt of ``a.tokens`` rows: q, k, v as views of one fused projection
    (q, k contiguous as after RoPE, v a strided view), a cache of pages (page 0 the null page), the
    table (--max-kv positions wide, unused columns at the null page) and the write slots."""
    t, hq, hkv, d, page = a.tokens, a.hq, a.hkv, a.d, a.page
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen, device=device).to(dtype)
    q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=1))
    pages = cdiv(t, page)
    table = torch.zeros(1, a.max_kv // page, dtype=torch.int32, device=device)
    table[0, :pages] = 1 + torch.arange(pages, dtype=torch.int32, device=device)
    pos = torch.arange(t, device=device)
    padded = {"page_table": torch.cat([table, torch.zeros_like(table)]),
              "seq_lens": torch.tensor([t, 0], dtype=torch.int32, device=device),
              "qo_indptr": torch.tensor([0, t, t], dtype=torch.int32, device=device)}
    return {"q": q.contiguous(), "k": k.contiguous(), "v": v, "padded": padded,
            "k_cache": torch.randn(1 + pages, page, hkv, d, generator=gen, device=device).to(dtype),
            "v_cache": torch.randn(1 + pages, page, hkv, d, generator=gen, device=device).to(dtype),
            "page_table": table, "seq_lens": torch.tensor([t], dtype=torch.int32, device=device),
            "qo_indptr": torch.tensor([0, t], dtype=torch.int32, device=device),
            "write_loc": table[0, pos // page].long() * page + pos % page,
            "out": torch.empty(t, hq, d, dtype=dtype, device=device)}


def launch(layer: dict, config, engine: bool, scale: float) -> None:
    meta = layer["padded"] if engine else layer
    te.dense_extend(layer["q"], layer["k"], layer["v"], layer["k_cache"], layer["v_cache"], layer["out"],
                    meta["page_table"], meta["seq_lens"], meta["qo_indptr"], scale, config=config,
                    write_loc=layer["write_loc"] if engine else None, zero_padding=engine)


def check(layer: dict, config, scale: float, tol: float) -> float:
    """Max |kernel - float32 oracle| on this layer, launched as the engine launches it (the kernel
    writes the new rows into the cache, so the oracle reads the same keys); raises when above ``tol``."""
    layer["out"].fill_(float("nan"))
    launch(layer, config, True, scale)
    f32 = {n: layer[n].float() for n in ("q", "k_cache", "v_cache")}
    want = torch.empty_like(f32["q"])
    meta = layer["padded"]
    torch_attention._torch_extend(f32["q"], f32["k_cache"], f32["v_cache"], want, meta["page_table"],
                                  meta["seq_lens"], meta["qo_indptr"], scale)
    err = (layer["out"].float() - want).abs().max().item()
    if not err <= tol:  # NaN fails too
        raise AssertionError(f"max abs error {err:.3g} against the float32 oracle (tolerance {tol})")
    return err


def step_fn(layers: list[dict], condition: str, config, scale: float, mlp):
    def run():
        for i in range(len(layers)):
            layer = layers[0] if condition == "hot" else layers[i]
            launch(layer, config, condition in ("engine", "mlp"), scale)
            if condition == "mlp":
                x, w_gate_up, w_down = mlp
                gate, up = (x @ w_gate_up).chunk(2, dim=-1)
                x.copy_((F.silu(gate) * up) @ w_down)
    return run


def time_step(run, device: torch.device, reps: int, launches: int) -> dict:
    """us per launch of the extend kernel (profiler device time on CUDA; wall time on the CPU) and the
    step's wall time per replay."""
    if device.type != "cuda":
        run()  # compiles
        t0 = time.perf_counter()
        for _ in range(reps):
            run()
        wall = (time.perf_counter() - t0) / reps
        return {"kernel_us": wall / launches * 1e6, "step_us": wall * 1e6, "timer": "cpu wall"}
    graph = capture_graph(run)
    step_us = replay_us(graph, reps)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    times = [e.device_time for e in prof.events() if e.name.startswith(KERNEL) and e.device_time > 0]
    del graph
    if not times:
        return {"step_us": step_us, "timer": "cuda graph", "error": f"the profiler saw no {KERNEL}"}
    return {"kernel_us": sum(times) / len(times), "launches_seen": len(times), "step_us": step_us,
            "timer": "torch.profiler device time"}


def parse_config(text: str) -> tuple[int, int, int, int]:
    parts = tuple(int(x) for x in text.split(","))
    if len(parts) != 4:
        raise argparse.ArgumentTypeError(f"tscompile: a config is rows,keys,warps,stages; got {text!r}")
    return parts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--hq", type=int, default=32)
    p.add_argument("--hkv", type=int, default=8)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--max-kv", type=int, default=4096, help="the page table's width in positions")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--hidden", type=int, default=4096, help="the MLP of condition mlp: llama-8b's by default")
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--configs", type=parse_config, nargs="*", default=None,
                   help="rows,keys,warps,stages each; the shipped one first (default: shipped + a few)")
    p.add_argument("--tol", type=float, default=None, help="oracle tolerance (default 2e-2 bf16, 1e-4 f32)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args(argv)
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    tol = a.tol if a.tol is not None else (2e-2 if dtype == torch.bfloat16 else 1e-4)
    shipped = te.EXTEND_DENSE_CONFIGS[a.d]
    configs = list(dict.fromkeys([shipped] + (a.configs if a.configs is not None else
                                              [(64, 128, 4, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2),
                                               (256, 64, 8, 2)])))
    scale = a.d ** -0.5
    gen = torch.Generator(device=device).manual_seed(0)
    layers = [make_layer(a, gen, device, dtype) for _ in range(a.layers)]
    mlp = (torch.randn(a.tokens, a.hidden, generator=gen, device=device).to(dtype) * 0.1,
           torch.randn(a.hidden, 2 * a.intermediate, generator=gen, device=device).to(dtype) * a.hidden ** -0.5,
           torch.randn(a.intermediate, a.hidden, generator=gen, device=device).to(dtype) * a.intermediate ** -0.5)
    flops = causal_flops(a.tokens, a.hq, a.d)
    rows = []
    for config in configs:
        row = {"config": list(config), "shipped": config == shipped, "error": None, "times": {}}
        try:
            row["max_abs_err"] = check(layers[0], config, scale, tol)
            for condition in (CONDITIONS if config == shipped else ("mlp",)):
                timing = time_step(step_fn(layers, condition, config, scale, mlp), device, a.reps, a.layers)
                if "kernel_us" in timing:
                    timing["tflops"] = flops / (timing["kernel_us"] * 1e-6) / 1e12
                row["times"][condition] = timing
        except Exception as e:  # a config past shared memory, or off the oracle: listed, never picked
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"shape": {k: getattr(a, k) for k in ("hq", "hkv", "d", "tokens", "page", "max_kv", "layers")},
              "dtype": a.dtype, "device": str(device), "flops_per_launch": flops, "rows": rows,
              "torch": torch.__version__}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "extend_in_context.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"extend kernel, {a.tokens} tokens, {a.hq}/{a.hkv} heads of {a.d}, {a.dtype}, {a.layers} launches per "
             "step; us per launch (TFLOP/s)", "", "| config | " + " | ".join(CONDITIONS) + " | max abs err | error |",
             "|---" * (len(CONDITIONS) + 3) + "|"]
    for row in rows:
        cells = []
        for c in CONDITIONS:
            t = row["times"].get(c, {})
            cells.append(f"{t['kernel_us']:.1f} ({t['tflops']:.0f})" if "kernel_us" in t else "-")
        err = f"{row['max_abs_err']:.2g}" if "max_abs_err" in row else "-"
        lines.append(f"| {tuple(row['config'])}{' shipped' if row['shipped'] else ''} | " + " | ".join(cells)
                     + f" | {err} | {row['error'] or ''} |")
    with open(os.path.join(a.out, "extend_in_context.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
