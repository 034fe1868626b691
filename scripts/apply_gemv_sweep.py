"""Write a GEMV launch sweep's one-row picks into the decode launch table.

    tscompile bench --gemv-sweep --model qwen3-next-1b --gemv-rows 1 --output-json sweep.json
    python3 scripts/apply_gemv_sweep.py sweep.json

``triton_gemv.decode_table_from_sweep`` reads the sweep (per weight shape, its best launch at one row
where that beat cuBLAS by ``TABLE_MIN_SPEEDUP``); every picked shape the table lacks is added to
``DECODE_GEMV_CONFIGS`` in ``custom_ops/triton_gemv.py`` (or ``--source``), with the projections and
the two timings as its comment, in the table's own format. Shapes already listed keep their launch
(printed, so a sweep that disagrees is seen). The tables apply only on the GPUs of
``DECODE_GEMV_DEVICES``: run the sweep on one of them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tscompile.custom_ops import triton_gemv as tg

TABLE_START = "DECODE_GEMV_CONFIGS: dict[tuple[int, int], tuple] = {"


def _literal(launch: tuple) -> str:
    """A launch as the table writes it: ``(1, 2048, 1, 8, 1, "acc")``."""
    return "(" + ", ".join(json.dumps(v) for v in launch) + ")"


def new_entries(sweep: dict, table: dict) -> tuple[list[str], list[str]]:
    """(the table lines to add, the notes on picks the table already has a launch for)."""
    picks = tg.decode_table_from_sweep(sweep)
    by_shape = {(int(s["n"]), int(s["k"])): (label, s) for label, s in sweep["summary"].items()}
    lines, kept = [], []
    for shape, launch in picks.items():
        label, s = by_shape[shape]
        if shape in table:
            kept.append(f"{shape}: the table keeps {table[shape]}; the sweep picked {launch} ({label})")
            continue
        model, _, projections = label.partition("/")
        entry = f"    {shape}: {_literal(launch)},"
        lines.append(f"{entry:<48} # {model} {projections}: {s['best_m1_us']:.1f} / {s['cublas_m1_us']:.1f}\n")
    return lines, kept


def apply(source: str, lines: list[str]) -> str:
    """``source`` with ``lines`` added at the end of the ``DECODE_GEMV_CONFIGS`` literal."""
    start = source.index(TABLE_START)
    end = source.index("\n}\n", start) + 1
    return source[:end] + "".join(lines) + source[end:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", help="the JSON of `tscompile bench --gemv-sweep`")
    p.add_argument("--source", default=tg.__file__, help="the launch tables' module (default: the installed one)")
    a = p.parse_args(argv)
    sweep = json.loads(Path(a.sweep).read_text())
    lines, kept = new_entries(sweep, tg.DECODE_GEMV_CONFIGS)
    for note in kept:
        print(note)
    if lines:
        path = Path(a.source)
        path.write_text(apply(path.read_text(), lines))
    print("".join(lines) or "no shape to add", end="" if lines else "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
