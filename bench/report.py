"""Bench output: the JSON file, the markdown tables, and where they are written (the environment
header is ``environment.py``'s, the plot ``plot.py``'s)."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

from . import impls, variants


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def machine_line(result: dict) -> str:
    """Where and when a workload result was measured: the GPU (or CPU), the software, the date."""
    env = result.get("env") or {}
    hw = env.get("gpu_name") or env.get("cpu_name") or result.get("device")
    return (f"{hw} · torch {env.get('torch_version')} · triton {env.get('triton_version')} · "
            f"{result.get('date', 'undated')}")


def write_json(result: dict, path: str | os.PathLike) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)
        f.write("\n")


DEFAULT_OUTPUT_DIR = "bench_out"  # git-ignored: a run leaves the checkout's status clean


def default_output_paths(args, output_dir: str | os.PathLike = DEFAULT_OUTPUT_DIR) -> tuple[Path, Path]:
    """Where a run writes its JSON and markdown when neither ``--output-json`` nor ``--output-md`` is
    given: ``<output_dir>/<model>-<device>-<local time>.json`` and ``.md`` (a model directory by its
    last component), a free name (``-2``, ``-3``, ...) where one run already took it."""
    model = getattr(args, "hf_model", None) or getattr(args, "model", None) or "merge"
    slug = "".join(c if c.isalnum() or c in "-_." else "-" for c in Path(str(model)).name) or "model"
    device = str(getattr(args, "device", None) or "auto").replace(":", "")
    stem = f"{slug}-{device}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    name, n = stem, 1
    while (folder / f"{name}.json").exists() or (folder / f"{name}.md").exists():
        n += 1
        name = f"{stem}-{n}"
    return folder / f"{name}.json", folder / f"{name}.md"


def write_outputs(result: dict, md: str, args) -> None:
    """The run's markdown and JSON where ``--output-md`` / ``--output-json`` ask for them."""
    if args.output_md:
        with open(args.output_md, "w") as f:
            f.write(md + "\n")
    if args.output_json:
        write_json(result, args.output_json)


def error_text(e: BaseException) -> str:
    """One line: the exception, and the backend's own error where torch wraps it (Dynamo's
    ``BackendCompilerFailed`` says only "backend=... raised:" on its first line)."""
    parts, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        parts.append(f"{type(e).__name__}: {first}".strip())
        e = getattr(e, "inner_exception", None) or e.__cause__
    return " <- ".join(parts)


def report_failure(mode: str, where: str, e: BaseException, bar, verbose: bool) -> str:
    """Says on stderr (through the progress bar) that a part of a mode failed; returns the error's line."""
    import sys
    import traceback

    msg = error_text(e)
    bar.write(f"bench: {mode} {where} failed: {msg}", file=sys.stderr)
    if verbose:
        bar.write(traceback.format_exc(), file=sys.stderr)
    return msg


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


def _spread(r: dict, key: str, spec: str) -> str:
    lo, hi = r.get(f"{key}_min"), r.get(f"{key}_max")
    return f"{_fmt(lo, spec)}-{_fmt(hi, spec)}" if lo is not None else "-"


def _error(r: dict) -> str:
    return (r.get("error") or "").replace("|", "/").replace("\n", " ")[:120]


DECODE_HEADER = ["mode", "bs", "TPOT ms (median)", "TPOT min-max", "decode tok/s", "TTFT ms (median)", "TTFT min-max",
                 "peak GiB", "GB/s", "roofline ms", "% roofline", "SM MHz (min), power-capped", "vs f32 reference (req 0)",
                 "error"]


def clocks_cell(r: dict) -> str:
    """The GPU's SM clock while the row's timed runs ran: median (min), and the share of samples the
    power cap held down where any was; "-" where none was sampled (the CPU, an older run)."""
    c = r.get("gpu_clocks")
    if not c:
        return "-"
    cell = f"{c['sm_mhz_median']:.0f} ({c['sm_mhz_min']:.0f})"
    return cell + (f", {100 * c['power_capped_share']:.0f}%" if c.get("power_capped_share") else "")


