"""Start-up time of one model, to its first token: cold, warm and from a package.

    python scripts/startup.py --model llama-1b --output-json startup.json --output-md startup.md

Each start runs in a fresh Python process (imports included), timed from the moment the parent
spawns it:
  cold     tscompile.LLM with empty compiler caches (TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR in
           a new temporary folder)
  warm     the same again, on the caches the cold start filled
  package  tscompile.load_package of a package (--package, or one exported here first) and one token
Each is split into imports, CUDA initialisation (``torch.cuda.init()`` and a first allocation, timed
before anything else touches the device), weight loading, compilation, graph capture and the rest
(for the engine: pool sizing and the first prefill's own run; for a package: reading its libraries
and the first call of its programs).

The rest is explained further. The engine's construction is split into the phases of what
``tscompile.LLM(...)`` calls (``init_phases``, INIT_PHASES: each call's own time, compile and capture
apart), and what neither they nor the first generate's own run explain is ``other_unexplained_s``.
After the first token (outside the start's figures), each start runs a prompt of another length to
one token (``second_prefill_s``) and a fresh prompt to 8 tokens (``decode_8_tokens_s``), so a first
call's one-time work stands apart; a package also times the first and second call of each of its
programs (``first_call_phases``, ``second_call_phases``). ``--enforce-eager`` measures an engine
start without torch.compile: the rest alone.

The engine figures come from the runner's own compile and capture counters
(``LLM.compile_seconds``, ``LLM.capture_seconds``); capture includes the prefill graphs, captured
by the first prompt (``--prefill-capture lazy``, the engine's default) or while the engine starts
(``--prefill-capture startup``), and its prefill part is reported apart (``prefill_capture_s``,
``init_prefill_capture_s``); a package compiles and captures nothing.

The phase timers are ``startup_phases.py``'s, the markdown ``startup_report.py``'s (beside this file).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from startup_phases import PhaseTimer, compile_phases, time_engine_construction
from startup_report import DECODE_TOKENS, START_NAMES, markdown

_MARK = "STARTUP_JSON "


# -- the children ----------------------------------------------------------------------------------
def _since_spawn() -> float:
    return time.time() - float(os.environ["STARTUP_SPAWNED_AT"])


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _cuda_init(device) -> float | None:
    """Seconds to initialise CUDA and make this process's context (``torch.cuda.init()`` and a first
    allocation), done before anything else touches the device so that no later phase pays for it;
    None off CUDA."""
    import torch

    if device.type != "cuda":
        return None
    t0 = time.perf_counter()
    torch.cuda.init()
    torch.empty(1, device=device)
    torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _prompt(length: int, first: int, vocab_size: int) -> list[int]:
    """``length`` token ids from ``first`` on (wrapping inside the vocabulary, id 0 left out): prompts
    that share no prefix with another ``first``."""
    return [(first + i - 1) % (vocab_size - 1) + 1 for i in range(length)]


def _generate(llm, device, prompt: list[int], new_tokens: int) -> tuple[float, float, float]:
    """Seconds of one ``llm.generate`` to its last token, and the compile and capture seconds it added."""
    import tscompile

    compiled, captured = llm.compile_seconds, llm.capture_seconds
    t0 = time.perf_counter()
    llm.generate([prompt], tscompile.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    _sync(device)
    return time.perf_counter() - t0, llm.compile_seconds - compiled, llm.capture_seconds - captured


SECOND_PROMPT_EXTRA = 7  # the second prompt's length past --prompt-len: another size than the first


def _after_first_token(llm, device, prompt_len: int) -> dict:
    """What follows the first token (outside the start's total): a prompt of another length to one
    token, then a fresh prompt to ``DECODE_TOKENS`` tokens; each all in, its compile and capture apart."""
    vocab = llm.config.vocab_size
    second = _generate(llm, device, _prompt(prompt_len + SECOND_PROMPT_EXTRA, 1000, vocab), 1)
    decode = _generate(llm, device, _prompt(prompt_len, 2000, vocab), DECODE_TOKENS)
    return {"second_prompt_len": prompt_len + SECOND_PROMPT_EXTRA,
            "second_prefill_s": second[0], "second_prefill_compile_s": second[1],
            "second_prefill_capture_s": second[2],
            "decode_8_tokens_s": decode[0], "decode_8_compile_s": decode[1], "decode_8_capture_s": decode[2]}


def _new_module_roots(before: set) -> dict:
    """Modules first imported since ``before``, counted per package (two name levels: torch._inductor)."""
    roots: dict[str, int] = {}
    for name in set(sys.modules) - before:
        root = ".".join(name.split(".")[:2])
        roots[root] = roots.get(root, 0) + 1
    return dict(sorted(roots.items(), key=lambda kv: -kv[1])[:12])


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
    cuda_init = _cuda_init(device)
    t0 = time.perf_counter()
    model, _ = load_model(args.model, dtype=resolve_dtype(args.dtype, device), device=device,
                          seed=0, max_model_len=args.max_model_len)
    _sync(device)
    weights = time.perf_counter() - t0
    timer = PhaseTimer()
    time_engine_construction(timer)
    modules_before = set(sys.modules)
    t0 = time.perf_counter()
    llm = tscompile.LLM(model, device=device, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                        enforce_eager=args.enforce_eager,
                        compile_options=None if args.enforce_eager else compile_options(args))
    engine = time.perf_counter() - t0
    init_imported = _new_module_roots(modules_before)
    compile_init, capture_init = llm.compile_seconds, llm.capture_seconds
    prefill_capture_init = llm.prefill_capture_seconds
    first, first_compile, first_capture = _generate(llm, device, _prompt(args.prompt_len, 1, llm.config.vocab_size), 1)
    compile_s, capture_s, prefill_capture_s = llm.compile_seconds, llm.capture_seconds, llm.prefill_capture_seconds
    total = _since_spawn()
    phases = compile_phases()  # the start's compiles, not those of the prompts after it
    after = _after_first_token(llm, device, args.prompt_len)
    other = total - started - imports - (cuda_init or 0.0) - weights - compile_s - capture_s
    # other holds the construction's phases (compile and capture apart) and the first generate's own
    # run; what neither explains is the unexplained rest (process gaps, LLM.__init__'s own lines)
    first_token_other = first - first_compile - first_capture
    return {"total_s": total, "process_s": started, "imports_s": imports, "cuda_init_s": cuda_init,
            "weights_s": weights, "compile_s": compile_s, "capture_s": capture_s,
            "prefill_capture_s": prefill_capture_s, "other_s": other,
            "other_unexplained_s": other - sum(timer.spent.values()) - first_token_other,
            "engine_init_s": engine, "init_compile_s": compile_init, "init_capture_s": capture_init,
            "init_prefill_capture_s": prefill_capture_init,
            "init_phases": {name: round(secs, 4) for name, secs in timer.spent.items()},
            "init_imported": init_imported,
            "first_token_s": first, "first_token_compile_s": first_compile, "first_token_capture_s": first_capture,
            "first_token_other_s": first_token_other, **after,
            "enforce_eager": args.enforce_eager,
            "decode_ladder": list(getattr(llm.runner.graphs, "decode_ladder", []) or []),
            "compile_phases": phases}


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
    # the programs' first and second calls, each waited for (a first call's one-time work shows as its
    # excess over the second): the prefill and decode programs and the prefill's host metadata
    calls: dict[str, list[float]] = {}

    def first_calls(name, fn):
        def wrapper(*a, **kw):
            key = name(*a) if callable(name) else name if name else a[0].name  # a program: its own name
            if len(calls.setdefault(key, [])) >= 2:
                return fn(*a, **kw)
            _sync_any()
            begin = time.perf_counter()
            out = fn(*a, **kw)
            _sync_any()
            calls[key].append(time.perf_counter() - begin)
            return out
        return wrapper

    from tscompile.attention.router import AttentionRouter

    aoti_load.PackagedProgram.__call__ = first_calls(None, aoti_load.PackagedProgram.__call__)
    AttentionRouter.init_forward_metadata = first_calls("prefill_metadata", AttentionRouter.init_forward_metadata)
    # the attention kernels the programs call back into (a Python custom op), per impl and kind: a
    # first layer's excess over the second is the kernel's one-time loading (Triton's JIT and launcher)
    from tscompile.custom_ops import attention as attention_ops

    # (the op's body looks run_attention up at each call; an impl module may register only once the
    # package names its backend, so the impls themselves cannot be wrapped here)
    attention_ops.run_attention = first_calls(
        lambda *a: f"attention_{a[12]}_{'decode' if a[11] else 'extend'}", attention_ops.run_attention)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda_init = _cuda_init(device)
    t0 = time.perf_counter()
    llm = tscompile.load_package(args.package)
    load = time.perf_counter() - t0
    device = llm.device
    first = _generate(llm, device, _prompt(args.prompt_len, 1, llm.config.vocab_size), 1)[0]
    total = _since_spawn()
    after = _after_first_token(llm, device, args.prompt_len)
    external = llm.package.record["weights"] == "external"
    # weights inside the archive load with the libraries, in one call: no split (None), in "other"
    weights = spent["weights_file"] if external else None
    return {"total_s": total, "process_s": started, "imports_s": imports, "cuda_init_s": cuda_init,
            "weights_s": weights, "compile_s": 0.0, "capture_s": 0.0, "prefill_capture_s": 0.0,
            "other_s": total - started - imports - (cuda_init or 0.0) - (weights or 0.0),
            "load_package_s": load, "programs_s": spent["programs"], "first_token_s": first,
            "first_token_compile_s": 0.0, "first_token_capture_s": 0.0, **after,
            "first_call_phases": {name: round(secs[0], 4) for name, secs in calls.items()},
            "second_call_phases": {name: round(secs[1], 4) for name, secs in calls.items() if len(secs) > 1},
            "load_phases": {name: round(secs, 3) for name, secs in spent.items()},
            "weights": llm.package.record["weights"], "package_bytes": llm.package.package_bytes,
            "device": str(device), "torch_threads": torch.get_num_threads()}


def _sync_any() -> None:
    """Wait for the device when this process uses CUDA (a package's device is known only once loaded)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _child_export(args) -> dict:
    import tscompile.export
    from tscompile.cli import show_tscompile_logs

    show_tscompile_logs()
    t0 = time.perf_counter()
    record = tscompile.export.export_package(args.model, args.package, device=args.device, dtype=args.dtype,
                                             max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                                             weights=args.weights)
    return {"export_s": time.perf_counter() - t0, "build_s": record["build_seconds"], "compiler": record["compiler"]}


def compile_options(args) -> dict:
    options = {"prefill_capture": args.prefill_capture}
    if args.decode_tuning == "on":  # the bs=1 decode graph with coordinate-descent tuning (its cost)
        options["static_inductor_options"] = {"coordinate_descent_tuning": True}
    if args.decode_ladder:
        options["decode_ladder"] = tuple(args.decode_ladder)
    return options


CHILDREN = {"engine": _child_engine, "package": _child_package, "export": _child_export}


# -- the parent ------------------------------------------------------------------------------------
def _spawn(kind: str, args, env: dict) -> dict:
    argv = [sys.executable, os.path.abspath(__file__), "--child", kind, "--model", args.model,
            "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
            "--prompt-len", str(args.prompt_len), "--weights", args.weights,
            "--prefill-capture", args.prefill_capture, "--decode-tuning", args.decode_tuning]
    for flag in ("device", "dtype", "package"):
        if getattr(args, flag):
            argv += [f"--{flag}", str(getattr(args, flag))]
    if args.enforce_eager:
        argv.append("--enforce-eager")
    if args.decode_ladder:
        argv += ["--decode-ladder", *map(str, args.decode_ladder)]
    env = {**env, "STARTUP_SPAWNED_AT": repr(time.time())}
    print(f"== {kind}", file=sys.stderr, flush=True)
    run = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True)  # stderr (logs, bars) passes through
    lines = [line for line in run.stdout.splitlines() if line.startswith(_MARK)]
    if run.returncode != 0 or not lines:
        return {"error": f"the {kind} process exited with {run.returncode}"}
    return json.loads(lines[-1][len(_MARK):])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--max-num-seqs", type=int, default=128, help="128: the whole default decode ladder")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--prefill-capture", default="lazy", choices=("lazy", "startup"),
                   help="when the engine captures its prefill graphs (compile option prefill_capture)")
    p.add_argument("--decode-tuning", default="off", choices=("on", "off"),
                   help="on: coordinate-descent tuning of the bs=1 decode graph (the engine's default is off)")
    p.add_argument("--decode-ladder", type=int, nargs="+", default=None, metavar="BS",
                   help="the engine's decode ladder (compile option decode_ladder; default the engine's): "
                        "without 1, a bs=1 step pads to the smallest size and no bs=1 graph is compiled")
    p.add_argument("--enforce-eager", action="store_true",
                   help="engine starts without torch.compile: what the rest of a start costs, alone")
    p.add_argument("--package", default=None, help="measure this package (default: export one first)")
    p.add_argument("--keep-package", default=None, metavar="PATH.pt2",
                   help="export the package here and keep it (for `tscompile bench --package`)")
    p.add_argument("--weights", default="external", choices=("inside", "external"), help="of the exported package")
    p.add_argument("--skip", nargs="*", default=[], choices=START_NAMES)
    p.add_argument("--output-json", default=None)
    p.add_argument("--output-md", default=None)
    p.add_argument("--child", default=None, choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
