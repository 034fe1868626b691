"""``tscompile bench --merge A.json B.json ...``: one table from bench runs of the same workload.

A time-limited machine can be too short for every mode of a model (the stock ``torch.compile`` baselines compile
for minutes per batch size), so an all-mode table may come from several runs. Merging is honest only
when the runs measured the same thing on the same kind of machine: the same model, weights seed,
dtype, prompt and output lengths, iterations, page size, GPU (or CPU) model and torch and triton
versions, and float32 references that agree where both ran. Each row must come from one run (a row
measured twice would need a choice the merge cannot make; a mode's rows may come from several runs,
which the markdown names), and every row keeps the copy bandwidth and matmul peak of its own run,
which the markdown lists per run. ``RUN.json:MODE,MODE`` takes only those modes of a run.
"""

from __future__ import annotations

import copy
import json
import os

from . import package_mode, plot, report

# what two runs must share for their rows to sit in one table; args keys, then env keys
SAME_ARGS = ("model", "dtype", "input_len", "output_len", "num_iters", "num_iters_warmup", "seed", "page_size",
             "max_num_batched_tokens", "margin_threshold", "no_reference")
SAME_ENV = ("device", "gpu_name", "cpu_name", "torch_version", "triton_version", "cuda_version")


def split_selection(arg: str) -> tuple[str, list[str] | None]:
    """``RUN.json`` or ``RUN.json:MODE[,MODE]`` (only those modes of that run: say the baselines of a run
    whose own tscompile rows a newer run replaces) -> (path, modes or None)."""
    path, sep, modes = arg.rpartition(":")
    if not sep or not path.endswith(".json") or not modes or modes.endswith(".json"):
        return arg, None
    return path, [m.strip() for m in modes.split(",") if m.strip()]


def select_modes(result: dict, modes: list[str], name: str) -> dict:
    """``result`` with only ``modes``' rows and mode info; ValueError('tscompile: ...') for a mode the run
    does not have."""
    missing = [m for m in modes if m not in result.get("modes_run", [])]
    if missing:
        raise ValueError(f"tscompile: --merge {name!r}: no mode {', '.join(missing)} in that run (it ran "
                         f"{', '.join(result.get('modes_run', [])) or 'none'})")
    kept = copy.copy(result)
    kept["results"] = [r for r in result["results"] if r["mode"] in modes]
    kept["prefill"] = [r for r in result["prefill"] if r["mode"] in modes]
    kept["modes"] = {m: info for m, info in (result.get("modes") or {}).items() if m in modes}
    kept["modes_run"] = [m for m in result["modes_run"] if m in modes]
    return kept


def load(path: str | os.PathLike) -> dict:
    """A bench JSON to merge; ``RUN.json:MODE,MODE`` keeps only those modes (``split_selection``)."""
    path, modes = split_selection(os.fspath(path))
    with open(path) as f:
        result = json.load(f)
    if any(key not in result for key in ("results", "prefill", "args", "env")):
        raise ValueError(f"tscompile: --merge {path!r} is not a `tscompile bench` JSON of the engine "
                         f"modes (no results/prefill/args/env)")
    if "merged_from" in result:
        raise ValueError(f"tscompile: --merge {path!r} is itself a merge; merge the runs it names")
    return result if modes is None else select_modes(result, modes, path)


def check_same(first: dict, other: dict, first_name: str, other_name: str, flag: str = "--merge") -> None:
    """ValueError('tscompile: ...') unless the two runs measured one workload on one kind of machine."""
    checks = [("model_config", first.get("model_config"), other.get("model_config"))]
    checks += [(f"--{k.replace('_', '-')}", first["args"].get(k), other["args"].get(k)) for k in SAME_ARGS]
    checks += [(f"environment {k}", first["env"].get(k), other["env"].get(k)) for k in SAME_ENV]
    for what, a, b in checks:
        if a != b:
            raise ValueError(f"tscompile: {flag} needs runs of one workload on one kind of machine: {what} is "
                             f"{a!r} in {first_name!r} and {b!r} in {other_name!r}")
    print_a = (first.get("reference") or {}).get("weights_fingerprint")
    print_b = (other.get("reference") or {}).get("weights_fingerprint")
    if print_a is not None and print_b is not None and print_a != print_b:
        raise ValueError(f"tscompile: {flag}: the weights of {first_name!r} and {other_name!r} differ "
                         f"(fingerprints {print_a!r} and {print_b!r})")
    ref_a = ((first.get("reference") or {}).get("runs")) or {}
    ref_b = ((other.get("reference") or {}).get("runs")) or {}
    for bs in sorted(set(ref_a) & set(ref_b), key=int):
        if ref_a[bs]["tokens"] != ref_b[bs]["tokens"]:
            raise ValueError(f"tscompile: {flag}: the float32 reference of bs={bs} gives other tokens in "
                             f"{first_name!r} than in {other_name!r}; the runs did not decode the same weights and "
                             f"prompts")


