"""What the decode GEMV's fusions cost the kernel (TSCOMPILE_DECODE_GEMV_FUSE), per projection, on the GPU.

    python scripts/gemv_fused_sweep.py [out.json]      (about a minute on an H200)

Each fusion removes a separate kernel from the bs=1 step (an RMSNorm with its residual add, a SiLU-mul:
about 1.5-2.5 us each on the H200, bench/results/same-lease-ada2650/) and adds work to the GEMV: the
norm weight's loads and the sum of squares (a norm), the second half of x and the SiLU (swiglu), the
residual's loads (an epilogue). It pays where the kernel grows by less than the kernel it removes.
Per shape, at M = 1 and for a few "acc" launches, this times the plain kernel and the fused one on the
same launch (medians of CUDA-graph replays over weight copies larger than the L2, as
scripts/gemv_sweep.py times), checks the fused output against float32 math, and writes both with the
difference; the launch with the best fused time is the candidate for the fused table.

The fusions per projection are the model's: qkv, gate/up and the LM head take a norm; the output
projection a residual; down the SiLU-mul and a residual."""
import json
import sys
import time

import torch

import gemv_sweep as sweep  # scripts/ is on sys.path when this runs as a script
from tscompile.custom_ops import triton_gemv as tg

FUSIONS = {"qkv": "norm", "o": "residual", "gate_up": "norm", "down": "swiglu+residual", "lm_head": "norm"}
LAUNCHES = [(1, 2048, 1, 8, 1, "acc"), (2, 2048, 1, 8, 1, "acc"), (4, 2048, 1, 16, 1, "acc"),
            (2, 4096, 1, 8, 1, "acc"), (1, 1024, 1, 4, 1, "acc")]
EPS = 1e-5


def fused_inputs(fusion: str, n: int, k: int):
    """(x, kwargs, reference(w)) for one fusion at M = 1: x is [1, 2K] for swiglu."""
    g = torch.Generator(device=sweep.DEVICE).manual_seed(n + k)
    dev, dt = sweep.DEVICE, sweep.DTYPE
    kwargs = {}
    if "swiglu" in fusion:
        x = torch.randn(1, 2 * k, device=dev, dtype=dt, generator=g)
        gate, up = x.float().chunk(2, dim=-1)
        act = ((gate / (1 + torch.exp(-gate))).to(dt).float() * up).to(dt).float()
        kwargs["swiglu"] = True
    else:
        x = torch.randn(1, k, device=dev, dtype=dt, generator=g) * 3.0
        act = x.float()
    if "norm" in fusion:
        weight = (1.0 + 0.1 * torch.randn(k, device=dev, generator=g)).to(dt)
        act = act * torch.rsqrt(act.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()
        kwargs.update(norm_weight=weight, eps=EPS)
    residual = None
    if "residual" in fusion:
        residual = torch.randn(1, n, device=dev, dtype=dt, generator=g)
        kwargs["residual"] = residual

    def reference(w):
        out = act @ w.float().T
        return out.to(dt).float() + residual.float() if residual is not None else out

    return x, kwargs, reference


def plain_x(x: torch.Tensor, fusion: str, k: int) -> torch.Tensor:
    return x[:, :k].contiguous() if "swiglu" in fusion else x


def sweep_shape(model: str, proj: str, n: int, k: int) -> dict:
    fusion = FUSIONS[proj]
    weights = sweep.weight_copies(n, k)
    x, kwargs, reference = fused_inputs(fusion, n, k)
    xp = plain_x(x, fusion, k)
    want = reference(weights[0])
    row = {"model": model, "proj": proj, "n": n, "k": k, "fusion": fusion, "launches": {}}
    for cfg in LAUNCHES:
        out = torch.full((1, n), float("nan"), device=sweep.DEVICE, dtype=sweep.DTYPE)
        try:
            tg.gemv(x, weights[0], out, config=cfg, **kwargs)
            entry = {"max_diff": sweep.max_diff(out, want)}
            entry["plain_us"] = 1e3 * sweep.bench(sweep.rotating(lambda w: tg.gemv(xp, w, out, config=cfg), weights))
            entry["fused_us"] = 1e3 * sweep.bench(sweep.rotating(
                lambda w: tg.gemv(x, w, out, config=cfg, **kwargs), weights))
            entry["added_us"] = entry["fused_us"] - entry["plain_us"]
        except Exception as e:  # a launch the GPU cannot run (registers, shared memory)
            entry = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
        row["launches"][",".join(map(str, cfg))] = entry
    ok = {c: e for c, e in row["launches"].items() if "fused_us" in e and e["max_diff"] <= sweep.MAX_DIFF}
    row["best_fused"] = min(ok, key=lambda c: ok[c]["fused_us"]) if ok else None
    return row


def report(row: dict) -> None:
    best = row["best_fused"]
    head = f"{row['model']:9s} {row['proj']:8s} N={row['n']:6d} K={row['k']:5d} {row['fusion']:16s}"
    if best is None:
        print(f"{head} no correct launch: {row['launches']}", flush=True)
        return
    e = row["launches"][best]
    print(f"{head} best fused {best}: {e['fused_us']:6.1f} us (plain {e['plain_us']:6.1f}, "
          f"+{e['added_us']:.1f})", flush=True)
    for cfg, e in row["launches"].items():
        if "error" in e or e["max_diff"] > sweep.MAX_DIFF:
            print(f"    {cfg}: {e.get('error') or 'max diff %.3g' % e['max_diff']}", flush=True)


def main(out_path: str) -> None:
    t0, rows = time.time(), []
    for model, projs in sweep.SHAPES.items():
        for proj, (n, k) in projs.items():
            if proj not in FUSIONS or (sweep.ONLY and f"{model}/{proj}" not in sweep.ONLY):
                continue
            rows.append(sweep_shape(model, proj, n, k))
            report(rows[-1])
            with open(out_path, "w") as f:  # rewritten per shape: a call cut short keeps what it measured
                json.dump({"rows": rows, "launches": LAUNCHES, "elapsed_s": time.time() - t0}, f, indent=1)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gemv_fused_sweep.json")
