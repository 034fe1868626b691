"""Bench output: the environment header, the JSON file, the markdown tables and the plot."""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

import torch


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device) -> dict:
    """Versions and hardware every result JSON carries."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001  (absent or broken: report, do not fail)
        triton_version = None
    env = {
        "torch_version": torch.__version__,
        "triton_version": triton_version,
        "cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "cpu_name": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "gpu_name": None,
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
    }
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu_name"] = props.name
        env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    return env


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_json(result: dict, path: str | os.PathLike) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)
        f.write("\n")


# -- markdown --------------------------------------------------------------------------------------
def _fmt(value, spec: str = ".2f") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


DECODE_HEADER = ["mode", "bs", "TPOT ms", "TPOT min-max", "decode tok/s", "TTFT ms", "compile s", "capture s", "peak GiB",
                 "GB/s", "roofline ms", "% roofline", "= eager", "error"]


def decode_table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        err = (r.get("error") or "").replace("|", "/").replace("\n", " ")
        out.append([
            r["mode"], str(r["batch_size"]), _fmt(r.get("tpot_ms"), ".3f"),
            (f"{_fmt(r.get('tpot_ms_min'), '.3f')}-{_fmt(r.get('tpot_ms_max'), '.3f')}"
             if r.get("tpot_ms_min") is not None else "-"),
            _fmt(r.get("decode_tokens_per_s"), ".1f"),
            _fmt(r.get("ttft_ms"), ".2f"), _fmt(r.get("compile_s"), ".2f"), _fmt(r.get("capture_s"), ".2f"),
            _fmt(r.get("peak_memory_gib"), ".2f"), _fmt(r.get("achieved_gbps"), ".1f"),
            _fmt(r.get("roofline_ms"), ".4f"), _fmt(r.get("pct_of_roofline"), ".1f"),
            _fmt(r.get("match_eager")), err[:120] or "",
        ])
    return _table(DECODE_HEADER, out)


def prefill_table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        err = (r.get("error") or "").replace("|", "/").replace("\n", " ")
        spread = (f"{_fmt(r.get('prefill_ms_min'), '.2f')}-{_fmt(r.get('prefill_ms_max'), '.2f')}"
                  if r.get("prefill_ms_min") is not None else "-")
        out.append([r["mode"], str(r["prompt_len"]), _fmt(r.get("prefill_ms"), ".2f"), spread,
                    _fmt(r.get("prefill_tokens_per_s"), ".1f"), err[:120]])
    return _table(["mode", "prompt len (bs=1)", "prefill ms (median)", "min-max", "prefill tok/s", "error"], out)


def markdown(result: dict) -> str:
    env, args = result["env"], result["args"]
    hw = env.get("gpu_name") or env.get("cpu_name")
    head = (f"## tscompile bench: {result['model']} on {hw} ({env['device']}, {result['dtype']})\n\n"
            f"{result['date']} · torch {env['torch_version']} · triton {env['triton_version']} · "
            f"CUDA {env['cuda_version']} · input {args['input_len']} · output {args['output_len']} · "
            f"iters {args['num_iters']} (+{args['num_iters_warmup']} warm-up) · "
            f"copy bandwidth {result['copy_bandwidth_gbps']:.1f} GB/s\n")
    if result.get("complete") is False:
        head += "\n**Partial run**: cut short; the rows below are the ones that finished.\n"
    notes = ("\nTPOT = mean decode step (decode-only steps), with the fastest and slowest iteration's mean; prefill "
             "ms = the median of the timed iterations; roofline ms = (weights + KV read per step at the mean "
             "decode context) / copy bandwidth; % roofline = roofline / TPOT; `= eager` = requests whose greedy "
             "tokens equal eager's at the same bs (bf16 may drift on near-ties). Static-cache compile/capture times are the first warm-up "
             "run's excess over the steady state.\n")
    return "\n".join([head, "### Decode", "", decode_table(result["results"]), "",
                      "### Prefill", "", prefill_table(result["prefill"]), notes])


# -- plot ------------------------------------------------------------------------------------------
def plot(result: dict, path: str | os.PathLike) -> None:
    """Decode ms/step vs batch size, one line per mode (roofline dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401  (matplotlib.ticker.FuncFormatter below)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    modes = list(dict.fromkeys(r["mode"] for r in result["results"]))
    for mode in modes:
        pts = [(r["batch_size"], r["tpot_ms"]) for r in result["results"]
               if r["mode"] == mode and r.get("tpot_ms") is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=mode)
    roof = {r["batch_size"]: r["roofline_ms"] for r in result["results"] if r.get("roofline_ms") is not None}
    if roof:
        xs = sorted(roof)
        ax.plot(xs, [roof[x] for x in xs], "k--", label="roofline")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    sizes = sorted({r["batch_size"] for r in result["results"]})
    ax.set_xticks(sizes, [str(b) for b in sizes])
    label = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(label)
    low, high = ax.get_ylim()
    ax.yaxis.set_minor_formatter(label if high / low < 20 else matplotlib.ticker.NullFormatter())
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode ms / step")
    env = result["env"]
    ax.set_title(f"{result['model']} · {env.get('gpu_name') or env.get('cpu_name')} · "
                 f"in {result['args']['input_len']} out {result['args']['output_len']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
