"""Cold and warm start of ``attention_backend="flashinfer"``, printed as one JSON object.

FlashInfer compiles its kernel libraries on first use (JIT) and keeps them in its cache under
``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer`` (default: the home directory). This runs two fresh
processes over one cache directory, empty before the first: the first process builds the libraries
it needs (cold), the second finds them (warm). Each imports tscompile and FlashInfer, builds an
engine, runs one prefill step and then one decode step, and reports the time of each phase and the
console lines tscompile printed about the build (each child's stderr is passed through, so they
also show up live).

    python scripts/flashinfer_start.py [--model llama-1b] [--dtype bfloat16] [--prompt-len 512]
                                       [--page-size 16] [--cache-dir DIR] [--compile]

``--cache-dir``: an empty or missing directory to use and keep (default: a temporary one, removed).
``--compile``: compile the engine (Inductor, decode graphs) instead of ``enforce_eager``. Only
FlashInfer's cache starts empty: Inductor's caches stay as they are, so with ``--compile`` the
warm figure may also owe something to Inductor's cache (``inductor_cache`` in the JSON says so).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULT_PREFIX = "FLASHINFER_START_RESULT "  # the child's last stdout line: this, then its JSON


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-1b", help="a model preset or checkpoint directory")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--prompt-len", type=int, default=512, help="tokens in the one prompt (its prefill step)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--cache-dir", default=None, help="an empty or missing directory for FlashInfer's cache (kept)")
    p.add_argument("--compile", action="store_true", help="compile the engine instead of enforce_eager")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one measured process
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """Refusals that need neither FlashInfer nor a GPU."""
    for name in ("prompt_len", "page_size"):
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"tscompile: --{name.replace('_', '-')} must be >= 1, got {value}")
    if args.cache_dir is not None:
        path = Path(args.cache_dir)
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise ValueError(f"tscompile: --cache-dir must be an empty or missing directory (a cold start needs "
                             f"an empty FlashInfer cache), got {str(path)!r}")


def check_machine() -> None:
    """FlashInfer and a CUDA device, checked in the parent before any process is started."""
    from tscompile.attention.flashinfer_host import FLASHINFER_NEEDS

    if importlib.util.find_spec("flashinfer") is None:
        raise ValueError(f"{FLASHINFER_NEEDS}; flashinfer does not import here")
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"{FLASHINFER_NEEDS}; no CUDA device here")


def _child_argv(args: argparse.Namespace) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--model", args.model, "--dtype", args.dtype,
            "--prompt-len", str(args.prompt_len), "--page-size", str(args.page_size)]
    return argv + (["--compile"] if args.compile else [])


def run_child(args: argparse.Namespace, cache_base: Path) -> dict:
    """One fresh process with FlashInfer's cache under ``cache_base``; its result plus its wall time."""
    env = {**os.environ, "FLASHINFER_WORKSPACE_BASE": str(cache_base)}
    start = time.perf_counter()
    proc = subprocess.run(_child_argv(args), env=env, stdout=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the measured process failed (exit {proc.returncode}); its stderr is above")
    return {**json.loads(lines[-1][len(RESULT_PREFIX):]), "process_s": round(wall, 3)}


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure_in_this_process(args: argparse.Namespace) -> dict:
    """The child's work: import, engine, one prefill step, one decode step, each timed."""
    import logging

    t0 = time.perf_counter()
    import flashinfer
    import torch
    from flashinfer.jit import env as jit_env

    import tscompile
    from tscompile.cli import show_tscompile_logs

    show_tscompile_logs()  # the lines the CLI shows, on stderr
    said: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "FlashInfer" in record.getMessage():
                said.append(record.getMessage())

    logging.getLogger("tscompile").addHandler(_Keep())
    t_import = time.perf_counter()
    max_model_len = args.prompt_len + 8
    pages = 2 * -(-max_model_len // args.page_size) + 2
    llm = tscompile.LLM(args.model, attention_backend="flashinfer", device="cuda", dtype=args.dtype,
                        max_model_len=max_model_len, max_num_seqs=1, page_size=args.page_size, num_pages=pages,
                        enforce_eager=not args.compile)
    torch.cuda.synchronize()
    t_build = time.perf_counter()
    vocab = llm.config.vocab_size
    prompt = [(7 * j) % (vocab - 1) + 1 for j in range(args.prompt_len)]
    req = llm.add_request(prompt, tscompile.SamplingParams(max_new_tokens=2, ignore_eos=True))
    llm.step()
    llm.sync()
    torch.cuda.synchronize()
    t_prefill = time.perf_counter()
    llm.step()
    llm.sync()
    torch.cuda.synchronize()
    t_decode = time.perf_counter()
    if len(req.output) != 2:
        raise RuntimeError(f"expected a prefill token and a decode token, got {len(req.output)} tokens")
    jit_dir = Path(jit_env.FLASHINFER_JIT_DIR)
    return {
        "import_s": round(t_import - t0, 3),
        "engine_build_s": round(t_build - t_import, 3),
        "prefill_step_s": round(t_prefill - t_build, 3),
        "decode_step_s": round(t_decode - t_prefill, 3),
        "total_s": round(t_decode - t0, 3),
        "compile_s": round(llm.compile_seconds, 3),
        "flashinfer_messages": said,
        "jit_libraries": sorted(p.parent.name for p in jit_dir.glob("*/*.so")) if jit_dir.exists() else [],
        "flashinfer_version": flashinfer.__version__,
        "device": torch.cuda.get_device_name(),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_args(args)
        if args.child:
            print(RESULT_PREFIX + json.dumps(measure_in_this_process(args)), flush=True)
            return 0
        check_machine()
    except ValueError as e:
        if not str(e).startswith("tscompile:"):
            raise
        print(str(e).splitlines()[0], file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="flashinfer-start-") as tmp:
        base = Path(args.cache_dir) if args.cache_dir is not None else Path(tmp)
        base.mkdir(parents=True, exist_ok=True)
        cold = run_child(args, base)
        warm = run_child(args, base)
        result = {
            "model": args.model, "dtype": args.dtype, "prompt_len": args.prompt_len, "page_size": args.page_size,
            "compile": args.compile,
            "inductor_cache": "as found (not cleared)" if args.compile else "unused (enforce_eager)",
            "flashinfer_cache_base": str(base) if args.cache_dir is not None else "temporary (removed)",
            "flashinfer_cache_bytes": _tree_bytes(base),
            "cold": cold, "warm": warm,
            "cold_minus_warm_s": round(cold["process_s"] - warm["process_s"], 3),
        }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
