"""``tscompile bench``: argparse and orchestration (modes x batch sizes, then bs=1 prefill lengths)."""

from __future__ import annotations

DESCRIPTION = """Decode (TPOT, tokens/s, TTFT, roofline) and prefill figures of one model in several modes.

Modes, all on the same seeded weights (``build_model(preset, dtype, device, seed)`` per mode):
  eager                          tscompile.LLM(enforce_eager=True, attention_backend="torch")
  compile-default                torch.compile of the static-KV-cache model (bench/static_cache_model.py)
  compile-reduce-overhead        the same, decode step compiled with mode="reduce-overhead"
  compile-reduce-overhead-tuned  that, tuned as gpt-fast tunes it (coordinate-descent tuning,
                                 fullgraph=True), with GQA that reads the KV cache without a per-head
                                 copy (SDPA's enable_gqa, or the query heads folded into rows where
                                 enable_gqa with a mask would take SDPA's math kernel)
  tscompile-<backend>            tscompile.LLM(enforce_eager=False, attention_backend=<backend>)
A mode or a batch size that fails becomes an error row; the others still run.

Correctness: each batch size's first request is decoded once by a float32 eager reference of the
same weights; every row says whether its greedy tokens agree and, where not, the first diverging
step and the reference's top-2 logit margin there (a near-tie, or a suspicious gap).
"""

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
import traceback

import torch

from tscompile.counters import counters
from tscompile.utils import cdiv, resolve_device, resolve_dtype

from . import compile_stats, reference, report, roofline, workloads

# engine counters recorded per measured row: they say whether the timed runs replayed graphs, ran
# without them, or captured/compiled something (which would inflate the time)
TIMED_COUNTERS = ("graphs", "prefill_graphed", "prefill_eager", "prefill_captures", "decode_replays", "decode_eager",
                  "decode_captures")

FIXED_MODES = ("eager", "compile-default", "compile-reduce-overhead", "compile-reduce-overhead-tuned")


# -- modes and defaults ----------------------------------------------------------------------------
def backend_available(name: str, device: torch.device) -> tuple[bool, str]:
    """Whether backend ``name``'s leaf class imports and can run on ``device`` (and why not)."""
    from tscompile.attention import leaf_class

    try:
        cls = leaf_class(name)
    except Exception as e:  # noqa: BLE001  (a missing kernel package is just "unavailable")
        return False, f"{type(e).__name__}: {e}"
    impl = getattr(cls, "impl", name)
    if device.type == "cuda" or impl == "torch":
        return True, ""
    if impl == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
        return True, ""
    return False, f"the {name} backend needs CUDA" + (" (or TRITON_INTERPRET=1)" if impl == "triton" else "")


def resolve_modes(args: argparse.Namespace, device: torch.device) -> list[str]:
    from tscompile.attention import BACKENDS

    if args.attention_backends:
        unknown = [b for b in args.attention_backends if b not in BACKENDS]
        if unknown:
            raise ValueError(f"tscompile: unknown attention backend(s) {unknown}; known: {sorted(BACKENDS)}")
        backends = list(args.attention_backends)  # asked for by name: an unavailable one becomes an error row
    else:
        backends = [b for b in BACKENDS if backend_available(b, device)[0]]
    engine_modes = [f"tscompile-{b}" for b in backends]
    if not args.modes:
        return list(FIXED_MODES) + engine_modes
    known = set(FIXED_MODES) | {f"tscompile-{b}" for b in BACKENDS}
    modes: list[str] = []
    for m in args.modes:
        expanded = engine_modes if m == "tscompile" else [m]
        for e in expanded:
            if e not in known:
                raise ValueError(f"tscompile: unknown bench mode {e!r}; known: {sorted(known)} or 'tscompile'")
            if e not in modes:
                modes.append(e)
    return modes


