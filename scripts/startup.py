"""Start-up time of one model, to its first token: cold, warm and from a package.

    python scripts/startup.py --model llama-1b --output-json startup.json --output-md startup.md

Each start runs in a fresh Python process (imports included), timed from the moment the parent
spawns it:
  cold     tscompile.LLM with empty compiler caches (TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR in
           a new temporary folder)
  warm     the same again, on the caches the cold start filled
  package  tscompile.load_package of a package (--package, or one exported here first) and one token
Each is split into imports, weight loading, compilation, graph capture and the rest (for the engine:
pool sizing and the first prefill's own run; for a package: reading its libraries and the first
call of its programs). The engine figures come from the runner's own compile and capture counters
(``LLM.compile_seconds``, ``LLM.capture_seconds``); capture includes the prefill graphs, captured
by the first prompt (``--prefill-capture lazy``, the engine's default) or while the engine starts
(``--prefill-capture startup``),
and its prefill part is reported apart (``prefill_capture_s``, ``init_prefill_capture_s``); a package
compiles and captures nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

_MARK = "STARTUP_JSON "
TARGETS = {  # the start-up targets on an H200 (the project's issue 16), in seconds
    "cold": "decode ladder compiled and captured in <= 40 s (llama-8b)",
    "warm": "<= 10 s plus weight loading",
    "package": "<= 5 s plus weight loading",
}


# -- the children ----------------------------------------------------------------------------------
def _since_spawn() -> float:
    return time.time() - float(os.environ["STARTUP_SPAWNED_AT"])


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _child_engine(args) -> dict:
    started = _since_spawn()
    t0 = time.perf_counter()
    import torch

    import tscompile
    from tscompile.cli import show_tscompile_logs
    from tscompile.models import load_model
    from tscompile.utils import resolve_dtype

    show_tscompile_logs()
    imports = time.perf_counter() - t0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    t0 = time.perf_counter()
    model, _ = load_model(args.model, dtype=resolve_dtype(args.dtype, device), device=device,
                          seed=0, max_model_len=args.max_model_len)
    _sync(device)
    weights = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm = tscompile.LLM(model, device=device, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                        compile_options={"prefill_capture": args.prefill_capture})
    engine = time.perf_counter() - t0
    compile_init, capture_init = llm.compile_seconds, llm.capture_seconds
    prefill_capture_init = llm.prefill_capture_seconds
    t0 = time.perf_counter()
    llm.generate([list(range(1, args.prompt_len + 1))], tscompile.SamplingParams(max_new_tokens=1))
    _sync(device)
    first = time.perf_counter() - t0
    compile_s, capture_s, prefill_capture_s = llm.compile_seconds, llm.capture_seconds, llm.prefill_capture_seconds
    total = _since_spawn()
    return {"total_s": total, "process_s": started, "imports_s": imports, "weights_s": weights,
            "compile_s": compile_s, "capture_s": capture_s, "prefill_capture_s": prefill_capture_s,
            "other_s": total - started - imports - weights - compile_s - capture_s,
            "engine_init_s": engine, "init_compile_s": compile_init, "init_capture_s": capture_init,
            "init_prefill_capture_s": prefill_capture_init,
            "first_token_s": first, "decode_ladder": list(getattr(llm.runner.decode_graphs, "ladder", []) or []),
            "compile_phases": _compile_phases()}


# the phases of torch.compile's own timers that say where a compile's time goes (nested: Dynamo's
# _compile.compile_inner holds the rest); each is the sum over every compile of the process
PHASES = {
    "_compile.compile_inner": "Dynamo, all in (tracing plus the backend)",
    "bytecode_tracing": "Dynamo tracing",
    "OutputGraph.call_user_compiler": "backend (tscompile's split, pieces, Inductor)",
    "create_aot_dispatcher_function": "AOTAutograd (joint trace, decompositions, Inductor inside)",
    "compile_fx_inner": "Inductor, per graph",
    "GraphLowering.codegen": "Inductor scheduling and code generation",
    "async_compile.wait": "waiting for Triton's kernel compiles",
    "PyCodeCache.load_by_key_path": "loading generated modules (kernel compiles on a cold cache)",
    "CachingAutotuner.benchmark_all_configs": "autotuning (benchmarking configs)",
    "coordinate_descent_tuning": "coordinate-descent tuning",
    "build_guards": "Dynamo guards",
}


def _compile_phases() -> dict:
    """Seconds per compile phase (PHASES, as torch's compile timers name them in this version; a phase
    it does not time is left out), from ``torch._dynamo.utils.compilation_time_metrics``."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return {}
    totals = {name: sum(values) for name, values in compilation_time_metrics.items() if values}
    return {name: round(totals[name], 3) for name in PHASES if name in totals}


