"""What a resumed bench job still has to measure: the flags that skip the rows earlier runs measured.

    python3 scripts/bench_resume.py --modes M [M ...] --batch-size 1 8 --prefill-lens 32 2048 --runs RUN.json ...

prints `--skip-decode ... --skip-prefill ...` (nothing when no row is done yet), or `DONE` when every row
of every mode has a measured (error-free) row in one of the runs. A row counts as done only when every
mode of the job measured it, since one bench process runs all of a job's modes over the same rows.
Used by scripts/gpu_lanes.sh (BENCH_RESUME=1) to finish, in the next GPU call, a job its call cut short.
"""

from __future__ import annotations

import argparse
import json


def done_rows(paths: list[str], modes: list[str]) -> tuple[set[int], set[int]]:
    measured: dict[str, tuple[set[int], set[int]]] = {m: (set(), set()) for m in modes}
    for path in paths:
        with open(path) as f:
            result = json.load(f)
        for key, rows, size in ((0, result.get("results", []), "batch_size"),
                                (1, result.get("prefill", []), "prompt_len")):
            for row in rows:
                if row.get("mode") in measured and not row.get("error"):
                    measured[row["mode"]][key].add(row[size])
    decode = set.intersection(*(d for d, _ in measured.values()))
    prefill = set.intersection(*(p for _, p in measured.values()))
    return decode, prefill


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", required=True)
    p.add_argument("--batch-size", type=int, nargs="+", required=True)
    p.add_argument("--prefill-lens", type=int, nargs="+", required=True)
    p.add_argument("--runs", nargs="*", default=[], metavar="RUN.json")
    a = p.parse_args()
    decode, prefill = done_rows(a.runs, a.modes)
    skip_decode = [bs for bs in a.batch_size if bs in decode]
    skip_prefill = [n for n in a.prefill_lens if n in prefill]
    if len(skip_decode) == len(a.batch_size) and len(skip_prefill) == len(a.prefill_lens):
        print("DONE")
        return
    flags = ([f"--skip-decode {' '.join(map(str, skip_decode))}"] if skip_decode else []) + \
            ([f"--skip-prefill {' '.join(map(str, skip_prefill))}"] if skip_prefill else [])
    print(" ".join(flags))


if __name__ == "__main__":
    main()
