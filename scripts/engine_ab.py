"""An A/B of one engine switch inside one process: two engines of the same model (same weights), the
first built with a module attribute at one value, the second at the other, then their bs=1 prefills
(and optionally bs=1 decode) alternated, so both see the same host, clocks and profiler-free process.

    python3 scripts/engine_ab.py --toggle triton_gemv.PREFILL_GEMV [--model llama-1b] [--lens 32 128]
        [--iters 40] [--decode] [--json PATH]

``--toggle MODULE.ATTR`` names an attribute of ``tscompile.custom_ops.MODULE`` (a switch read when
the engine compiles or captures, e.g. ``triton_gemv.PREFILL_GEMV``); engine A gets False, B True.

Why: the host's pre-launch time of a 32-token prefill differs by up to 0.6 ms between bench processes
of the same code, so an A/B of two processes cannot see a 1-2% change of that row."""
import argparse
import importlib
import json
import statistics

import torch

from tscompile.bench import workloads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--toggle", required=True)
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--lens", type=int, nargs="+", default=[32, 128])
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--decode", action="store_true", help="also alternate bs=1 decode runs (64 steps)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default="triton")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    mod_name, attr = a.toggle.rsplit(".", 1)
    module = importlib.import_module(f"tscompile.custom_ops.{mod_name}")
    if not hasattr(module, attr):
        raise SystemExit(f"tscompile: {a.toggle} is not an attribute of tscompile.custom_ops.{mod_name}")
    device = torch.device(a.device)
    engines = {}
    for value in (False, True):
        setattr(module, attr, value)
        # num_pages fixed: no memory sizing, so two engines fit one device (32 requests of 2064 tokens)
        engines[value] = workloads.bench_engine(a.model, device, backend=a.backend, num_pages=32 * 129)
    prompts = {n: [(7 * i) % 500 + 1 for i in range(n)] for n in a.lens}
    decode_prompt = [(3 * i) % 500 + 1 for i in range(512 if device.type == "cuda" else 64)]
    for runner in engines.values():  # captures and warm-up
        for prompt in prompts.values():
            for _ in range(3):
                runner.run_prefill(prompt)
        if a.decode:
            runner.run_batch([decode_prompt], 64)
    rows: dict[str, dict[bool, list[tuple[float, float]]]] = {}
    for _ in range(a.iters):
        for length, prompt in prompts.items():
            for value, runner in engines.items():
                wall = runner.run_prefill(prompt)
                rows.setdefault(f"prefill_{length}", {}).setdefault(value, []).append((wall * 1e3, runner.host_launch_s * 1e3))
    if a.decode:
        for _ in range(max(a.iters // 8, 3)):
            for value, runner in engines.items():
                run = runner.run_batch([decode_prompt], 64)
                rows.setdefault("decode_bs1_tpot", {}).setdefault(value, []).append((run.decode_s / run.decode_steps * 1e3, 0.0))
    out = {"toggle": a.toggle, "model": a.model, "iters": a.iters, "rows": {}}
    for row, by_value in rows.items():
        out["rows"][row] = {}
        for value, samples in by_value.items():
            walls = [w for w, _ in samples]
            hosts = [h for _, h in samples]
            out["rows"][row][str(value)] = {"median_ms": statistics.median(walls), "min_ms": min(walls),
                                            "max_ms": max(walls), "host_median_ms": statistics.median(hosts)}
        off, on = out["rows"][row]["False"], out["rows"][row]["True"]
        print(f"{row}: {attr}=False {off['median_ms']:.3f} ms (host {off['host_median_ms']:.3f}), "
              f"True {on['median_ms']:.3f} ms (host {on['host_median_ms']:.3f}), "
              f"change {100 * (on['median_ms'] / off['median_ms'] - 1):+.1f}%", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
