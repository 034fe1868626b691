"""Does reading a projection's weight into L2 while the step does latency-bound work pay? (H200 probe)

    python scripts/l2_prefetch_probe.py [out.json]      (CUDA only; well under a minute on an H200)
    LANE0="py:scripts/l2_prefetch_probe.py" bash scripts/gpu_lanes.sh   (the JSON lands in $OUT)

Why: a decode step's small projections read their weights from DRAM well below copy bandwidth (the
llama-1b bs=1 qkv, o and down GEMVs at about 2.5 TB/s, its bs=32 qkv and o matmuls at about 1.6, against
a 4.2 TB/s copy: bench/results/same-lease-6be9ade/): an 8-13 MB read spends much of its few
microseconds ramping up (bench/results/gemv/). Meanwhile decode attention, the norms and RoPE barely
use the memory bus. If a side stream reads the next projection's weight into L2 during that work,
the projection itself reads from L2. This probe measures whether that pays before the engine is
changed for it.

What runs: per projection shape (llama-1b qkv, o, down, gate/up; llama-8b qkv, o) and row count
(M = 1, 32), a CUDA graph of L "layers", each some work followed by the matmul on that layer's own
copy of the weight. The work is a stall (`torch.cuda._sleep`, calibrated to STALLS_US: the stand-in
for attention and the small kernels) or a bandwidth-bound read (a matmul on llama-1b's 67 MB gate/up
weight at the same M: the stand-in for the projection before). There are enough copies to pass 4x
the L2 (ROTATE_BYTES), so every matmul starts from DRAM as in the model. Four graphs each:

- `stall`: the work alone.
- `serial`: the work, then the matmul.
- `prefetch_join`: a side stream reads the layer's weight into L2 (one load of every byte,
  evict_last) beside the work; the matmul waits for that read.
- `prefetch_free`: the same, but the matmul does not wait (the streams join once, at the end).

Per layer, `serial - stall` is the matmul's exposed time from DRAM, `prefetch_* - stall` with the read
beside the work. Times are the mean of REPLAYS back-to-back graph replays, divided by L. The
matmul is cuBLAS (`torch.matmul`). At M = 1, where the shape has a launch in
`triton_gemv.DECODE_GEMV_CONFIGS`, the engine's Triton GEMV is measured as well. Before timing, every
matmul's output is checked against float32 math, and the prefetch kernel's partial sums against the
weight's sum."""
from __future__ import annotations

import json
import math
import os
import sys

import torch
import triton
import triton.language as tl

from tscompile.bench.graph_timing import capture_graph, replay_us

SHAPES = {  # (model, projection): (N, K) of the [N, K] weight
    ("llama-1b", "qkv"): (3072, 2048), ("llama-1b", "o"): (2048, 2048), ("llama-1b", "down"): (2048, 8192),
    ("llama-1b", "gate_up"): (16384, 2048), ("llama-8b", "qkv"): (6144, 4096), ("llama-8b", "o"): (4096, 4096),
}
ROWS = (1, 32)
STALLS_US = (3.0, 9.0)  # the small kernels between two projections; bs=1 attention per layer (~9 us)
# the bandwidth-bound stand-in: llama-1b's fused gate/up [N, K] at the same M, over copies that pass
# the L2 (does a prefetch beside a kernel that already streams DRAM gain or just share the bus?)
NEIGHBOR = (16384, 2048)
NEIGHBOR_COPIES = 4
ROTATE_BYTES = 200 << 20  # 4x the H200's 50 MB L2
MIN_LAYERS = 8
REPLAYS = 30  # back to back between two events (bench/graph_timing.py)
PREFETCH_BLOCK = 4096  # elements per program: 8 KB of bf16
MAX_DIFF = 5e-2  # outputs ~N(0, 1) (w scaled by 1/sqrt(K)); bf16 rounding stays well below


@triton.jit
def _l2_prefetch_kernel(src, partial, n, BLOCK: tl.constexpr):
    # every element loaded once with evict_last, so the lines stay in L2 for the consumer; the
    # per-program sum is stored only so that the compiler cannot drop the loads
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src + offs, mask=offs < n, other=0.0, eviction_policy="evict_last")
    tl.store(partial + pid, tl.sum(x.to(tl.float32), axis=0))


def prefetch_partials(w: torch.Tensor) -> torch.Tensor:
    """The fp32 buffer ``prefetch_into_l2`` writes for ``w``: one partial sum per program."""
    return torch.empty(triton.cdiv(w.numel(), PREFETCH_BLOCK), device=w.device, dtype=torch.float32)


def prefetch_into_l2(w: torch.Tensor, partial: torch.Tensor) -> None:
    """Read every byte of the contiguous ``w`` once (into L2 on a GPU); ``partial`` gets the sums."""
    if not w.is_contiguous():
        raise ValueError("tscompile: the L2 prefetch reads a contiguous weight")
    n = w.numel()
    grid = triton.cdiv(n, PREFETCH_BLOCK)
    if partial.numel() != grid or partial.dtype != torch.float32:
        raise ValueError(f"tscompile: the prefetch needs a float32 buffer of {grid} partial sums")
    _l2_prefetch_kernel[(grid,)](w.view(-1), partial, n, BLOCK=PREFETCH_BLOCK)


def sleep_cycles_per_us() -> float:
    """Calibrates ``torch.cuda._sleep``: GPU cycles per microsecond, from a graph of long sleeps."""
    cycles = 200_000

    def sleeps():
        for _ in range(10):
            torch.cuda._sleep(cycles)

    return cycles / (replay_us(capture_graph(sleeps), REPLAYS) / 10)


