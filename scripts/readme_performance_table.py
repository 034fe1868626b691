"""The README's performance table from one bench results file: a column per mode, a row per decode
batch size (ms per step), per prefill length (ms) and the compile time, the fastest figure of each
timed row in bold, "-" where the run has no figure.

    python3 scripts/readme_performance_table.py bench/results/RUN/results.json --prefill-lens 32 2048

Paste its output over the README's table; ``tests/test_readme_performance.py`` holds the README to
the file it cites.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _cell(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _row(label: str, values: list[float | None], digits: int, bold_best: bool = True) -> str:
    cells = [_cell(v, digits) for v in values]
    present = [v for v in values if v is not None]
    if bold_best and present:
        best = values.index(min(present))
        cells[best] = f"**{cells[best]}**"
    return f"| {label} | " + " | ".join(cells) + " |"


def table(result: dict, batch_sizes: list[int] | None = None, prefill_lens: list[int] | None = None) -> str:
    modes = result["modes_run"]
    decode = {(r["mode"], r["batch_size"]): r["tpot_ms_median"] for r in result["results"] if r["error"] is None}
    prefill = {(r["mode"], r["prompt_len"]): r["prefill_ms"] for r in result["prefill"] if r["error"] is None}
    batch_sizes = batch_sizes or sorted({bs for _, bs in decode})
    prefill_lens = prefill_lens or sorted({n for _, n in prefill})
    lines = ["| | " + " | ".join(modes) + " |", "|---" * (len(modes) + 1) + "|"]
    for i, bs in enumerate(batch_sizes):
        label = f"decode bs {bs}, ms/step" if i == 0 else f"decode bs {bs}"
        lines.append(_row(label, [decode.get((m, bs)) for m in modes], 3))
    for n in prefill_lens:
        lines.append(_row(f"prefill {n} tokens, ms", [prefill.get((m, n)) for m in modes], 2))
    compile_s = [result["modes"].get(m, {}).get("compile_s") for m in modes]
    lines.append(_row("compile s (warm caches)", compile_s, 1, bold_best=False))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", help="a tscompile bench results JSON (an engine run, merged or not)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="decode rows (default: every one run)")
    p.add_argument("--prefill-lens", type=int, nargs="+", default=None, help="prefill rows (default: every one run)")
    a = p.parse_args(argv)
    print(table(json.loads(Path(a.results).read_text()), a.batch_sizes, a.prefill_lens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
