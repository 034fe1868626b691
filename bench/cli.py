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
  package                        the model exported by tscompile export (or --package PATH), loaded with
                                 tscompile.load_package; only when named in --modes or given --package.
                                 Its programs run without CUDA graphs unless --package-cuda-graphs
                                 (decode only). Also reports load to first token.
A mode or a batch size that fails becomes an error row; the others still run.

--model-impl native transformers: every engine mode (eager, tscompile-*) runs once per model
implementation, native first, on the same weights; the native rows keep the mode's name, the
transformers rows are labelled <mode>+transformers, and the markdown adds their time ratio per
decode batch size and prefill length. The static-cache baselines and package run once.

--kernel-table: after every timed row of a mode (never before one: a finished profiler run may
slow what is timed after it), a few steps of each row's workload under torch.profiler: the top
kernels per step (CPU ops on the CPU) with count, time and share. With --hf-model: after each
mode's timed calls at each length, a few more forwards of that length.

Correctness: each batch size's first request is decoded once by a float32 eager reference of the
same weights. In a float32 run every mode must decode its tokens exactly: a difference is marked
FAIL and the bench exits non-zero. In a lower dtype every row says whether its greedy tokens agree
and, where not, the first diverging step and the reference's top-2 logit margin there (a near-tie,
or a suspicious gap).
"""

import argparse
import json
import os
import sys

import torch

from tscompile.utils import resolve_device, resolve_dtype

from . import compile_stats, environment, impls, kernel_table, package_mode, plot, report, roofline, variants
from .runner import Bench, backend_available

FIXED_MODES = ("eager", "compile-default", "compile-reduce-overhead", "compile-reduce-overhead-tuned")


# -- modes and defaults ----------------------------------------------------------------------------
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
    # the package mode exports the model first (minutes on a GPU): it runs when asked for
    given = [package_mode.PACKAGE_MODE] if getattr(args, "package", None) else []
    if not args.modes:
        return list(FIXED_MODES) + engine_modes + given
    known = set(FIXED_MODES) | {f"tscompile-{b}" for b in BACKENDS} | {package_mode.PACKAGE_MODE}
    modes: list[str] = []
    for m in args.modes:
        expanded = engine_modes if m == "tscompile" else [m]
        for e in expanded:
            if e not in known:
                raise ValueError(f"tscompile: unknown bench mode {e!r}; known: {sorted(known)} or 'tscompile'")
            if e not in modes:
                modes.append(e)
    return modes + [m for m in given if m not in modes]


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
    for flag, given, known in (("--skip-decode", getattr(args, "skip_decode", []), args.batch_size),
                               ("--skip-prefill", getattr(args, "skip_prefill", []), args.prefill_lens)):
        stray = sorted(set(given) - set(known))
        if stray:
            raise ValueError(f"tscompile: {flag} {stray} names rows this run would not have ({known})")
    if getattr(args, "package_cuda_graphs", False) and not gpu:
        raise ValueError(f"tscompile: --package-cuda-graphs needs a CUDA device (the decode graphs are CUDA graphs); "
                         f"--device is {args.device!r}")
    if getattr(args, "package", None) and not os.path.isfile(args.package):
        raise ValueError(f"tscompile: --package {args.package!r} is not a file; "
                         f"give a .pt2 written by tscompile export")
    for name in ("kernel_table_steps", "kernel_table_top"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ValueError(f"tscompile: --{name.replace('_', '-')} {value} must be >= 1")
    for name in ("peak_tflops", "margin_threshold"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ValueError(f"tscompile: --{name.replace('_', '-')} {value} must be > 0")
    return device


# -- argparse --------------------------------------------------------------------------------------
def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark one model (a local checkpoint directory or a preset) in eager, "
                                     "stock torch.compile and tscompile modes: decode and prefill tables",
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
    p.add_argument("--skip-decode", type=int, nargs="+", default=[], metavar="BS",
                   help="batch sizes whose decode rows an earlier run of the same workload measured (a run cut by a "
                        "time limit, resumed): not run again; the engine is still sized for every --batch-size")
    p.add_argument("--skip-prefill", type=int, nargs="+", default=[], metavar="LEN",
                   help="prompt lengths whose prefill rows an earlier run measured: not run again")
    p.add_argument("--num-iters", type=int, default=None, help="measured runs per point (default 5 cuda, 2 cpu)")
    p.add_argument("--num-iters-warmup", type=int, default=1, help="warm-up runs per point (compile, capture)")
    p.add_argument("--modes", nargs="+", default=None,
                   help=f"subset of {', '.join(FIXED_MODES)}, tscompile-<backend>, tscompile, package "
                        f"(default: all but package)")
    p.add_argument("--attention-backends", nargs="+", default=None,
                   help="backends of the tscompile-* modes (default: every one available on the device)")
    p.add_argument("--package", default=None, metavar="PATH.pt2",
                   help="the package the package mode measures (default: export the bench model, with the bench's "
                        "dtype, seed, page size and limits as its bounds); adds the package mode")
    p.add_argument("--package-cuda-graphs", action="store_true",
                   help="the package mode loads its package with cuda_graphs=True: decode steps replay CUDA graphs "
                        "(CUDA only)")
    p.add_argument("--model-impl", nargs="+", choices=impls.CHOICES, default="auto",
                   help="the code the eager and tscompile-* modes run (tscompile.LLM's model_impl): transformers runs "
                        "transformers' modeling code with the paged attention; a preset's seeded weights are then "
                        "written once as a transformers checkpoint in a temporary directory (default auto: native "
                        "where it exists). `native transformers`: each engine mode runs with both, the transformers "
                        "rows labelled <mode>+transformers, and the markdown gives their time ratio")
    p.add_argument("--tscompile-options", type=_json_object, default=None, metavar="JSON",
                   help="compile options of the compiled tscompile modes (TscompileConfig's fields), e.g. "
                        "'{\"decode_ladder\": [2, 4, 8]}': a variant measured against the defaults of another run")
    p.add_argument("--kernel-variants", nargs="+", default=None, metavar="NAME=JSON",
                   help="each compiled tscompile mode again per variant, in this process, with these KernelPolicy "
                        "fields laid over its kernels: rows <mode>@NAME and their ratio to the mode's, e.g. "
                        "'fused={\"fused_gated_delta\": true}'")
    p.add_argument("--seed", type=int, default=0, help="weight and prompt seed")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tscompile token budget per step (default: the whole batch's prompts in one step)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks the tscompile engine modes split the model over (one GPU each; gloo on cpu)")
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
    p.add_argument("--kernel-table", "--profile", dest="kernel_table", action="store_true",
                   help="after every timed row of a mode, profile a few steps of the same workload (torch.profiler) and "
                        "add their top kernels (CPU ops on the CPU) with time and share per step to the JSON and "
                        "markdown")
    p.add_argument("--kernel-table-steps", type=int, default=kernel_table.DEFAULT_STEPS,
                   help=f"steps profiled per row (default {kernel_table.DEFAULT_STEPS})")
    p.add_argument("--kernel-table-top", type=int, default=kernel_table.DEFAULT_TOP,
                   help=f"kernels listed per row (default {kernel_table.DEFAULT_TOP})")
    p.add_argument("--merge", nargs="+", default=None, metavar="RUN.json",
                   help="no run: one table from these bench JSONs of the same workload and machine kind, each mode "
                        "from one of them (an all-mode table whose modes ran in separate processes); "
                        "RUN.json:MODE,MODE takes only those modes of a run")
    p.add_argument("--compare", nargs=2, default=None, metavar=("BEFORE.json", "AFTER.json"),
                   help="no run: each row both runs measured (decode TPOT, prefill ms) with its ratio after / before "
                        "and whether the first request's tokens changed; exits 1 when a row is slower than "
                        "--compare-tolerance allows or its tokens changed (an A/B of a change)")
    p.add_argument("--compare-tolerance", type=float, default=0.03,
                   help="the slowdown --compare accepts, a fraction (default 0.03)")
    px = p.add_argument_group("prefix caching (bench/prefix_workload.py)")
    px.add_argument("--no-prefix-caching", action="store_true",
                    help="the engine modes run without prefix caching (every run starts from an empty cache either way)")
    px.add_argument("--prefix-workload", choices=["shared", "chat", "distinct"], default=None,
                    help="instead of the modes: requests sharing a long prefix (shared), a multi-turn chat replay "
                         "(chat), or prompts sharing nothing, one at a time (distinct: what caching costs with no "
                         "hits), measured with prefix caching off and on: TTFT, prefill time, throughput, hit rate")
    px.add_argument("--prefix-requests", type=int, default=None, help="requests (chats) of --prefix-workload "
                                                                        "(default 32 cuda, 4 cpu)")
    px.add_argument("--prefix-len", type=int, default=None, help="shared prefix tokens (default 2048 cuda, 64 cpu)")
    px.add_argument("--prefix-suffix-len", type=int, default=None,
                    help="each request's own tokens (per chat turn) (default 64 cuda, 8 cpu)")
    px.add_argument("--chat-turns", type=int, default=None, help="turns of the chat workload (default 4 cuda, 2 cpu)")
    ps = p.add_argument_group("speculative decoding (bench/spec_workload.py)")
    ps.add_argument("--speculative", nargs="+", choices=["ngram", "replay", "draft_model", "all"], default=None,
                    help="instead of the modes: plain decode against speculative decoding with these methods (all: "
                         "every one), one engine per method and --num-speculative-tokens value, on prompts that "
                         "repeat a block; replay proposes the engine's own greedy output of an earlier run "
                         "(every draft accepted)")
    ps.add_argument("--num-speculative-tokens", default="3", help="k values, comma-separated (default 3)")
    ps.add_argument("--draft-model", default=None,
                    help="the draft checkpoint or preset of --speculative draft_model (default: the model itself)")
    ps.add_argument("--spec-requests", default=None,
                    help="batch sizes, comma-separated: requests per run (default 1,32 cuda, 2 cpu)")
    ps.add_argument("--spec-block", type=int, default=16, help="tokens of the block each prompt repeats")
    ps.add_argument("--spec-repeats", type=int, default=4, help="times each prompt repeats its block")
    pg = p.add_argument_group("GEMV launch sweep (bench/gemv_sweep.py)")
    pg.add_argument("--gemv-sweep", action="store_true",
                    help="instead of the modes: time the Triton skinny matmul's launches against cuBLAS on --model's "
                         "projection shapes and print the launch-table entries the timings support")
    pg.add_argument("--gemv-rows", default=None, metavar="M,M,...",
                    help="row counts to time, comma-separated, each in [1, 32] (default 1,2,4,8)")
    pg.add_argument("--gemv-modes", nargs="+", choices=["acc", "fma", "dot"], default=None,
                    help="the kinds of launch to time (default: all three)")
    pg.add_argument("--gemv-shapes", nargs="+", default=None, metavar="PROJ",
                    help="only these projections (e.g. layers.attention.wo output; default: every one)")
    p.add_argument("--output-json", default=None, metavar="PATH", help="the run's JSON here")
    p.add_argument("--output-md", default=None, metavar="PATH", help="the run's markdown tables here")
    p.add_argument("--output-dir", default=report.DEFAULT_OUTPUT_DIR, metavar="DIR",
                   help="without --output-json and --output-md, both go here as <model>-<device>-<time>.json "
                        f"and .md (default {report.DEFAULT_OUTPUT_DIR}/, which git ignores)")
    p.add_argument("--plot", default=None, metavar="PATH.png", help="decode ms/step vs batch size (matplotlib)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failed modes")
    hf = p.add_argument_group("torch.compile users' bench (a stock transformers model instead of the engine modes)")
    hf.add_argument("--hf-model", default=None, metavar="DIR|PRESET",
                    help="a transformers causal-LM checkpoint directory, or a preset shape with seeded random "
                         "weights: llama-tiny, llama-1b, llama-8b (LlamaForCausalLM), qwen3-next-tiny, qwen3-next-1b "
                         "(Qwen3NextForCausalLM); runs eager, stock torch.compile and backend='tscompile' on it "
                         "(bench/hf_model.py) instead of the engine modes")
    hf.add_argument("--hf-lens", type=int, nargs="+", default=None,
                    help="bs=1 forward prompt lengths (default 32 512 2048 cuda, 16 40 cpu)")
    hf.add_argument("--hf-generate-tokens", type=int, default=None,
                    help="new tokens of the static-cache generate (default 64 cuda, 16 cpu)")
    hf.add_argument("--hf-parts", nargs="+", default=None,
                    help="forward, generate, stream (default forward generate); each part compiles afresh")
    hf.add_argument("--hf-stream-prompts", type=int, default=None,
                    help="the stream part: this many prompts of distinct lengths, twice (default 200 cuda, 6 cpu)")
    hf.add_argument("--hf-stream-lens", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                    help="the stream's lengths are drawn from LO..HI (default 17 2048 cuda, 17 64 cpu)")
    hf.add_argument("--hf-use-cache", action="store_true",
                    help="forward and stream calls with transformers' default cache (use_cache=True) instead of "
                         "use_cache=False")
    hf.add_argument("--hf-modes", nargs="+", default=None,
                    help="subset of eager, compile-default, compile-reduce-overhead, tscompile, tscompile-split "
                         "(default: all; eager always runs, as the reference)")


# -- orchestration ---------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    code = _dispatch(args)
    written = [p for p in (args.output_json, args.output_md) if p and os.path.isfile(p)]
    if written:
        print(f"bench: wrote {' and '.join(map(str, written))}", file=sys.stderr)
    return code


def _default_outputs(args: argparse.Namespace) -> None:
    """A run asked for no output file writes both into ``--output-dir``."""
    if args.output_json is None and args.output_md is None:
        args.output_json, args.output_md = map(str, report.default_output_paths(args, args.output_dir))


def _dispatch(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from . import hf_args, hf_model

    impls.check_model_impls(args)
    kernel_variants = variants.from_args(args)
    if args.gemv_sweep:  # first: it refuses the other runs' flags rather than be overridden by them
        from . import gemv_sweep

        impls.refuse_several(args, "--gemv-sweep", "times kernels alone")
        _default_outputs(args)
        return gemv_sweep.run(args)
    if args.merge:
        from . import merge

        impls.refuse_several(args, "--merge", "runs nothing (its rows keep the labels their runs gave them)")
        if args.hf_model or args.modes or args.package or args.tscompile_options is not None:
            raise ValueError("tscompile: --merge combines finished runs; it runs nothing, so it takes no "
                             "--hf-model, --modes, --package or --tscompile-options")
        _default_outputs(args)
        return merge.run(args)
    if args.compare:
        from . import compare

        _default_outputs(args)
        return compare.run(args)
    if args.speculative:
        from . import spec_workload

        impls.refuse_several(args, "--speculative", "runs the native model only")
        _default_outputs(args)
        return spec_workload.run(args)
    if args.prefix_workload:
        from . import prefix_workload

        impls.refuse_several(args, "--prefix-workload", "runs the native model only")
        _default_outputs(args)
        return prefix_workload.run(args)
    if args.hf_model:
        if args.tscompile_options is not None:
            raise ValueError("tscompile: --tscompile-options sets the engine modes' compile options; the "
                             "--hf-model bench compiles a transformers model with its own --hf-modes")
        if impls.model_impls(args) != ["auto"]:
            raise ValueError(f"tscompile: --model-impl {' '.join(impls.model_impls(args))} picks the engine modes' "
                             f"model code; the --hf-model bench runs no engine mode: leave --model-impl out")
        _default_outputs(args)
        return hf_model.run(args)
    hf_args.check_hf_flags_unused(args)
    if args.package_cuda_graphs and not (args.package or package_mode.PACKAGE_MODE in (args.modes or ())):
        raise ValueError("tscompile: --package-cuda-graphs changes the package mode, which this run does not "
                         "measure; add `package` to --modes or give --package")
    device = fill_defaults(args)
    dtype = resolve_dtype(args.dtype, device)
    modes = resolve_modes(args, device)
    if args.tscompile_options is not None:
        _check_tscompile_options(args.tscompile_options, modes)
    impls.check_some_engine_mode(modes, impls.model_impls(args))
    modes = impls.labelled_modes(modes, impls.model_impls(args))  # several implementations: a row label each
    modes = variants.labelled(modes, kernel_variants)
    _default_outputs(args)
    threads = torch.get_num_threads()
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    metrics_limit = compile_stats.keep_compilation_metrics()
    try:
        return _run(args, device, dtype, modes, tqdm)
    finally:
        compile_stats.restore_compilation_metrics(metrics_limit)
        torch.set_num_threads(threads)


def _check_tscompile_options(options: dict, modes: list[str]) -> None:
    """Refuse --tscompile-options before any model is built: options no compiled tscompile mode of
    the run would use, or that the engine would refuse (a misspelt option, a bad ladder)."""
    from tscompile.config import TscompileConfig

    if not any(m.startswith("tscompile-") for m in modes):
        raise ValueError(f"tscompile: --tscompile-options sets the compiled tscompile modes' options, and this "
                         f"run measures none of them (modes {modes})")
    TscompileConfig.from_options(options)


def _json_object(text: str) -> dict:
    """--tscompile-options: a JSON object, or a ``tscompile:`` refusal naming what was given."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"tscompile: --tscompile-options {text!r} is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"tscompile: --tscompile-options {text!r} must be a JSON object of "
                                         "compile options")
    return value


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
    decode_sizes, prefill_lens = bench.decode_sizes, bench.prefill_lens
    total = len(modes) * (len(decode_sizes) + len(prefill_lens))
    total += 0 if args.no_reference else len(decode_sizes)
    env = {**environment.environment(device), "torch_threads": torch.get_num_threads()}

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
        section = package_mode.markdown_section(bench.modes)
        md += ("\n" + section) if section else ""
        report.write_outputs(result, md, args)
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
            plot.plot(result, args.plot)
        except ImportError as e:
            print(f"bench: --plot needs matplotlib ({e})", file=sys.stderr)
    failed = bench.failed_checks()  # a float32 mode that decodes other tokens than the reference: a bug
    if failed:
        print(f"bench: FAIL: float32 tokens differ from the float32 reference in {', '.join(failed)}", file=sys.stderr)
    ok = any(not r.get("error") for r in bench.results + bench.prefill) and not failed
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    from tscompile.cli import main as cli_main

    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
