"""Time the split-KV decode attention over its launch settings, beside SDPA on a static cache.

    python3 scripts/decode_attn_sweep.py [--bs 8 32 64] [--budget-s 240]   # writes $OUT/decode_attn_sweep.{json,md}

Why: on llama-8b at bs=32 the tuned stock baseline's cuDNN flash decode (SDPA, enable_gqa, a static
640-position cache) read its cache at about 3.4 TB/s while tscompile's split-KV Triton kernel read the
paged cache at about 2.97 TB/s plus a combine kernel (bench/results/llama-8b-b964437/). This script
times `triton_attention.paged_decode` (the split and combine kernels, what a decode step launches per
layer; the split kernel writing the new K/V rows too, as the op runs it) on the llama-8b decode shape of the bench (32 query / 8 KV heads of 128, pages of 16, a table of
2064 positions, every request at the bench's mean decode context of 576) for each setting of
DECODE_BLOCK_N x DECODE_NUM_WARPS x DECODE_NUM_STAGES at the default split target, then the split
target (DECODE_TARGET_PROGRAMS) for the three fastest, and SDPA the way the tuned baseline calls it.

Each setting runs 32 layers' worth of separate caches in one CUDA graph (so no layer reads another's
bytes from L2, as in a real step), replayed --reps times; the figure is us per layer. Every setting's
first layer is checked against the float32 torch oracle (`custom_ops.attention._torch_decode`) on the
same inputs before it is timed; a setting that fails to compile (shared memory) or to match is listed
with its error. Nothing here changes a default: it says which setting to make the default, for a
later bench run to confirm. On the CPU (tests) it runs the same checks under TRITON_INTERPRET=1 on a
tiny shape, timing without graphs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import torch
import torch.nn.functional as F

from tscompile.bench.graph_timing import capture_graph, replay_us
from tscompile.custom_ops import attention as torch_attention
from tscompile.custom_ops import triton_attention as ta
from tscompile.utils import cdiv

KNOBS = ("DECODE_BLOCK_N", "DECODE_NUM_WARPS", "DECODE_NUM_STAGES", "DECODE_TARGET_PROGRAMS")


def make_layers(bs: int, ctx: int, max_kv: int, hq: int, hkv: int, d: int, page: int, layers: int,
                dtype: torch.dtype, device: torch.device, seed: int) -> list[dict]:
    """Per layer: q, a paged cache holding each request's ``ctx`` positions (page 0 the null page,
    the table's unused columns pointing at it), the table and the lengths; and the same K/V as the
    tuned baseline's static cache [bs, hkv, S, d] with S = the bench's prompt + output (640)."""
    gen = torch.Generator(device=device).manual_seed(seed)  # drawn where they live: GBs at bs=64
    per_req = cdiv(ctx, page)
    table = torch.zeros(bs, max_kv // page, dtype=torch.int32, device=device)
    table[:, :per_req] = 1 + torch.arange(bs * per_req, dtype=torch.int32, device=device).view(bs, per_req)
    pages = 1 + bs * per_req

    def draw(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    # each request's newest position: its slot, and the K/V already there as the rows the step writes
    # (the default decode writes them in the split kernel; writing the same values keeps the oracle's cache)
    rows = torch.arange(bs, device=device)
    write_loc = (table[rows, (ctx - 1) // page].long() * page + (ctx - 1) % page)
    out = []
    for _ in range(layers):
        layer = {"q": draw(bs, hq, d), "k_cache": draw(pages, page, hkv, d), "v_cache": draw(pages, page, hkv, d),
                 "page_table": table, "seq_lens": torch.full((bs,), ctx, dtype=torch.int32, device=device)}
        layer["new_kv"] = (layer["k_cache"].view(-1, hkv, d)[write_loc].clone(),
                           layer["v_cache"].view(-1, hkv, d)[write_loc].clone(), write_loc)
        out.append(layer)
    return out


def decode(layer: dict, scale: float) -> None:
    """One layer's decode attention as the engine's step runs it: the split kernel writing the new
    K/V rows too, as the op runs it."""
    ta.paged_decode(layer["q"], layer["k_cache"], layer["v_cache"], layer["out"], layer["page_table"],
                    layer["seq_lens"], scale, new_kv=layer["new_kv"])


def static_view(layer: dict, bs: int, ctx: int, static_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's K/V as the static-cache baseline holds them: [bs, hkv, static_len, d], zeros past ctx."""
    page = layer["k_cache"].shape[1]
    per_req = cdiv(ctx, page)
    ks, vs = [], []
    for name, dst in (("k_cache", ks), ("v_cache", vs)):
        pool = layer[name]
        rows = pool[layer["page_table"][:, :per_req].long()]  # [bs, per_req, page, hkv, d]
        rows = rows.flatten(1, 2)[:, :ctx].transpose(1, 2)  # [bs, hkv, ctx, d]
        full = torch.zeros(bs, rows.shape[1], static_len, rows.shape[3], dtype=pool.dtype, device=pool.device)
        full[:, :, :ctx] = rows
        dst.append(full)
    return ks[0], vs[0]