def decode_table(rows: list[dict]) -> str:
    from .reference import describe

    out = []
    for r in rows:
        median = r.get("tpot_ms_median")
        out.append([
            r["mode"], str(r["batch_size"]), _fmt(median, ".3f"), _spread(r, "tpot_ms", ".3f"),
            _fmt(r["batch_size"] / median * 1e3 if median else None, ".1f"),
            _fmt(r.get("ttft_ms_median"), ".2f"), _spread(r, "ttft_ms", ".2f"),
            _fmt(r.get("peak_memory_gib"), ".2f"), _fmt(r.get("achieved_gbps"), ".1f"),
            _fmt(r.get("roofline_ms"), ".4f"), _fmt(r.get("pct_of_roofline"), ".1f"), clocks_cell(r),
            describe(r.get("reference_check")) if not r.get("error") else "-", _error(r),
        ])
    return _table(DECODE_HEADER, out)


COMPILE_HEADER = ["mode", "setup s", "compile s", "capture s", "dynamo graphs", "recompiles", "graph breaks",
                  "FX cache hit/miss/bypass", "AOT cache hit/miss/bypass", "tscompile graphs", "pieces", "breaks", "captures (decode+prefill)",
                  "error"]


def _fx_cache(st: dict, prefix: str = "fx") -> str:
    """"hits/misses/bypasses" of Inductor's FX graph cache (``prefix`` "aot": AOTAutograd's cache), or
    "-" for a run recorded before the bench counted them."""
    keys = (f"{prefix}_cache_hits", f"{prefix}_cache_misses", f"{prefix}_cache_bypasses")
    return "/".join(str(st[k]) for k in keys) if all(k in st for k in keys) else "-"


def compile_table(modes: dict) -> str:
    out = []
    for mode, info in modes.items():
        st = info.get("compile_stats") or {}
        captures = (st["decode_captures"] + st["prefill_captures"]) if st else None
        out.append([mode, _fmt(info.get("setup_s"), ".1f"), _fmt(info.get("compile_s"), ".2f"),
                    _fmt(info.get("capture_s"), ".2f"), _fmt(st.get("graphs_compiled")), _fmt(st.get("recompiles")),
                    _fmt(st.get("graph_breaks")), _fx_cache(st), _fx_cache(st, "aot"), _fmt(st.get("graphs")), _fmt(st.get("pieces_compiled")),
                    _fmt(st.get("breaks")), _fmt(captures), _error(info)])
    return _table(COMPILE_HEADER, out)


PHASE_COLUMNS = {"frame_s": "frame compile s", "aot_autograd_s": "AOTAutograd s", "inductor_s": "Inductor s",
                 "triton_compile_s": "Triton compile s", "compile_autotune_s": "autotune at compile s",
                 "runtime_autotune_s": "autotune at run s", "cudagraphify_s": "CUDA-graph record s", "gc_s": "GC s"}


def compile_phase_table(modes: dict) -> str:
    """Per mode, the seconds Dynamo's compile records put in each phase (``compile_stats.PHASE_FIELDS``);
    empty when no mode has any (eager only, or a run recorded before the bench kept them)."""
    rows = [(mode, info.get("compile_phases") or {}) for mode, info in modes.items()]
    if not any(phases for _, phases in rows):
        return ""
    return _table(["mode", *PHASE_COLUMNS.values()],
                  [[mode, *(_fmt(phases.get(k), ".2f") for k in PHASE_COLUMNS)] for mode, phases in rows])


def mfu_header(result: dict) -> str:
    peak, source = result.get("peak_tflops"), result.get("peak_tflops_source")
    if result.get("merged_from"):
        return "MFU (of its own run's matmul peak)" if peak else "MFU"
    return f"MFU (of {peak:.4g} TFLOP/s, {source})" if peak else "MFU"