def _child_package(args) -> dict:
    started = _since_spawn()
    t0 = time.perf_counter()
    import safetensors.torch
    import torch

    import tscompile
    from tscompile.cli import show_tscompile_logs
    from tscompile.package import runtime

    show_tscompile_logs()
    imports = time.perf_counter() - t0
    from tscompile.package import aoti_load

    # load_package's phases, each summed over its calls (nested: "programs" holds the AOTInductor
    # loaders, the host check, the weights stored inside, the external weights file and its
    # constants; "aoti_loaders" is torch's own loader per program: extraction and dlopen)
    spent = dict.fromkeys(("metadata_and_integrity", "cxx_runtime_check", "programs", "aoti_loaders", "host_check",
                           "archive_weights", "weights_file", "load_constants", "engine", "tokenizer"), 0.0)

    def timed(name, fn):
        def wrapper(*a, **kw):
            begin = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - begin
        return wrapper

    runtime.read_package_metadata = timed("metadata_and_integrity", runtime.read_package_metadata)
    runtime.refuse_unlinked_cxx_runtime = timed("cxx_runtime_check", runtime.refuse_unlinked_cxx_runtime)
    runtime._load_programs = timed("programs", runtime._load_programs)
    torch._C._aoti.AOTIModelPackageLoader = timed("aoti_loaders", torch._C._aoti.AOTIModelPackageLoader)
    aoti_load.host_mismatches = timed("host_check", aoti_load.host_mismatches)
    aoti_load._archive_weights = timed("archive_weights", aoti_load._archive_weights)
    safetensors.torch.load_file = timed("weights_file", safetensors.torch.load_file)
    aoti_load.PackagedProgram.load_constants = timed("load_constants", aoti_load.PackagedProgram.load_constants)
    runtime._package_engine = timed("engine", runtime._package_engine)
    runtime._package_tokenizer = timed("tokenizer", runtime._package_tokenizer)
    t0 = time.perf_counter()
    llm = tscompile.load_package(args.package)
    load = time.perf_counter() - t0
    device = llm.device
    t0 = time.perf_counter()
    llm.generate([list(range(1, args.prompt_len + 1))], tscompile.SamplingParams(max_new_tokens=1))
    _sync(device)
    first = time.perf_counter() - t0
    total = _since_spawn()
    external = llm.package.record["weights"] == "external"
    # weights inside the archive load with the libraries, in one call: no split (None), in "other"
    weights = spent["weights_file"] if external else None
    return {"total_s": total, "process_s": started, "imports_s": imports, "weights_s": weights,
            "compile_s": 0.0, "capture_s": 0.0, "prefill_capture_s": 0.0,
            "other_s": total - started - imports - (weights or 0.0),
            "load_package_s": load, "programs_s": spent["programs"], "first_token_s": first,
            "load_phases": {name: round(secs, 3) for name, secs in spent.items()},
            "weights": llm.package.record["weights"], "package_bytes": llm.package.package_bytes,
            "device": str(device), "torch_threads": torch.get_num_threads()}


def _child_export(args) -> dict:
    import tscompile.export
    from tscompile.cli import show_tscompile_logs

    show_tscompile_logs()
    t0 = time.perf_counter()
    record = tscompile.export.export_package(args.model, args.package, device=args.device, dtype=args.dtype,
                                             max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                                             weights=args.weights)
    return {"export_s": time.perf_counter() - t0, "build_s": record["build_seconds"], "compiler": record["compiler"]}


CHILDREN = {"engine": _child_engine, "package": _child_package, "export": _child_export}


# -- the parent ------------------------------------------------------------------------------------
def _spawn(kind: str, args, env: dict) -> dict:
    argv = [sys.executable, os.path.abspath(__file__), "--child", kind, "--model", args.model,
            "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
            "--prompt-len", str(args.prompt_len), "--weights", args.weights,
            "--prefill-capture", args.prefill_capture]
    for flag in ("device", "dtype", "package"):
        if getattr(args, flag):
            argv += [f"--{flag}", str(getattr(args, flag))]
    env = {**env, "STARTUP_SPAWNED_AT": repr(time.time())}
    print(f"== {kind}", file=sys.stderr, flush=True)
    run = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True)  # stderr (logs, bars) passes through
    lines = [line for line in run.stdout.splitlines() if line.startswith(_MARK)]
    if run.returncode != 0 or not lines:
        return {"error": f"the {kind} process exited with {run.returncode}"}
    return json.loads(lines[-1][len(_MARK):])


def _row(name: str, r: dict) -> str:
    if r.get("error"):
        return f"| {name} | {r['error']} | | | | | | | |"
    cells = [r[k] for k in ("total_s", "process_s", "imports_s", "weights_s", "compile_s", "capture_s")]
    cells += [r.get("prefill_capture_s"), r["other_s"]]
    return f"| {name} | " + " | ".join("-" if v is None else f"{v:.1f}" for v in cells) + f" | {TARGETS[name]} |"