def fill_defaults(args: argparse.Namespace) -> torch.device:

    device = resolve_device(args.device)
    args.device = str(device)
    gpu = device.type == "cuda"
    args.dtype = str(resolve_dtype(args.dtype, device)).removeprefix("torch.")
    args.input_len = args.input_len or (512 if gpu else 32)
    args.output_len = args.output_len or (128 if gpu else 16)
    args.batch_size = args.batch_size or ([1, 8, 32, 64] if gpu else [1, 4])
    args.prefill_lens = args.prefill_lens or ([32, 128, 512, 2048] if gpu else [16, 64])
    args.num_iters = args.num_iters if args.num_iters is not None else (5 if gpu else 2)
    if min(args.batch_size + args.prefill_lens + [args.input_len, args.output_len, args.num_iters]) < 1:
        raise ValueError("tscompile: batch sizes, lengths and --num-iters must be >= 1")
    for name in ("peak_tflops", "margin_threshold"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ValueError(f"tscompile: --{name.replace('_', '-')} {value} must be > 0")
    return device


# -- argparse --------------------------------------------------------------------------------------
def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark eager vs torch.compile baselines vs tscompile (decode and prefill)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-tiny",
                   help="a preset (llama-tiny, llama-1b, llama-8b) or a local checkpoint directory")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens per request (default 512 cuda, 32 cpu)")
    p.add_argument("--output-len", type=int, default=None, help="new tokens per request (default 128 cuda, 16 cpu)")
    p.add_argument("--batch-size", type=int, nargs="+", default=None, help="default: 1 8 32 64 cuda, 1 4 cpu")
    p.add_argument("--prefill-lens", type=int, nargs="+", default=None,
                   help="bs=1 prompt lengths for the prefill figures (default 32 128 512 2048 cuda, 16 64 cpu)")
    p.add_argument("--num-iters", type=int, default=None, help="measured runs per point (default 5 cuda, 2 cpu)")
    p.add_argument("--num-iters-warmup", type=int, default=1, help="warm-up runs per point (compile, capture)")
    p.add_argument("--modes", nargs="+", default=None,
                   help=f"subset of {', '.join(FIXED_MODES)}, tscompile-<backend>, tscompile (default: all)")
    p.add_argument("--attention-backends", nargs="+", default=None,
                   help="backends of the tscompile-* modes (default: every one available on the device)")
    p.add_argument("--seed", type=int, default=0, help="weight and prompt seed")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tscompile token budget per step (default: the whole batch's prompts in one step)")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="torch intra-op threads for the run (cpu; on a shared host fewer threads time steadier)")
    p.add_argument("--bandwidth-mib", type=int, default=None, help="copy size of the bandwidth probe")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="matmul peak for the prefill MFU (default: measured by an 8192^3 matmul in --dtype on "
                        "cuda; none on cpu, where MFU is not reported)")
    p.add_argument("--margin-threshold", type=float, default=0.5,
                   help="a mode whose first token off the float32 reference trails the reference's pick by more "
                        "than this many logits is flagged suspicious (default 0.5)")
    p.add_argument("--no-reference", action="store_true", help="skip the float32 reference run (no correctness "
                   "column; saves a float32 copy of the model on the device)")
    p.add_argument("--output-json", default=None, metavar="PATH")
    p.add_argument("--output-md", default=None, metavar="PATH")
    p.add_argument("--plot", default=None, metavar="PATH.png", help="decode ms/step vs batch size (matplotlib)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failed modes")


# -- orchestration ---------------------------------------------------------------------------------
def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".strip()


