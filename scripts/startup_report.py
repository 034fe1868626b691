"""The markdown of ``scripts/startup.py``'s result: one row per start (cold, warm, package), then
where each start's time goes (the engine's construction phases, ``load_package``'s phases, the
package's first calls, torch.compile's phases). Only the standard library: the parent process of
the starts imports neither torch nor tscompile."""

from __future__ import annotations

from startup_phases import INIT_PHASES, PHASES

TARGETS = {  # the start-up targets on an H200, in seconds
    "cold": "decode ladder compiled and captured in <= 40 s (llama-8b)",
    "warm": "<= 10 s plus weight loading",
    "package": "<= 5 s plus weight loading",
}
START_NAMES = ("cold", "warm", "package")
DECODE_TOKENS = 8  # the fresh prompt's new tokens after the first token (``decode_8_tokens_s``)


def _seconds(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _row(name: str, r: dict) -> str:
    if r.get("error"):
        return f"| {name} | {r['error']} |" + " |" * 9  # the table's other columns, empty
    cells = [r[k] for k in ("total_s", "process_s", "imports_s")] + [r.get("cuda_init_s")]
    cells += [r[k] for k in ("weights_s", "compile_s", "capture_s")] + [r.get("prefill_capture_s"), r["other_s"]]
    return f"| {name} | " + " | ".join(_seconds(v) for v in cells) + f" | {TARGETS[name]} |"


def _measured(result: dict, key: str) -> list[tuple[str, dict]]:
    """The starts that measured ``key`` (an error or an older result has none)."""
    return [(name, r) for name in START_NAMES if key in (r := result["starts"].get(name) or {})]


def _after_first_token_md(result: dict) -> list[str]:
    starts = _measured(result, "second_prefill_s")
    if not starts:
        return []
    r0 = starts[0][1]
    lines = ["", f"The first token beside what follows it in the same process (not in the figures above): a "
                 f"{r0['second_prompt_len']}-token prompt to one token, then a fresh prompt to {DECODE_TOKENS} tokens; "
                 f"seconds all in, with the compile and capture each did (a first call's one-time work is its "
                 f"excess over the second prefill):", "",
             "| start | first token | its compile | its capture | second prefill | its compile | its capture | "
             f"{DECODE_TOKENS} new tokens | their compile | their capture |", "|---" * 10 + "|"]
    keys = ("first_token_s", "first_token_compile_s", "first_token_capture_s", "second_prefill_s",
            "second_prefill_compile_s", "second_prefill_capture_s", "decode_8_tokens_s", "decode_8_compile_s",
            "decode_8_capture_s")
    lines += [f"| {name} | " + " | ".join(_seconds(r.get(k), 2) for k in keys) + " |" for name, r in starts]
    return lines


def _init_phases_md(result: dict) -> list[str]:
    starts = [(name, r) for name, r in _measured(result, "init_phases") if name != "package"]
    if not starts:
        return []
    names = list(dict.fromkeys(n for _, r in starts for n in r["init_phases"]))  # in the order they ran
    head = " | ".join(name for name, _ in starts)
    lines = ["", "Where the engine's \"other\" goes (seconds): the phases of `tscompile.LLM(...)`, each its own time "
                 "(a phase called inside another is named outer/inner and counted once; compile and capture apart), "
                 "then the first token's own run:", "",
             f"| phase | what | {head} |", "|---|---|" + "---|" * len(starts)]
    for n in names:
        cells = " | ".join(_seconds(r["init_phases"].get(n), 2) for _, r in starts)
        lines.append(f"| `{n}` | {INIT_PHASES.get(n.rsplit('/', 1)[-1], '')} | {cells} |")
    rows = (("first token besides its compile and capture", "first_token_other_s"),
            ("unexplained: other minus the rows above", "other_unexplained_s"), ("other", "other_s"),
            ("engine construction, all in (compile and capture included)", "engine_init_s"))
    for what, key in rows:
        lines.append(f"| {what} | | " + " | ".join(_seconds(r.get(key), 2) for _, r in starts) + " |")
    for name, r in starts:
        if r.get("init_imported"):  # imports the construction pays for land in the phase that makes them
            top = ", ".join(f"{root} {count}" for root, count in list(r["init_imported"].items())[:6])
            lines += ["", f"Modules first imported while the {name} engine was built (per package): {top}."]
    return lines


def _first_calls_md(result: dict) -> list[str]:
    package = result["starts"].get("package") or {}
    first = package.get("first_call_phases")
    if not first:
        return []
    second = package.get("second_call_phases") or {}
    lines = ["", "The package's first calls, each waited for on the device (seconds; the prefill program and its "
                 "host metadata run in the first prompt and again in the second, the decode program in the "
                 f"{DECODE_TOKENS}-token call):", "", "| call | first | second |", "|---|---|---|"]
    lines += [f"| {name} | {secs:.3f} | {_seconds(second.get(name), 3)} |" for name, secs in first.items()]
    return lines


def markdown(result: dict) -> str:
    a = result["args"]
    lines = [f"## Start-up: {a['model']} ({result['env']})", "",
             f"max_num_seqs {a['max_num_seqs']}, max_model_len {a['max_model_len']}, a {a['prompt_len']}-token "
             f"prompt to its first token; seconds, each start a fresh process."
             + (" The engine runs without torch.compile (--enforce-eager)." if a.get("enforce_eager") else "")
             + (" The bs=1 decode graph is coordinate-descent tuned (--decode-tuning on)."
                if a.get("decode_tuning") == "on" else "")
             + (f" The engine starts use the decode ladder {tuple(a['decode_ladder'])} (--decode-ladder)."
                if a.get("decode_ladder") else ""),
             "",
             "| start | to first token | process start | imports | CUDA init | weights | compile | capture | "
             "of which prefill | other | target |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [_row(name, result["starts"][name]) for name in START_NAMES if name in result["starts"]]
    export = result.get("export")
    if export and not export.get("error"):
        lines += ["", f"Package exported in {export['export_s']:.1f} s (AOTInductor build {export['build_s']:.1f} s, "
                      f"C++ by {export['compiler'].get('path') or export['compiler'].get('command')})."]
    lines += _after_first_token_md(result)
    lines += _init_phases_md(result)
    phases = (result["starts"].get("package") or {}).get("load_phases")
    if phases:
        lines += ["", "Where `load_package`'s time goes (seconds; nested: programs holds the AOTInductor loaders, "
                      "the host check, the weights inside, the weights file and load_constants):", "",
                  "| phase | seconds |", "|---|---|"]
        lines += [f"| {name} | {secs:.2f} |" for name, secs in phases.items()]
    lines += _first_calls_md(result)
    cold = result["starts"].get("cold") or {}
    if cold.get("compile_phases"):
        warm_phases = (result["starts"].get("warm") or {}).get("compile_phases") or {}
        lines += ["", "Where the compile time goes (torch.compile's own timers, seconds summed over every compile "
                      "of the process; nested, so rows overlap):", "",
                  "| phase | cold | warm |", "|---|---|---|"]
        lines += [f"| {PHASES[name]} (`{name}`) | {secs:.1f} | "
                  + (f"{warm_phases[name]:.1f}" if name in warm_phases else "-") + " |"
                  for name, secs in cold["compile_phases"].items()]
    lines += ["", "CUDA init = `torch.cuda.init()` and a first allocation, before anything else touches the device "
                  "(results before this column had it inside the engine's weights and the package's other).",
              "", "capture = decode and prefill graphs, compiling apart; \"of which prefill\" = the prefill "
                  "graphs (by the first prompt under --prefill-capture lazy, the default; while the engine starts "
                  "under startup, so that the first prompt of each size captures nothing).",
              "", "other = pool sizing and the profiled step (the engine's phases above), the first prefill's own "
                  "run, and for a package its libraries and the first call of its programs (``programs_s`` in "
                  "the JSON: libraries and weights together; weights \"-\": a package with its weights inside "
                  "loads them with its libraries, in one call)."]
    return "\n".join(lines) + "\n"