def oracle(layer: dict, scale: float) -> torch.Tensor:
    want = torch.empty(layer["q"].shape, dtype=torch.float32, device=layer["q"].device)
    torch_attention._torch_decode(layer["q"].float(), layer["k_cache"].float(), layer["v_cache"].float(), want,
                                  layer["page_table"], layer["seq_lens"], scale)
    return want


def time_layers(fn, layers: list, device: torch.device, reps: int) -> float:
    """us per layer: every layer's call in one CUDA graph, replayed ``reps`` times (cuda); plain
    calls on the CPU."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            for layer in layers:
                fn(layer)
        return (time.perf_counter() - t0) / (reps * len(layers)) * 1e6
    def step():
        for layer in layers:
            fn(layer)
    return replay_us(capture_graph(step), reps) / len(layers)


def run_setting(setting: dict, layers: list, want: torch.Tensor, scale: float, device, reps: int,
                tol: float) -> dict:
    saved = {k: getattr(ta, k) for k in KNOBS}
    row = {**setting, "error": None}
    try:
        for k, v in setting.items():
            setattr(ta, k, v)
        first = layers[0]
        row["splits"] = ta._decode_launch(first["q"], first["k_cache"], first["page_table"])[5]
        outs = [torch.full_like(layer["q"], float("nan")) for layer in layers]
        for layer, out in zip(layers, outs):
            layer["out"] = out
        decode(first, scale)
        err = (first["out"].float() - want).abs().max().item()
        row["max_abs_err"] = err
        if not err <= tol:  # NaN too
            raise AssertionError(f"max |error| {err:.3g} against the float32 oracle (tolerance {tol})")
        row["us_per_layer"] = time_layers(lambda L: decode(L, scale), layers, device, reps)
    except Exception as e:  # noqa: BLE001  (a setting that does not compile or match is a result too)
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    finally:
        for k, v in saved.items():
            setattr(ta, k, v)
    return row


def sdpa_row(layers: list, bs: int, ctx: int, static_len: int, scale: float, device, reps: int, tol: float,
             want: torch.Tensor) -> dict:
    """The tuned baseline's formulation: SDPA over the static cache, a boolean mask, enable_gqa."""
    row = {"what": "sdpa static cache (enable_gqa, mask)", "error": None}
    try:
        statics = []
        for layer in layers:
            k, v = static_view(layer, bs, ctx, static_len)
            mask = (torch.arange(static_len, device=device) < ctx).view(1, 1, 1, static_len).expand(bs, 1, 1, static_len)
            q4 = layer["q"].unsqueeze(2)  # [bs, hq, 1, d]
            statics.append({"q": q4, "k": k, "v": v, "mask": mask, "out": torch.empty_like(q4)})

        def call(s):
            s["out"].copy_(F.scaled_dot_product_attention(s["q"], s["k"], s["v"], attn_mask=s["mask"], scale=scale,
                                                          enable_gqa=True))
        call(statics[0])
        err = (statics[0]["out"].squeeze(2).float() - want).abs().max().item()
        row["max_abs_err"] = err
        if not err <= tol:
            raise AssertionError(f"max |error| {err:.3g} against the float32 oracle")
        row["us_per_layer"] = time_layers(call, statics, device, reps)
    except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return row