def prefill_table(rows: list[dict], mfu_title: str = "MFU") -> str:
    out = []
    for r in rows:
        mfu = r.get("mfu")
        out.append([r["mode"], str(r["prompt_len"]), _fmt(r.get("prefill_ms"), ".2f"), _spread(r, "prefill_ms", ".2f"),
                    _fmt(r.get("host_launch_ms"), ".3f"), _fmt(r.get("prefill_tokens_per_s"), ".1f"),
                    _fmt(r.get("prefill_tflops"), ".3g"), f"{100 * mfu:.1f}%" if mfu is not None else "-",
                    clocks_cell(r), _error(r)])
    return _table(["mode", "prompt len (bs=1)", "prefill ms (median)", "min-max", "host until launch ms",
                   "prefill tok/s", "TFLOP/s", mfu_title, "SM MHz (min), power-capped", "error"], out)


KERNEL_NAME_CHARS = 100  # cuBLAS and CUTLASS template names run to hundreds of characters; the JSON keeps them


def _kernel_heading(label: str, kt: dict) -> str:
    if kt.get("error"):
        return f"**{label}**: no kernel table ({_error(kt)})"
    bandwidth = (f", {kt['step_gbps']:.1f} GB/s ({kt['step_bytes'] / 1e6:.2f} MB of weights + KV / summed time)"
                 if kt.get("step_gbps") else "")
    return (f"**{label}**: {kt['kernels_per_step']:.0f} {kt['activity']} per step ({kt['distinct']} distinct), "
            f"{kt['kernel_ms_per_step']:.3f} ms summed per step over {kt['steps']} profiled steps{bandwidth}"
            f"{_device_time(kt)}")


def _device_time(kt: dict) -> str:
    """The device timeline's figures of a kernel table, where the run recorded them (CUDA)."""
    if kt.get("device_busy_ms_per_step") is None:
        return ""
    text = f"; the device busy {kt['device_busy_ms_per_step']:.3f} ms per step (overlapping kernels counted once)"
    if kt.get("device_span_ms_per_step") is not None:
        text += (f"; one step's kernels span {kt['device_span_ms_per_step']:.3f} ms on the device, "
                 f"{kt['device_pause_ms_per_step']:.3f} of it pauses between kernels")
    return text


def kernel_section(label: str, kt: dict) -> str:
    """One row's kernel table: the heading line and the top kernels."""
    head = _kernel_heading(label, kt)
    if kt.get("error"):
        return head
    rows = [[k["name"][:KERNEL_NAME_CHARS].replace("|", "/"), _fmt(k["count_per_step"], ".1f"),
             _fmt(k["us_per_step"], ".1f"), _fmt(k["share_pct"], ".1f"), _fmt(k["gbps"], ".1f")] for k in kt["top"]]
    return head + "\n\n" + _table(["kernel" if "cuda" in kt["activity"] else "op", "count/step", "us/step",
                                     "% of step", "GB/s"], rows)