def _row_key(kind: str, row: dict) -> tuple:
    return (kind, row["mode"], row["batch_size"] if kind == "decode" else row["prompt_len"])


def _row_name(key: tuple) -> str:
    kind, mode, size = key
    return f"{mode} bs={size}" if kind == "decode" else f"{mode} prefill {size}"


def _tagged(info: dict, name: str) -> dict:
    """A run's mode info with each recorded kernel naming that run (a merged mode lists the kernels
    of every process that ran it, and two processes' choices are what a reader compares)."""
    record = info.get("autotuned_kernels")
    if not record:
        return info
    kernels = [{**k, "run": os.path.basename(name)} for k in record.get("kernels") or []]
    return {**info, "autotuned_kernels": {**record, "kernels": kernels}}


def _add_mode_info(info: dict | None, other: dict) -> dict:
    """A mode measured over several runs (processes): its Dynamo and tscompile counters summed over them
    (each process compiles its own graphs), its recorded kernel configurations listed from all of them
    (with each run's error or truncation kept), the rest from its first run."""
    if info is None:
        return copy.deepcopy(other)
    merged = copy.deepcopy(info)
    stats, more = merged.get("compile_stats") or {}, other.get("compile_stats") or {}
    merged["compile_stats"] = {k: stats.get(k, 0) + more.get(k, 0) for k in {**stats, **more}}
    merged["recompile_reasons"] = (info.get("recompile_reasons") or []) + (other.get("recompile_reasons") or [])
    if info.get("autotuned_kernels") or other.get("autotuned_kernels"):
        mine, theirs = info.get("autotuned_kernels") or {}, other.get("autotuned_kernels") or {}
        record = {"kernels": (mine.get("kernels") or []) + (theirs.get("kernels") or []),
                  "graphs": mine.get("graphs", 0) + theirs.get("graphs", 0)}
        errors = [e for e in (mine.get("error"), theirs.get("error")) if e]
        if errors:
            record["error"] = "; ".join(errors)
        if mine.get("truncated") or theirs.get("truncated"):
            record["truncated"] = (mine.get("truncated") or len(mine.get("kernels") or [])) + \
                (theirs.get("truncated") or len(theirs.get("kernels") or []))
        merged["autotuned_kernels"] = record
    merged["runs"] = info.get("runs", 1) + 1
    return merged


def _rows_supplied(result: dict, owner: dict) -> bool:
    """Whether every row a cut-short run set out to measure was measured by some run of the merge (a
    resumed run, say): then the merged table is whole although that run was not."""
    args = result["args"]
    sizes = [bs for bs in args.get("batch_size") or [] if bs not in (args.get("skip_decode") or [])]
    lens = [n for n in args.get("prefill_lens") or [] if n not in (args.get("skip_prefill") or [])]
    return all(("decode", mode, bs) in owner for mode in result.get("modes_run", []) for bs in sizes) and \
        all(("prefill", mode, n) in owner for mode in result.get("modes_run", []) for n in lens)