def sweep(bs: int, a, device, dtype, deadline: float) -> dict:
    layers = make_layers(bs, a.ctx, a.max_kv, a.hq, a.hkv, a.d, a.page, a.layers, dtype, device, a.seed)
    scale = a.d ** -0.5
    want = oracle(layers[0], scale)
    kv_bytes = bs * a.ctx * a.hkv * a.d * 2 * dtype.itemsize  # K and V read per layer
    default = {k: getattr(ta, k) for k in KNOBS}
    rows = [{"what": "default", **run_setting({}, layers, want, scale, device, a.reps, a.tol)}]
    # the tile settings at one split target (the engine's default when no override is set), so they
    # compare with each other; the one-split launch of head_dim 128 shows among the "splits" rows
    target = ta.DECODE_TARGET_PROGRAMS or ta.DECODE_DEFAULT_TARGET_PROGRAMS
    for block_n, warps, stages in itertools.product(a.block_n, a.warps, a.stages):
        if time.monotonic() > deadline:
            break
        setting = {"DECODE_BLOCK_N": block_n, "DECODE_NUM_WARPS": warps, "DECODE_NUM_STAGES": stages,
                   "DECODE_TARGET_PROGRAMS": target}
        rows.append({"what": "tile", **run_setting(setting, layers, want, scale, device, a.reps, a.tol)})
    timed = sorted((r for r in rows if r["what"] == "tile" and r.get("us_per_layer")), key=lambda r: r["us_per_layer"])
    for best in timed[:3]:
        for t in a.targets:
            if time.monotonic() > deadline or t == target:
                continue
            setting = {k: best[k] for k in KNOBS} | {"DECODE_TARGET_PROGRAMS": t}
            rows.append({"what": "splits", **run_setting(setting, layers, want, scale, device, a.reps, a.tol)})
    rows.append(sdpa_row(layers, bs, a.ctx, a.static_len, scale, device, a.reps, a.tol, want))
    for r in rows:
        if r.get("us_per_layer"):
            r["gbps"] = kv_bytes / (r["us_per_layer"] * 1e-6) / 1e9
    del layers
    return {"bs": bs, "kv_bytes_per_layer": kv_bytes, "defaults": default, "rows": rows}


def markdown(result: dict) -> str:
    lines = [f"## Decode attention sweep: {result['device_name']} ({result['dtype']})", "",
             f"{result['hq']} query / {result['hkv']} KV heads of {result['d']}, pages of {result['page']}, a table of "
             f"{result['max_kv']} positions, every request at {result['ctx']}; {result['layers']} layers per CUDA graph, "
             f"{result['reps']} replays; us per layer (split + combine kernels), GB/s = K and V bytes / time. "
             f"Defaults: {result['per_bs'][0]['defaults'] if result['per_bs'] else '-'}.", ""]
    for block in result["per_bs"]:
        lines += [f"### bs={block['bs']} ({block['kv_bytes_per_layer'] / 1e6:.1f} MB of K/V per layer)", "",
                  "| what | BLOCK_N | warps | stages | target programs | splits | us/layer | GB/s | max err | error |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        rows = sorted(block["rows"], key=lambda r: (r.get("us_per_layer") is None, r.get("us_per_layer") or 0))
        for r in rows:
            def f(key, fmt="{}"):
                return fmt.format(r[key]) if r.get(key) is not None else "-"
            lines.append(f"| {r['what']} | {f('DECODE_BLOCK_N')} | {f('DECODE_NUM_WARPS')} | {f('DECODE_NUM_STAGES')} | "
                         f"{f('DECODE_TARGET_PROGRAMS')} | {f('splits')} | {f('us_per_layer', '{:.2f}')} | "
                         f"{f('gbps', '{:.0f}')} | {f('max_abs_err', '{:.2g}')} | {r.get('error') or ''} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bs", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--ctx", type=int, default=576, help="positions per request (the bench's mean decode context)")
    p.add_argument("--max-kv", type=int, default=2064, help="the page table's positions (the bench's max_model_len)")
    p.add_argument("--static-len", type=int, default=640, help="the static baseline's cache length")
    p.add_argument("--hq", type=int, default=32)
    p.add_argument("--hkv", type=int, default=8)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--targets", type=int, nargs="+", default=[256, 512, 2048, 4096])
    p.add_argument("--tol", type=float, default=2e-2, help="max |error| against the float32 oracle (bf16 output)")
    p.add_argument("--min-split-tokens", type=int, default=None,
                   help="DECODE_MIN_SPLIT_TOKENS for the whole run (tests: many splits on a tiny table)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=300.0, help="stop starting settings after this long")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args(argv)
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    start = time.monotonic()
    result = {"device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
              **{k: getattr(a, k) for k in ("hq", "hkv", "d", "page", "ctx", "max_kv", "static_len", "layers", "reps")},
              "per_bs": []}
    os.makedirs(a.out, exist_ok=True)
    if a.min_split_tokens is not None:
        ta.DECODE_MIN_SPLIT_TOKENS = a.min_split_tokens
    for i, bs in enumerate(a.bs):
        # an equal share of what is left to each batch size still to run
        left = a.budget_s - (time.monotonic() - start)
        result["per_bs"].append(sweep(bs, a, device, dtype, time.monotonic() + left / (len(a.bs) - i)))
        with open(os.path.join(a.out, "decode_attn_sweep.json"), "w") as f:  # after every batch size
            json.dump(result, f, indent=1)
        md = markdown(result)
        with open(os.path.join(a.out, "decode_attn_sweep.md"), "w") as f:
            f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