def kernels_markdown(result: dict) -> list[str]:
    """The "Kernels" section (``--kernel-table``): one table per decode and prefill row; [] without tables."""
    blocks = [kernel_section(f"decode {r['mode']} bs={r['batch_size']}", r["kernel_table"])
              for r in result["results"] if r.get("kernel_table")]
    blocks += [kernel_section(f"prefill {r['mode']} {r['prompt_len']} tokens", r["kernel_table"])
               for r in result["prefill"] if r.get("kernel_table")]
    if not blocks:
        return []
    note = ("Per row, after every timed row of its mode: the steps profiled with torch.profiler (decode: steps from the middle "
            "of one more run of the row's batch; prefill: whole bs=1 prefills). On CUDA the device activities "
            "(kernels, copies, graph replays' kernels included); on the CPU the profiler's ops by self time, which "
            "leaves out the Python between them. % of step = share of the summed time. Decode GB/s in the heading "
            "= the roofline's weight + KV bytes / summed kernel time (none for prefill: bound by FLOPs). GB/s per "
            "kernel only for a kernel that is the sole kernel of an aten matmul (mm, addmm, bmm, baddbmm) with "
            "recorded input shapes: its inputs' bytes (read at least once, so a lower bound) / its time; \"-\" "
            "for every other kernel, among them every kernel of a CUDA graph replay and Inductor's fused Triton "
            "kernels, which no aten op with shapes launches. Device busy (CUDA) = the union of the activities' "
            "intervals per step, overlapping ones counted once. Where the profile holds one burst of activities per "
            "step (no pause over 20 us inside a step), a step's span runs from its first activity's start to its "
            "last one's end, and the span less the busy time is the pauses between its kernels; for synchronous "
            "calls the row's wall time less the span is host work. A bs=1 prefill's staging copies and its graph "
            "can fall into separate bursts: then no span, and host until launch plus busy time tell the same.")
    # the kernel choices per engine mode where the run recorded them (a variant's differ), else the run's
    per_mode = {m: i["kernel_paths"] for m, i in result.get("modes", {}).items() if i.get("kernel_paths")}
    per_mode = per_mode or {None: result.get("env", {}).get("kernel_paths", {})}
    pdl_keys = ("decode_pdl", "gemv_pdl", "prefill_pdl")  # gemv_pdl: older runs
    pdl_on = [k for k in pdl_keys if any(p.get(k) for p in per_mode.values())]
    with_pdl = [m for m, p in per_mode.items() if m is not None and any(p.get(k) for k in pdl_keys)]
    if pdl_on:
        where = f" in {', '.join(with_pdl)}" if with_pdl and len(with_pdl) < len(per_mode) else ""
        note += (f" **PDL was on** ({', '.join(pdl_on)}{where}"
                 + "): a kernel launched with it starts before the one before it ends and waits, and the profiler "
                 "counts the wait, so kernel times overlap and their sum exceeds the step; per-kernel figures "
                 "need a run with PDL off (compile_options={\"kernels\": {\"decode_pdl\": False, \"prefill_pdl\": False}}).")
    return ["### Kernels", "", note, "", *[b + "\n" for b in blocks]]


AUTOTUNE_ROWS_PER_MODE = 60  # the markdown's share; the JSON keeps every kernel (bench/autotune_record.py)


def _chosen_text(config: dict | None) -> str:
    if not config:
        return "- (never launched)"
    return ", ".join(f"{k} {v}" for k, v in config.items())


def _how_chosen(k: dict) -> str:
    how = {"hit": "autotune cache hit", "miss": f"benchmarked ({k.get('num_configs') or '?'} candidates)"}
    text = how.get(k.get("cache"), f"autotune cache {k.get('cache') or 'off'}")
    return ("coordinate descent, " if k.get("coordinate_descent") else "") + text


def autotune_markdown(modes: dict) -> list[str]:
    """Per mode, the Triton kernels whose launch configuration Inductor chose at run time and the one
    chosen (the JSON also keeps the single-candidate ones; nothing when no mode has any: on the CPU,
    or where the JSON predates the record)."""
    blocks = []
    for mode, info in modes.items():
        record = info.get("autotuned_kernels") or {}
        kernels = [k for k in record.get("kernels") or [] if k.get("cache") != "only 1 config"]
        if not kernels:
            continue
        rows = [[k["graph"], f"`{k['kernel']}`", _how_chosen(k), _chosen_text(k.get("chosen"))]
                for k in kernels[:AUTOTUNE_ROWS_PER_MODE]]
        more = len(kernels) - len(rows)
        blocks.append(f"**{mode}**: {len(kernels)} kernels" + (f" ({more} more in the JSON)" if more > 0 else "")
                      + "\n\n" + _table(["graph module", "kernel", "how chosen", "chosen config"], rows) + "\n")
    if not blocks:
        return []
    note = ("Kernels with several candidate launch configurations (or coordinate-descent tuning) get theirs "
            "chosen at run time, so two compiles of one graph may run the same code differently; per mode, "
            "the choice each kernel runs with. A cache hit reuses an earlier compile's choice.")
    return ["### Launch configurations chosen at run time", "", note, "", *blocks]