def markdown(result: dict) -> str:
    a = result["args"]
    lines = [f"## Start-up: {a['model']} ({result['env']})", "",
             f"max_num_seqs {a['max_num_seqs']}, max_model_len {a['max_model_len']}, a {a['prompt_len']}-token "
             f"prompt to its first token; seconds, each start a fresh process.", "",
             "| start | to first token | process start | imports | weights | compile | capture | of which prefill | "
             "other | target |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [_row(name, result["starts"][name]) for name in ("cold", "warm", "package") if name in result["starts"]]
    export = result.get("export")
    if export and not export.get("error"):
        lines += ["", f"Package exported in {export['export_s']:.1f} s (AOTInductor build {export['build_s']:.1f} s, "
                      f"C++ by {export['compiler'].get('path') or export['compiler'].get('command')})."]
    phases = (result["starts"].get("package") or {}).get("load_phases")
    if phases:
        lines += ["", "Where `load_package`'s time goes (seconds; nested: programs holds the AOTInductor loaders, "
                      "the host check, the weights inside, the weights file and load_constants):", "",
                  "| phase | seconds |", "|---|---|"]
        lines += [f"| {name} | {secs:.2f} |" for name, secs in phases.items()]
    cold = result["starts"].get("cold") or {}
    if cold.get("compile_phases"):
        warm_phases = (result["starts"].get("warm") or {}).get("compile_phases") or {}
        lines += ["", "Where the compile time goes (torch.compile's own timers, seconds summed over every compile "
                      "of the process; nested, so rows overlap):", "",
                  "| phase | cold | warm |", "|---|---|---|"]
        lines += [f"| {PHASES[name]} (`{name}`) | {secs:.1f} | "
                  + (f"{warm_phases[name]:.1f}" if name in warm_phases else "-") + " |"
                  for name, secs in cold["compile_phases"].items()]
    lines += ["", "capture = decode and prefill graphs, compiling apart; \"of which prefill\" = the prefill "
                  "graphs (by the first prompt under --prefill-capture lazy, the default; while the engine starts "
                  "under startup, so that the first prompt of each size captures nothing).",
              "", "other = pool sizing and the profiled step, the first prefill's own run, and for a package its "
                  "libraries and the first call of its programs (``programs_s`` in the JSON: libraries and "
                  "weights together; weights \"-\": a package with its weights inside loads them with its "
                  "libraries, in one call)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--max-num-seqs", type=int, default=128, help="128: the whole default decode ladder")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--prefill-capture", default="lazy", choices=("lazy", "startup"),
                   help="when the engine captures its prefill graphs (compile option prefill_capture)")
    p.add_argument("--package", default=None, help="measure this package (default: export one first)")
    p.add_argument("--keep-package", default=None, metavar="PATH.pt2",
                   help="export the package here and keep it (for `tscompile bench --package`)")
    p.add_argument("--weights", default="external", choices=("inside", "external"), help="of the exported package")
    p.add_argument("--skip", nargs="*", default=[], choices=("cold", "warm", "package"))
    p.add_argument("--output-json", default=None)
    p.add_argument("--output-md", default=None)
    p.add_argument("--child", default=None, choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(_MARK + json.dumps(CHILDREN[args.child](args)), flush=True)
        return 0

    # the environment line is read at the end: CUDA in this process would take memory from the starts
    result = {"args": vars(args), "starts": {}, "env": "environment read at the end"}
    with tempfile.TemporaryDirectory(prefix="tscompile_startup_") as tmp:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor"),
               "TRITON_CACHE_DIR": os.path.join(tmp, "triton")}
        for name in ("cold", "warm"):  # warm: the caches the cold start just filled
            if name not in args.skip:
                result["starts"][name] = _spawn("engine", args, env)
                _write(result, args)  # after every start: a deadline keeps what was measured
        if "package" not in args.skip:
            if args.package is None:
                args.package = args.keep_package or os.path.join(tmp, "startup.pt2")
                result["export"] = _spawn("export", args, env)
            if not result.get("export", {}).get("error"):
                result["starts"]["package"] = _spawn("package", args, env)
            if args.package.startswith(tmp):
                args.package = None  # gone with the folder
    result["env"] = _environment(args.device)
    print(_write(result, args))
    return 0 if all(not r.get("error") for r in result["starts"].values()) else 1


def _write(result: dict, args) -> str:
    md = markdown(result)
    if args.output_md:
        with open(args.output_md, "w") as f:
            f.write(md)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return md


def _environment(device: str | None) -> str:
    import torch

    if (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda"):
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    return f"cpu, torch {torch.__version__}"


if __name__ == "__main__":
    sys.exit(main())
