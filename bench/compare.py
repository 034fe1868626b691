"""``tscompile bench --compare BEFORE.json AFTER.json``: is a change within a tolerance of the run before it?

Two runs of one workload on one kind of machine (the checks of ``--merge``), typically the same
command on the commit before a change and on the commit after, back to back on one machine. Per
row both runs measured: the decode TPOT median (per mode and batch size) or the prefill median (per
mode and prompt length), their ratio after / before, and for a decode row whether the first
request's greedy tokens are the same, with where each run's first request leaves the float32
reference (``reference_check``; in bf16 on random weights a near tie can flip a token, so two runs
that leave the reference at the same token with the same pick read differently from a run that leaves
it early). The exit status is 1 when a row is slower than ``--compare-tolerance`` allows or its tokens
changed, else 0; a row faster by more than the tolerance is marked, not failed.
"""

from __future__ import annotations

import os

from . import merge, report

DEFAULT_TOLERANCE = 0.03


def _rows(result: dict) -> dict[tuple, dict]:
    rows = {("decode", r["mode"], r["batch_size"]): r for r in result.get("results", []) if not r.get("error")}
    rows.update({("prefill", r["mode"], r["prompt_len"]): r for r in result.get("prefill", []) if not r.get("error")})
    return rows


def _time(kind: str, row: dict) -> float | None:
    return row.get("tpot_ms_median") if kind == "decode" else row.get("prefill_ms")


def _leaves_reference(row: dict) -> str | None:
    """Where the row's first request leaves the float32 reference: "agrees", "token T (margin M)",
    or None where the run has no check."""
    check = row.get("reference_check")
    if not check or "agrees" not in check:
        return None
    if check["agrees"]:
        return "agrees"
    return f"token {check['first_divergence']} (margin {check['margin']:.3g})"


def compare(before: dict, after: dict, tolerance: float = DEFAULT_TOLERANCE) -> list[dict]:
    """One entry per row both runs measured: key, before_ms, after_ms, ratio, verdict ("within",
    "slower", "faster"), tokens_equal (decode rows; None where a run did not record tokens) and
    reference_before / reference_after (``_leaves_reference``)."""
    if not 0 < tolerance < 1:
        raise ValueError(f"tscompile: --compare-tolerance {tolerance} is not a fraction in (0, 1); pass e.g. 0.03")
    rows_a, rows_b = _rows(before), _rows(after)
    out = []
    for key in sorted(set(rows_a) & set(rows_b), key=lambda k: (k[0] != "decode", k[1], k[2])):
        a, b = _time(key[0], rows_a[key]), _time(key[0], rows_b[key])
        if a is None or b is None:
            continue
        ratio = b / a
        verdict = "slower" if ratio > 1 + tolerance else "faster" if ratio < 1 - tolerance else "within"
        tokens_a, tokens_b = rows_a[key].get("tokens_req0"), rows_b[key].get("tokens_req0")
        same = None if key[0] != "decode" or tokens_a is None or tokens_b is None else tokens_a == tokens_b
        out.append({"key": key, "before_ms": a, "after_ms": b, "ratio": ratio, "verdict": verdict,
                    "tokens_equal": same, "reference_before": _leaves_reference(rows_a[key]),
                    "reference_after": _leaves_reference(rows_b[key])})
    return out


def markdown(rows: list[dict], before_name: str, after_name: str, tolerance: float) -> str:
    lines = [f"## `{os.path.basename(after_name)}` against `{os.path.basename(before_name)}` "
             f"(tolerance {tolerance:.0%})", "",
             "| row | before ms | after ms | after / before | verdict | first request's tokens | "
             "vs f32 reference, before | after |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kind, mode, size = r["key"]
        name = f"{mode} decode bs {size}" if kind == "decode" else f"{mode} prefill {size} tokens"
        tokens = "-" if r["tokens_equal"] is None else "same" if r["tokens_equal"] else "**changed**"
        verdict = f"**{r['verdict']}**" if r["verdict"] == "slower" else r["verdict"]
        lines.append(f"| {name} | {r['before_ms']:.4g} | {r['after_ms']:.4g} | {r['ratio']:.3f} | {verdict} | "
                     f"{tokens} | {r['reference_before'] or '-'} | {r['reference_after'] or '-'} |")
    return "\n".join(lines) + "\n"


def run(args) -> int:
    before_name, after_name = args.compare
    before, after = merge.load(before_name), merge.load(after_name)
    merge.check_same(before, after, before_name, after_name, flag="--compare")
    rows = compare(before, after, args.compare_tolerance)
    if not rows:
        raise ValueError(f"tscompile: --compare: {before_name!r} and {after_name!r} have no row in common")
    md = markdown(rows, before_name, after_name, args.compare_tolerance)
    result = {"compare": {"before": before_name, "after": after_name, "tolerance": args.compare_tolerance,
                          "rows": [{**r, "key": list(r["key"])} for r in rows]}}
    report.write_outputs(result, md, args)
    print(md)
    return int(any(r["verdict"] == "slower" or r["tokens_equal"] is False for r in rows))