def _reference_line(result: dict) -> str:
    ref = result.get("reference") or {}
    threshold = result["args"].get("margin_threshold")
    if ref.get("skipped") == "hybrid":
        return ("vs f32 reference: not run (the static-cache reference model has no linear-attention layers; "
                "tests/test_qwen3_next.py checks the hybrid model against transformers).")
    if ref.get("skipped"):
        return "vs f32 reference: not run (--no-reference)."
    if ref.get("error"):
        return f"vs f32 reference: the float32 reference failed ({ref['error']}), no row is checked."
    head = (f"vs f32 reference (req 0) = the first request's greedy tokens against a float32 eager run of the same "
            f"weights (the static-cache model, uncompiled); where they differ: the first diverging token (0 = the "
            f"prefill's token) and the reference's top-2 logit margin there. ")
    if result["dtype"] == "float32":
        return head + ("The modes ran in float32 too, so every token must match: a difference is **FAIL** and the "
                       "bench exits non-zero.")
    return head + (f"A small margin is a near-tie that {result['dtype']} rounding may flip; **suspicious** = the mode's "
                   f"token trails the reference's by more than {threshold} logits.")


def _row_times(rows: list[dict], size_key: str, time_key: str) -> dict[tuple[str, int], float]:
    """(row label, batch size or prompt length) -> the row's time, for the rows that have one."""
    return {(r["mode"], r[size_key]): r[time_key] for r in rows if not r.get("error") and r.get(time_key)}


def _impl_label(mode_label: str, impl: str) -> str:
    """The label of ``impl``'s row of the run that gave ``mode_label`` (a variant's suffix kept last)."""
    base, variant = variants.split(mode_label)
    label = impls.label(base, impl)
    return label if variant is None else f"{label}{variants.SEPARATOR}{variant}"


def impl_ratio_markdown(result: dict, impl: str = "transformers") -> list[str]:
    """"transformers backend vs native" (``--model-impl native transformers``, bench/impls.py): per
    engine mode that ran both ways, the transformers rows' median time over the native rows' (decode
    TPOT per batch size, prefill time per prompt length) and the largest ratio; [] when no mode ran
    both ways."""
    decode = _row_times(result["results"], "batch_size", "tpot_ms_median")
    prefill = _row_times(result["prefill"], "prompt_len", "prefill_ms")
    run = result.get("modes_run", [])
    # a kernel variant's native row pairs with the same variant's transformers row (bench/variants.py)
    both_ways = [m for m in run if impls.SEPARATOR not in m and _impl_label(m, impl) in run]
    if not both_ways:
        return []
    sizes = sorted({r["batch_size"] for r in result["results"] if r["mode"] in both_ways})
    lens = sorted({r["prompt_len"] for r in result["prefill"] if r["mode"] in both_ways})
    columns = [(decode, n, f"decode bs={n}") for n in sizes] + [(prefill, n, f"prefill {n}") for n in lens]
    rows, worst = [], None
    for mode in both_ways:
        cells = []
        for times, n, name in columns:
            theirs, native = times.get((_impl_label(mode, impl), n)), times.get((mode, n))
            ratio = theirs / native if theirs and native else None
            cells.append(_fmt(ratio, ".3f"))
            if ratio is not None and (worst is None or ratio > worst[0]):
                worst = (ratio, f"{mode} {name}")
        rows.append([mode, *cells])
    note = (f"The {impl} implementation's time / the native implementation's time on the same weights "
            f"(`<mode>{impls.SEPARATOR}{impl}` rows over `<mode>` rows): median TPOT for decode, median prefill "
            f"time for prefill. Below 1 the {impl} backend is faster; \"-\" where a row of either failed.")
    if worst is None:
        largest = "No row has both times."
    elif worst[0] > 1:
        largest = (f"Largest ratio: {worst[0]:.3f} ({worst[1]}): the {impl} backend is at most "
                   f"{100 * (worst[0] - 1):.1f}% slower than native here.")
    else:
        largest = f"Largest ratio: {worst[0]:.3f} ({worst[1]}): the {impl} backend is nowhere slower than native here."
    return [f"### {impl} backend vs native", "", note, "",
            _table(["mode", *(name for _, _, name in columns)], rows), "", largest, ""]


