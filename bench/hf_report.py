"""Markdown of ``tscompile bench --hf-model`` (bench/hf_model.py): one row per mode, then its counters."""

from __future__ import annotations

from . import report
from .report import _error, _fmt, _table


def _length_cell(entry: dict | None) -> str:
    if not entry:
        return "-"
    return f"{_fmt(entry['ms_median'], '.2f')} ({_fmt(entry['ms_min'], '.2f')}-{_fmt(entry['ms_max'], '.2f')})"


def summary_table(result: dict) -> str:
    lens = [str(n) for n in result["args"]["hf_lens"]]
    header = (["mode"] + [f"{n} tok ms (min-max)" for n in lens]
              + ["first call s", "recompiles after 1st call", "graph breaks", "generate ms/token",
                 "first generate s", "tokens vs eager", "max abs diff logits vs eager", "error"])
    rows = []
    for r in result["rows"]:
        lengths = r.get("lengths") or {}
        after = r.get("counters_after_first_call") or {}
        forward = r.get("counters_forward") or {}
        rows.append([r["mode"]] + [_length_cell(lengths.get(n)) for n in lens] + [
            _fmt(r.get("first_call_s"), ".2f"), _fmt(after.get("recompiles")), _fmt(forward.get("graph_breaks")),
            _fmt(r.get("generate_ms_per_token"), ".3f"), _fmt(r.get("generate_first_call_s"), ".2f"),
            _fmt(r.get("tokens_vs_eager")), _fmt(r.get("max_abs_diff_vs_eager"), ".3g"), _error(r)])
    return _table(header, rows)


def stream_table(result: dict) -> str:
    header = ["mode", "first pass s (compiles and captures in)", "second pass ms/prompt", "graphs recorded",
              "Dynamo graphs", "recompiles", "CUDA memory held GiB", "peak GiB", "error"]
    rows = []
    for r in result["rows"]:
        st = r.get("stream")
        if st is None and not r.get("error"):
            continue
        st = st or {}
        rows.append([r["mode"], _fmt(st.get("first_pass_s"), ".1f"), _fmt(st.get("second_pass_ms_per_prompt"), ".2f"),
                     _fmt(st.get("graphs_recorded")), _fmt(st.get("graphs_compiled")), _fmt(st.get("recompiles")),
                     _fmt(st.get("held_gib"), ".2f"), _fmt(st.get("peak_gib"), ".2f"), _error(r)])
    return _table(header, rows)


COUNTER_COLUMNS = [("graphs (1st call)", "counters_first_call", "graphs_compiled"),
                   ("graphs (all lengths)", "counters_forward", "graphs_compiled"),
                   ("graphs after 1st call", "counters_after_first_call", "graphs_compiled"),
                   ("frames", "counters_forward", "frames_total"),
                   ("cudagraph skips", "counters_forward", "cudagraph_skips"),
                   ("user captures", "counters_forward", "user_captures"),
                   ("user replays", "counters_forward", "user_replays"),
                   ("padded pieces", "counters_forward", "user_padded_pieces"),
                   ("live pieces", "counters_forward", "user_live_pieces"),
                   ("graphs refused", "counters_forward", "user_graphs_refused"),
                   ("generate graphs (1st call)", "counters_generate_first_call", "graphs_compiled"),
                   ("generate recompiles (timed)", "counters_generate_timed", "recompiles")]


def counters_table(result: dict) -> str:
    rows = [[r["mode"]] + [_fmt((r.get(key) or {}).get(name)) for _, key, name in COUNTER_COLUMNS]
            for r in result["rows"]]
    return _table(["mode"] + [title for title, _, _ in COUNTER_COLUMNS], rows)


def markdown(result: dict) -> str:
    env, args = result["env"], result["args"]
    hw = env.get("gpu_name") or env.get("cpu_name")
    head = (f"## tscompile bench --hf-model {result['hf_model']} ({result['model_class']}) on {hw} "
            f"({result['device']}, {result['dtype']})\n\n"
            f"{result['date']} · torch {result['torch_version']} · transformers {result['transformers_version']} · "
            f"triton {env.get('triton_version')} · bs=1 forward, use_cache={args.get('use_cache', False)} · "
            f"iters {args['num_iters']} "
            f"(+{args['hf_warmups']} warm-up) · generate: {args['hf_generate_tokens']} new tokens, static cache, "
            f"greedy, compiled afresh · parts: {', '.join(args.get('hf_parts') or ['forward', 'generate'])}\n")
    if result.get("complete") is False:
        head += "\n**Partial run**: cut short; the rows below are the modes that finished.\n"
    notes = [
        "", "Forward ms: median (fastest-slowest) of the timed calls at each prompt length, after the warm-ups. "
        "First call s: the first call's wall time (Dynamo trace and compile). Recompiles after 1st call: Dynamo "
        "compiles whose cache entry's guards failed, from the second call to the last length (the target is 0). "
        "Generate ms/token: from the first new token to the last, per token (the prompt's forward excluded); "
        "first generate s: the first generate call (it compiles the static-cache graphs). Tokens vs eager: the "
        "greedy tokens against eager's (step 0 = the first new token; random weights have near-ties that "
        "rounding can flip). Max abs diff: the last logits row against eager's, the largest over the lengths.",
        "", "Counters: Dynamo's graphs and frames, Inductor's CUDA-graph skips and tscompile's `user_*` counters "
        "(captures and replays of per-bucket piece graphs, pieces that run padded or at the live rows, graphs "
        "refused) over the forward calls; generate's compiles apart."]
    parts = [head, summary_table(result), "", "### Compiles and graphs", "", counters_table(result), *notes, ""]
    if "stream" in (args.get("hf_parts") or []):
        lo, hi = args["hf_stream_lens"]
        parts += ["### A stream of distinct lengths", "",
                  f"{args['hf_stream_prompts']} bs=1 prompts of distinct lengths from {lo} to {hi}, each once from a "
                  "fresh compile (first pass), then again in reverse order (second pass). Graphs recorded: Inductor's "
                  "CUDA-graph trees' graphs plus tscompile's captures. Memory held: CUDA memory reserved after the "
                  "stream, dead tensors collected and free cached blocks released, less the same before its compile "
                  "(the graphs' pools and what they keep alive); peak: the most reserved during the stream, less the "
                  "same base.", "", stream_table(result), ""]
    blocks = [report.kernel_section(f"{r['mode']} forward {length} tokens", entry["kernel_table"])
              for r in result["rows"] for length, entry in (r.get("lengths") or {}).items()
              if entry.get("kernel_table")]
    if blocks:
        parts += ["### Kernels", "", "Per mode and prompt length, after its timed calls: more bs=1 forwards of the "
                  "same prompt under torch.profiler (`--kernel-table-steps`), per forward; on CUDA the device's "
                  "kernels, graph replays' included.", "", "\n\n".join(blocks), ""]
    return "\n".join(parts)