def merge(results: list[dict], names: list[str]) -> dict:
    """The rows of every run in one result, each row from the one run that measured it (a mode's rows
    may come from several runs: say the bs=64 row of a mode whose first run was cut short)."""
    if len(results) < 2:
        raise ValueError(f"tscompile: --merge takes at least two bench JSON files, got {len(results)}")
    for result, name in zip(results[1:], names[1:]):
        check_same(results[0], result, names[0], name)
    owner: dict[tuple, str] = {}  # row key -> the run that measured it
    for result, name in zip(results, names):
        for kind, rows in (("decode", result["results"]), ("prefill", result["prefill"])):
            for row in rows:
                key = _row_key(kind, row)
                if row.get("error"):
                    continue
                if key in owner:
                    raise ValueError(f"tscompile: --merge: {_row_name(key)} was measured in both {owner[key]!r} "
                                     f"and {name!r}; pass each row from one run")
                owner[key] = name
    kept: dict[str, list] = {"decode": [], "prefill": []}
    errors_kept: set[tuple] = set()
    modes_run: list[str] = []
    modes: dict[str, dict] = {}
    run_modes: dict[str, list[str]] = {name: [] for name in names}
    for result, name in zip(results, names):
        for kind, rows in (("decode", result["results"]), ("prefill", result["prefill"])):
            for row in rows:
                key = _row_key(kind, row)
                # an error row stands only where no run measured the row (a refused mode leaves the
                # mode to the run that did measure it), and once
                if owner.get(key) == name or (key not in owner and key not in errors_kept and row.get("error")):
                    if row.get("error"):
                        errors_kept.add(key)
                    kept[kind].append(row)
                if owner.get(key) == name:
                    mode = row["mode"]
                    if mode not in modes_run:
                        modes_run.append(mode)
                    if mode not in run_modes[name]:
                        run_modes[name].append(mode)
                        if mode in result.get("modes", {}):
                            modes[mode] = _add_mode_info(modes.get(mode), _tagged(result["modes"][mode], name))
    for mode, info in modes.items():  # a split mode's compile and capture time: the sum over its kept rows
        if info.get("runs", 1) > 1:
            for key in ("compile_s", "capture_s"):
                vals = [r.get(key) for r in kept["decode"] if r["mode"] == mode and not r.get("error")]
                info[key] = sum(vals) if vals and None not in vals else None
    # a mode's rows together and in size order, whichever runs they came from (a resumed run adds its
    # rows after the first run's)
    for kind in kept:
        kept[kind].sort(key=lambda row: (modes_run.index(row["mode"]) if row["mode"] in modes_run else len(modes_run),
                                         _row_key(kind, row)[2]))
    split = {mode for mode in modes_run if sum(mode in ms for ms in run_modes.values()) > 1}

    def rows_of(name: str, mode: str) -> str:
        decode = [str(k[2]) for k, n in owner.items() if n == name and k[:2] == ("decode", mode)]
        prefill = [str(k[2]) for k, n in owner.items() if n == name and k[:2] == ("prefill", mode)]
        return "; ".join(([f"bs {' '.join(decode)}"] if decode else []) +
                         ([f"prefill {' '.join(prefill)}"] if prefill else []))

    runs = [{"source": name, "date": r.get("date"), "modes": run_modes[name],
             "rows": {m: rows_of(name, m) for m in run_modes[name] if m in split},
             "source_tree": r["env"].get("source_tree"),
             "kernel_paths": r["env"].get("kernel_paths"),
             "tscompile_options": (r.get("args") or {}).get("tscompile_options"),
             "complete": r.get("complete", True), "copy_bandwidth_gbps": r.get("copy_bandwidth_gbps"),
             "peak_tflops": r.get("peak_tflops"), "peak_tflops_source": r.get("peak_tflops_source")}
            for r, name in zip(results, names)]
    first = results[0]
    return {
        **{k: first.get(k) for k in ("model", "model_config", "device", "dtype", "args", "env")},
        "date": max(r.get("date") or "" for r in results),
        "copy_bandwidth_gbps": first.get("copy_bandwidth_gbps"),
        "peak_tflops": first.get("peak_tflops"), "peak_tflops_source": first.get("peak_tflops_source"),
        "modes_run": modes_run, "complete": all(run["complete"] or _rows_supplied(r, owner) for r, run in zip(results, runs)),
        "modes": modes,
        # every run's float32 reference tokens (the check above made the shared batch sizes agree)
        "reference": {**(first.get("reference") or {}),
                      "runs": {bs: ref for r in results for bs, ref in ((r.get("reference") or {}).get("runs")
                                                                         or {}).items()}},
        "results": kept["decode"],
        "prefill": kept["prefill"],
        "merged_from": runs,
    }


def runs_markdown(result: dict) -> str:
    """The merged table's provenance: one line per run with its modes and its own measurements."""
    lines = ["### Runs merged", "",
             "The rows above come from separate bench runs of the same workload on the same kind of machine "
             "(`tscompile bench --merge`); each row from one run. Roofline and MFU of a row use its own run's "
             "copy bandwidth and matmul peak:", ""]
    for run in result["merged_from"]:
        rows = run.get("rows") or {}
        facts = [", ".join(f"{m} ({rows[m]})" if m in rows else m for m in run["modes"]) or "no mode kept"]
        facts.append(f"tscompile tree {run['source_tree']}" if run.get("source_tree") else "tscompile tree unknown")
        if run.get("tscompile_options"):
            facts.append(f"tscompile options `{json.dumps(run['tscompile_options'])}`")
        if run.get("kernel_paths"):  # a run's JSON may lack them: then nothing is said
            facts.append(f"kernel switches `{json.dumps(run['kernel_paths'], sort_keys=True)}`")
        if run.get("copy_bandwidth_gbps"):
            facts.append(f"copy bandwidth {run['copy_bandwidth_gbps']:.1f} GB/s")
        if run.get("peak_tflops"):
            facts.append(f"matmul peak {run['peak_tflops']:.4g} TFLOP/s")
        partial = "" if run["complete"] else ", partial: cut short"
        lines.append(f"- `{os.path.basename(run['source'])}` ({run['date']}{partial}): {'; '.join(facts)}")
    return "\n".join(lines) + "\n"


def run(args) -> int:
    names = list(args.merge)
    result = merge([load(p) for p in names], names)
    md = report.markdown(result) + "\n" + runs_markdown(result)
    section = package_mode.markdown_section(result["modes"])  # a package run says how it ran (graphs or not)
    md += ("\n" + section) if section else ""
    report.write_outputs(result, md, args)
    print(md)
    if args.plot:
        plot.plot(result, args.plot)
    return 0