def _cleanup(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _fingerprint(model) -> float:
    with torch.no_grad():
        return float(model.output.weight[:64].float().sum() + model.layers[0].attention.wqkv.weight[:64].float().sum())


def _prompts(seed: int, n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed * 100003 + n * 1009 + length)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def _spread_ms(seconds: list[float]) -> dict:
    """Median, fastest and slowest of per-iteration times, in ms (None without iterations)."""
    if not seconds:
        return {"median": None, "min": None, "max": None}
    ms = sorted(x * 1e3 for x in seconds)
    return {"median": statistics.median(ms), "min": ms[0], "max": ms[-1]}


@contextlib.contextmanager
def _float32_matmuls():
    """The reference's float32 means float32: no TF32 in its matmuls, whatever the process set."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


class Bench:
    def __init__(self, args: argparse.Namespace, device: torch.device, dtype: torch.dtype, bandwidth_gbps: float,
                 peak_tflops: float | None = None):
        from tscompile.models import model_config

        self.args, self.device, self.dtype, self.bw = args, device, dtype, bandwidth_gbps
        self.peak_tflops = peak_tflops
        self.cfg = model_config(args.model)
        self.max_model_len = cdiv(max(args.input_len + args.output_len, max(args.prefill_lens) + 1), args.page_size) * args.page_size
        self.results: list[dict] = []
        self.prefill: list[dict] = []
        self.modes: dict[str, dict] = {}
        self.tokens: dict[tuple[str, int], list[list[int]]] = {}
        self.references: dict[int, reference.ReferenceRun] = {}  # batch size -> its first request's run
        self.reference_info: dict = {"error": None, "skipped": bool(getattr(args, "no_reference", False))}
        self.on_row = lambda: None  # called after every row: the caller saves what is measured so far

    # -- the float32 reference ---------------------------------------------------------------------
    def run_reference(self, bar) -> None:
        """Greedy tokens (and each step's top logits) of every batch size's first prompt, float32."""
        from tscompile.models import build_model

        a = self.args
        if self.reference_info["skipped"]:
            return
        t0 = time.perf_counter()
        model = None
        try:
            bar.set_postfix_str("float32 reference")
            # the modes' own weights (drawn in the bench dtype), upcast: the reference differs from a
            # mode in arithmetic only, not in weight rounding
            model = build_model(a.model, dtype=self.dtype, device=self.device, seed=a.seed).float()
            self.reference_info["weights_fingerprint"] = _fingerprint(model)
            with _float32_matmuls():
                for bs in a.batch_size:
                    prompt = _prompts(a.seed, bs, a.input_len, self.cfg.vocab_size)[0]
                    self.references[bs] = reference.reference_greedy(model, prompt, a.output_len, self.device)
                    bar.update(1)
        except Exception as e:  # noqa: BLE001  (no reference: the rows say so, the modes still run)
            self.reference_info["error"] = self._report("float32 reference", "run", e, bar)
            bar.update(len(a.batch_size) - len(self.references))
        self.reference_info["seconds"] = time.perf_counter() - t0
        self.reference_info["runs"] = {
            str(bs): {"tokens": r.tokens, "margins": [reference.margin_at(c, c.ids[0])["margin"] for c in r.steps]}
            for bs, r in self.references.items()}
        del model
        _cleanup(self.device)

    # -- one mode ----------------------------------------------------------------------------------
    def make_runner(self, mode: str, model):
        a = self.args
        if mode in workloads.STATIC_MODES:
            return workloads.StaticCacheRunner(model, mode, self.device)
        backend = "torch" if mode == "eager" else mode.removeprefix("tscompile-")
        if mode != "eager":
            ok, why = backend_available(backend, self.device)
            if not ok:
                raise RuntimeError(f"backend {backend!r} unavailable: {why}")
        budget = a.max_num_batched_tokens or max(max(a.batch_size) * a.input_len, max(a.prefill_lens), 2048)
        return workloads.EngineRunner(model, attention_backend=backend, enforce_eager=mode == "eager",
                                      device=self.device, dtype=self.dtype, max_num_seqs=max(a.batch_size),
                                      max_model_len=self.max_model_len, page_size=a.page_size,
                                      max_num_batched_tokens=budget, seed=a.seed)

    def decode_row(self, mode: str, runner, bs: int, prev: dict) -> dict:
        a = self.args
        prompts = _prompts(a.seed, bs, a.input_len, self.cfg.vocab_size)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        warm = [runner.run_batch(prompts, a.output_len, per_call=(i == 0)) for i in range(a.num_iters_warmup)]
        before, compiled_before = dict(counters), compile_stats.snapshot()
        runs = [runner.run_batch(prompts, a.output_len) for _ in range(a.num_iters)]
        timed = {k: counters[k] - before.get(k, 0) for k in TIMED_COUNTERS}
        # a compile inside the timed runs would inflate them: Dynamo's side of that, beside the engine's
        compiled = compile_stats.since(compiled_before)
        timed.update(dynamo_graphs_compiled=compiled["graphs_compiled"], dynamo_recompiles=compiled["recompiles"])
        self.tokens[(mode, bs)] = runs[-1].tokens
        steps = sum(r.decode_steps for r in runs)
        ttft_s = sum(r.ttft_s for r in runs) / len(runs)
        tpot_s = sum(r.decode_s for r in runs) / steps if steps else None
        ttft = _spread_ms([r.ttft_s for r in runs])
        tpot = _spread_ms([r.decode_s / r.decode_steps for r in runs if r.decode_steps])
        row = {"mode": mode, "batch_size": bs, "input_len": a.input_len, "output_len": a.output_len, "error": None,
               "ttft_ms": ttft_s * 1e3, "ttft_ms_median": ttft["median"], "ttft_ms_min": ttft["min"],
               "ttft_ms_max": ttft["max"], "tpot_ms": tpot_s * 1e3 if tpot_s else None,
               "decode_tokens_per_s": bs / tpot_s if tpot_s else None, "decode_steps_per_iter": steps // len(runs),
               "non_decode_steps": sum(r.other_steps for r in runs), "tokens_req0": runs[-1].tokens[0],
               "tpot_ms_median": tpot["median"], "tpot_ms_min": tpot["min"], "tpot_ms_max": tpot["max"],
               "timed_runs": timed}
        if isinstance(runner, workloads.StaticCacheRunner):
            if warm:
                row["compile_s"], row["capture_s"] = workloads.compile_excess(warm[0], ttft_s, tpot_s or 0.0,
                                                                              runner.cudagraphs)
            else:
                row["compile_s"] = row["capture_s"] = None
        else:
            for key, attr in (("compile_s", "compile_seconds"), ("capture_s", "capture_seconds")):
                cur = getattr(runner, attr)
                if cur is None and mode == "eager":
                    cur = 0.0
                row[key] = None if cur is None else cur - prev.get(key, 0.0)
                prev[key] = cur or 0.0
        row["peak_memory_gib"] = (torch.cuda.max_memory_allocated() / 2**30 if self.device.type == "cuda" else None)
        ctx = roofline.mean_decode_context(a.input_len, a.output_len)
        nbytes = roofline.decode_step_bytes(self.cfg, bs, ctx, self.dtype.itemsize)
        row.update(context_len=ctx, weight_bytes=nbytes.weight_bytes, kv_bytes=nbytes.kv_bytes,
                   step_bytes=nbytes.total, roofline_ms=roofline.roofline_ms(nbytes.total, self.bw))
        applies, why = roofline.roofline_applies(self.device, nbytes.total)
        row["roofline_note"] = why or None
        if tpot["median"]:
            # against the median step, the figure the table shows
            row["achieved_gbps"] = nbytes.total / (tpot["median"] / 1e3) / 1e9
            row["pct_of_roofline"] = 100.0 * row["roofline_ms"] / tpot["median"] if applies else None
        return row

    def prefill_row(self, mode: str, runner, length: int) -> dict:
        a = self.args
        prompt = _prompts(a.seed, 1, length, self.cfg.vocab_size)[0]
        for _ in range(a.num_iters_warmup):
            runner.run_prefill(prompt)
        before = dict(counters)
        times = sorted(runner.run_prefill(prompt) for _ in range(a.num_iters))
        # what the timed runs did: graphed or not, and whether anything was captured or compiled in them
        steps = {k: counters[k] - before.get(k, 0) for k in TIMED_COUNTERS}
        secs = statistics.median(times)  # the median: one slow run (a GC pause, the OS) moves it least
        flops = roofline.prefill_flops(self.cfg, length)
        return {"mode": mode, "prompt_len": length, "error": None, "prefill_ms": secs * 1e3,
                "prefill_ms_min": times[0] * 1e3, "prefill_ms_max": times[-1] * 1e3,
                "prefill_ms_mean": sum(times) / len(times) * 1e3, "prefill_tokens_per_s": length / secs,
                "prefill_flops": flops, "prefill_tflops": flops / secs / 1e12,
                "mfu": roofline.mfu(flops, secs, self.peak_tflops), "timed_runs": steps}

    def run_mode(self, mode: str, bar) -> None:
        from tscompile.models import build_model

        a = self.args
        info: dict = {"error": None}
        self.modes[mode] = info
        torch._dynamo.reset()
        compiled_before = compile_stats.snapshot()

        def note_compiles() -> None:  # after every row, so a run cut short keeps them too
            info["compile_stats"] = compile_stats.since(compiled_before)
            info["recompile_reasons"] = compile_stats.recompile_reasons(compiled_before)

        runner = model = None
        try:
            t0 = time.perf_counter()
            model = build_model(a.model, dtype=self.dtype, device=self.device, seed=a.seed)
            info["weights_fingerprint"] = _fingerprint(model)
            runner = self.make_runner(mode, model)
            info["setup_s"] = time.perf_counter() - t0
            if isinstance(runner, workloads.StaticCacheRunner):
                info["gqa"], info["gqa_why"] = runner.gqa, runner.gqa_why
        except Exception as e:  # noqa: BLE001
            info["error"] = self._report(mode, "setup", e, bar)
        prev: dict = {}
        for bs in a.batch_size:
            bar.set_postfix_str(f"{mode} bs={bs}")
            try:
                if runner is None:
                    raise RuntimeError(info["error"])
                self.results.append(self.decode_row(mode, runner, bs, prev))
            except Exception as e:  # noqa: BLE001
                self.results.append({"mode": mode, "batch_size": bs, "error": self._report(mode, f"bs={bs}", e, bar)})
                _cleanup(self.device)
            note_compiles()
            self.on_row()
            bar.update(1)
        for length in a.prefill_lens:
            bar.set_postfix_str(f"{mode} prefill {length}")
            try:
                if runner is None:
                    raise RuntimeError(info["error"])
                self.prefill.append(self.prefill_row(mode, runner, length))
            except Exception as e:  # noqa: BLE001
                self.prefill.append({"mode": mode, "prompt_len": length,
                                     "error": self._report(mode, f"prefill {length}", e, bar)})
                _cleanup(self.device)
            note_compiles()
            self.on_row()
            bar.update(1)
        for key in ("compile_s", "capture_s"):
            vals = [r.get(key) for r in self.results if r["mode"] == mode and not r.get("error")]
            info[key] = sum(vals) if vals and None not in vals else None
        if runner is not None:
            runner.close()
        del runner, model
        torch._dynamo.reset()
        _cleanup(self.device)

    def _report(self, mode: str, where: str, e: BaseException, bar) -> str:
        msg = _error_text(e)
        bar.write(f"bench: {mode} {where} failed: {msg}", file=sys.stderr)
        if self.args.verbose:
            bar.write(traceback.format_exc(), file=sys.stderr)
        return msg

    def mark_agreement(self) -> None:
        """``reference_check``: the first request's greedy tokens against the float32 reference's
        (``reference.compare``); ``match_eager``: how many requests' tokens equal eager's at the same
        batch size (a consistency figure, not a correctness check: eager is bf16 too)."""
        threshold = self.args.margin_threshold
        for row in self.results:
            got = self.tokens.get((row["mode"], row["batch_size"]))
            if got is None:
                continue
            ref = self.references.get(row["batch_size"])
            if ref is not None:
                row["reference_check"] = reference.compare(ref, got[0], threshold)
            elif self.reference_info.get("error"):
                row["reference_check"] = {"error": self.reference_info["error"]}
            eager = self.tokens.get(("eager", row["batch_size"]))
            if eager is not None:
                row["match_eager"] = f"{sum(x == y for x, y in zip(got, eager))}/{len(eager)}"


def run(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    device = fill_defaults(args)
    dtype = resolve_dtype(args.dtype, device)
    modes = resolve_modes(args, device)
    threads = torch.get_num_threads()
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    metrics_limit = compile_stats.keep_compilation_metrics()
    try:
        return _run(args, device, dtype, modes, tqdm)
    finally:
        compile_stats.restore_compilation_metrics(metrics_limit)
        torch.set_num_threads(threads)


def _matmul_peak(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> tuple[float | None, str | None]:
    """The MFU denominator and where it comes from: --peak-tflops, else a measured matmul on cuda,
    else none (a CPU's matmul rate on a shared host says little about its peak)."""
    if args.peak_tflops:
        return args.peak_tflops, "--peak-tflops"
    if device.type == "cuda":
        return roofline.measure_matmul_tflops(device, dtype), f"measured {args.dtype} 8192^3 matmul"
    return None, None


def _run(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, modes: list[str], tqdm) -> int:
    torch.manual_seed(args.seed)
    nbytes = args.bandwidth_mib << 20 if args.bandwidth_mib else None
    bandwidth = roofline.measure_copy_bandwidth(device, nbytes)
    peak, peak_source = _matmul_peak(args, device, dtype)
    bench = Bench(args, device, dtype, bandwidth, peak)
    total = len(modes) * (len(args.batch_size) + len(args.prefill_lens))
    total += 0 if args.no_reference else len(args.batch_size)
    env = {**report.environment(device), "torch_threads": torch.get_num_threads()}

    def save(complete: bool) -> tuple[dict, str]:
        """Write the JSON and markdown of what is measured so far: a run killed by a time limit
        keeps its finished rows (``complete`` says whether every row ran)."""
        bench.mark_agreement()
        result = {
            "date": report.now_iso(), "model": args.model, "model_config": bench.cfg.to_dict(), "device": str(device),
            "dtype": args.dtype, "args": {k: v for k, v in vars(args).items() if not callable(v)},
            "env": env, "copy_bandwidth_gbps": bandwidth, "peak_tflops": peak, "peak_tflops_source": peak_source,
            "modes_run": modes, "complete": complete, "reference": bench.reference_info,
            "modes": bench.modes, "results": bench.results, "prefill": bench.prefill,
        }
        md = report.markdown(result)
        if args.output_md:
            with open(args.output_md, "w") as f:
                f.write(md + "\n")
        if args.output_json:
            report.write_json(result, args.output_json)
        return result, md

    bench.on_row = lambda: save(complete=False)
    with torch._dynamo.config.patch(cache_size_limit=64), \
            tqdm(total=total, desc="bench", disable=args.no_progress, file=sys.stderr) as bar:
        bench.run_reference(bar)
        for mode in modes:
            bench.run_mode(mode, bar)
    result, md = save(complete=True)
    print(md)
    if args.plot:
        try:
            report.plot(result, args.plot)
        except ImportError as e:
            print(f"bench: --plot needs matplotlib ({e})", file=sys.stderr)
    ok = any(not r.get("error") for r in bench.results)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    from tscompile.cli import main as cli_main

    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