def markdown(result: dict) -> str:
    env, args = result["env"], result["args"]
    hw = env.get("gpu_name") or env.get("cpu_name")
    peak = result.get("peak_tflops")
    head = (f"## tscompile bench: {result['model']} on {hw} ({env['device']}, {result['dtype']})\n\n"
            f"{result['date']} · torch {env['torch_version']} · triton {env['triton_version']} · "
            f"CUDA {env['cuda_version']} · input {args['input_len']} · output {args['output_len']} · "
            f"iters {args['num_iters']} (+{args['num_iters_warmup']} warm-up) · "
            + (f"{len(result['merged_from'])} runs merged, each with its own copy bandwidth and matmul peak "
               f"(\"Runs merged\" below)" if result.get("merged_from") else
               f"copy bandwidth {result['copy_bandwidth_gbps']:.1f} GB/s"
               + (f" · matmul peak {peak:.4g} TFLOP/s ({result.get('peak_tflops_source')})" if peak else "")) + "\n")
    if args.get("tscompile_options") and not result.get("merged_from"):  # merged: per run, "Runs merged"
        head += f"\ntscompile modes compiled with `{json.dumps(args['tscompile_options'])}` (--tscompile-options).\n"
    if result.get("complete") is False:
        head += "\n**Partial run**: cut short; the rows below are the ones that finished.\n"
    notes = ["", "Every timed figure is the median of the timed iterations, with the fastest and slowest. TPOT = one "
             "iteration's decode-only time / its decode steps; TTFT = submit to every request's first token (for "
             "the static-cache modes: the batched prefill forward); roofline ms = (weights + KV read per step at "
             "the mean decode context) / copy bandwidth; % roofline = roofline / median TPOT.",
             "", _reference_line(result),
             "", "Compile table: Dynamo's graphs compiled, recompiles (compiles whose cache entry's guards failed) "
             "and graph breaks, Inductor's FX graph cache (per graph it compiled: a hit, a miss, or a bypass "
             "that the cache cannot key), AOTAutograd's cache likewise (a miss traces the graph again), and "
             "tscompile's own counters, over the mode's whole run. Static-cache "
             "compile/capture times are the first warm-up run's excess over the steady state; with FX cache hits "
             "they are warm-cache times.",
             "", "MFU = prefill FLOPs (2 x linear weights x tokens, the output projection for the last token, causal "
             "attention 4 x L(L+1)/2 x heads x head_dim per layer) / median prefill time / the matmul peak. "
             "Host until launch (the engine's modes) = median host time from the submit until the step that "
             "launched the prefill returned: the host's work before the device's.",
             "", "SM MHz (CUDA) = the GPU's SM clock sampled by nvidia-smi every 20 ms during the row's timed runs: "
             "median (min), and the share of samples held down by the power cap where any were. Back-to-back "
             "long prefills of a large model can run power-capped: a figure compares with another run's only at "
             "similar clocks."]
    if any(r.get("roofline_note") and r.get("pct_of_roofline") is None for r in result["results"]):
        notes += ["", "% roofline \"-\": the step's bytes stay in cache (on the CPU always, see "
                  "`roofline.roofline_applies`), so the copy-bandwidth roofline does not bound it."]
    gqa = [f"{m}: {i['gqa']} ({i['gqa_why']})" for m, i in result.get("modes", {}).items() if i.get("gqa")]
    if gqa:
        notes += ["", "Static-cache GQA formulation: " + "; ".join(gqa) + "."]
    if not peak:
        notes += ["", "MFU \"-\": no matmul peak (the CPU has none measured; give --peak-tflops to set one)."]
    phases = compile_phase_table(result.get("modes", {}))
    phase_part = ["Compile time by phase, summed over Dynamo's compile records of the mode (as Dynamo "
                  "attributes it: the phases overlap and need not add up; the run-time records hold the "
                  "first calls' autotuning and CUDA-graph recording):", "", phases, ""] if phases else []
    return "\n".join([head, "### Decode", "", decode_table(result["results"]), "",
                      "### Compiles per mode", "", compile_table(result.get("modes", {})), "", *phase_part,
                      "### Prefill", "", prefill_table(result["prefill"], mfu_header(result)), *notes, "",
                      *impl_ratio_markdown(result), *variants.ratio_markdown(result), *kernels_markdown(result),
                      *autotune_markdown(result.get("modes", {}))])