def layers_us(variant: str, weights, partials, x, outs, before, matmul) -> float:
    """Microseconds per layer of L layers of ``before(i)`` (the work the prefetch hides behind) then
    the matmul on weight i, replayed as one CUDA graph (a side stream for the prefetch variants)."""
    prefetch = variant in ("prefetch_join", "prefetch_free")
    side = torch.cuda.Stream()

    def run():
        main = torch.cuda.current_stream()
        for i, (w, part, out) in enumerate(zip(weights, partials, outs)):
            if prefetch:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    prefetch_into_l2(w, part)
            before(i)
            if variant == "prefetch_join":
                main.wait_stream(side)
            if variant != "stall":
                matmul(x, w, out)
        if variant == "prefetch_free":
            main.wait_stream(side)

    return replay_us(capture_graph(run), REPLAYS) / len(weights)


def cublas(x, w, out):
    torch.matmul(x, w.t(), out=out)


def probe_shape(model: str, proj: str, n: int, k: int, cycles_per_us: float, neighbors) -> list[dict]:
    from tscompile.custom_ops import triton_gemv as tg

    weight_bytes = n * k * 2
    layers = max(MIN_LAYERS, math.ceil(ROTATE_BYTES / weight_bytes))
    weights = [(torch.randn(n, k, device="cuda") / math.sqrt(k)).to(torch.bfloat16) for _ in range(layers)]
    partials = [prefetch_partials(w) for w in weights]
    for w, part in zip(weights[:2], partials[:2]):  # the read covers every element
        part.fill_(float("nan"))
        prefetch_into_l2(w, part)
        want = w.float().sum().item()
        assert math.isclose(part.sum().item(), want, rel_tol=1e-3, abs_tol=1.0), (part.sum().item(), want)
    rows = []
    for m in ROWS:
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
        kernels = {"cublas": cublas}
        launch = tg.DECODE_GEMV_CONFIGS.get((n, k))
        if m == 1 and launch is not None:
            kernels["triton_gemv"] = lambda x_, w_, out_, launch=launch: tg.gemv(x_, w_, out_, config=launch)
        ref = x.float() @ weights[0].float().t()
        nx = torch.randn(m, NEIGHBOR[1], device="cuda").to(torch.bfloat16)
        nout = torch.empty(m, NEIGHBOR[0], device="cuda", dtype=torch.bfloat16)
        stalls = {f"sleep {us:g} us": (lambda i, c=int(us * cycles_per_us): torch.cuda._sleep(c))
                  for us in STALLS_US}
        stalls["gate/up read"] = lambda i: cublas(nx, neighbors[i % len(neighbors)], nout)
        for name, matmul in kernels.items():
            outs[0].fill_(float("nan"))
            matmul(x, weights[0], outs[0])
            torch.cuda.synchronize()
            diff = (outs[0].float() - ref).abs().max().item()
            if not diff <= MAX_DIFF:
                raise AssertionError(f"{model} {proj} M={m} {name}: max |diff| {diff} against float32")
            for stall, before in stalls.items():
                t = {v: layers_us(v, weights, partials, x, outs, before, matmul)
                     for v in ("stall", "serial", "prefetch_join", "prefetch_free")}
                row = {"model": model, "proj": proj, "n": n, "k": k, "m": m, "kernel": name, "layers": layers,
                       "weight_mb": round(weight_bytes / 1e6, 2), "stall": stall,
                       **{f"{v}_us": round(u, 3) for v, u in t.items()},
                       "matmul_from_dram_us": round(t["serial"] - t["stall"], 3),
                       "gain_join_us": round(t["serial"] - t["prefetch_join"], 3),
                       "gain_free_us": round(t["serial"] - t["prefetch_free"], 3)}
                row["dram_tb_s"] = round(weight_bytes / max(row["matmul_from_dram_us"], 1e-3) / 1e6, 2)
                print(f"{model:8s} {proj:7s} M={m:<2d} {name:11s} {stall:12s}: serial "
                      f"{t['serial']:6.2f}  prefetch+join {t['prefetch_join']:6.2f}  prefetch free "
                      f"{t['prefetch_free']:6.2f}  (stall alone {t['stall']:5.2f}; matmul from DRAM "
                      f"{row['matmul_from_dram_us']:5.2f} us, {row['dram_tb_s']:.2f} TB/s)", flush=True)
                rows.append(row)
    del weights, partials
    torch.cuda.empty_cache()
    return rows


def main(argv: list[str]) -> int:
    if not torch.cuda.is_available():
        print("tscompile: scripts/l2_prefetch_probe.py measures an NVIDIA GPU; none is visible", file=sys.stderr)
        return 2
    out_path = argv[0] if argv else os.path.join(os.environ.get("OUT", "."), "l2_prefetch_probe.json")
    cycles_per_us = sleep_cycles_per_us()
    print(f"{torch.cuda.get_device_name()}: torch.cuda._sleep runs {cycles_per_us:.0f} cycles per us")
    neighbors = [(torch.randn(*NEIGHBOR, device="cuda") / math.sqrt(NEIGHBOR[1])).to(torch.bfloat16)
                 for _ in range(NEIGHBOR_COPIES)]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "sleep_cycles_per_us": cycles_per_us, "replays": REPLAYS, "rows": []}
    for (model, proj), (n, k) in SHAPES.items():
        result["rows"] += probe_shape(model, proj, n, k, cycles_per_us, neighbors)
        with open(out_path, "w") as f:  # rewritten per shape: a call cut at its deadline keeps the rest
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
