"""The bench's plot: decode ms per step against batch size, one line per mode."""

from __future__ import annotations

import os
from pathlib import Path


def plot(result: dict, path: str | os.PathLike) -> None:
    """Decode ms/step vs batch size, one line per mode (roofline dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401  (matplotlib.ticker.FuncFormatter below)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    modes = list(dict.fromkeys(r["mode"] for r in result["results"]))
    for mode in modes:
        key = "tpot_ms_median" if any(r.get("tpot_ms_median") is not None for r in result["results"]) else "tpot_ms"
        pts = [(r["batch_size"], r[key]) for r in result["results"]
               if r["mode"] == mode and r.get(key) is not None]
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
