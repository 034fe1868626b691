"""``tscompile bench --hf-model DIR|PRESET``: a stock transformers causal LM under eager, stock
``torch.compile`` and ``torch.compile(backend="tscompile")`` (the torch.compile users' path,
docs/torch_compile_users.md), one process, a fresh Dynamo state per mode.

Per mode: the forward over one bs=1 prompt (``use_cache=False``, or the default cache with
``--hf-use-cache``) at every ``--hf-lens`` length, the first call's wall time (the compile) apart;
Dynamo's compiles, recompiles and graph breaks after the first call and after every length, with
tscompile's ``user_*`` counters; transformers ``generate``
with a static cache (greedy) timed per new token and compared with eager's tokens; and the last
logits row of every length against eager's. The stream part (``--hf-parts stream``) is a serving-like
load: prompts of many distinct lengths, each once, from a fresh compile (compiles and captures
included), then the same lengths again in another order; the graphs recorded and the CUDA memory
held afterwards. With ``--kernel-table``, after each length's timed calls, ``--kernel-table-steps``
more forwards of it under ``torch.profiler``: the kernels a forward runs, per mode and length.

All modes share one model object: ``nn.Module.compile`` (what ``torch.compile(model, ...)`` does,
but in place) so that ``generate``, which calls ``self(...)``, runs the compiled forward too; the
compiled call is dropped after the mode. The ``--hf-*`` arguments are ``hf_args.py``'s.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time

import torch

from . import compile_stats, environment, hf_report, kernel_table, report, variants
from .row_kernels import guarded_table
from .hf_args import check_model_spec, fill_defaults
from .hf_presets import build_preset_model
from .workloads import Timer

# torch.compile keyword arguments of each mode of hf_args.HF_MODES (None: not compiled)
MODE_COMPILE_KWARGS: dict[str, dict | None] = {
    "eager": None,
    "compile-default": {"dynamic": True},
    "compile-reduce-overhead": {"mode": "reduce-overhead", "dynamic": True},
    "tscompile": {"backend": "tscompile", "mode": "reduce-overhead", "dynamic": True},
    "tscompile-split": {"backend": "tscompile", "dynamic": True, "options": {"split_sdpa": True, "cudagraphs": True}},
}


def compile_kwargs(label: str, kernel_variants: dict[str, dict] | None = None) -> dict | None:
    """The ``torch.compile`` arguments of a row label: its mode's, with a kernel variant's
    (``tscompile-split@NAME``, ``bench/variants.py``) KernelPolicy fields laid over its options."""
    base, name = variants.split(label)
    kwargs = MODE_COMPILE_KWARGS[base]
    if name is None:
        return kwargs
    kwargs = copy.deepcopy(kwargs)
    kwargs["options"] = variants.compile_options(kwargs.get("options"), (kernel_variants or {})[name])
    return kwargs


def generate_compile_kwargs(mode: str, kernel_variants: dict[str, dict] | None = None) -> dict | None:
    """The mode's ``torch.compile`` arguments for the static-cache ``generate``, compiled afresh (no
    graph of the forward part is reused): the forward's own, ``dynamic=True`` included.

    Measured on the H200 (torch 2.11, transformers 5.17), stock and tscompile alike: under
    ``mode="reduce-overhead"``, ``dynamic=True`` fails to lower the static cache's lazy
    initialisation ("indices must be int64, byte or bool. Got [torch.float64]": an error row), and
    without ``dynamic=True`` the process crashed with a segmentation fault after Inductor skipped the
    prompt's graph for its mutated inputs (the cache's ``cumulative_length.add_``), taking every
    later mode with it. So the arguments stay the forward's, whose failure is an error row."""
    return compile_kwargs(mode, kernel_variants)


# modes whose outputs live in the memory of Inductor's CUDA-graph trees: a later replay overwrites
# them unless the caller marks a new step (torch.compiler.cudagraph_mark_step_begin) first
GRAPH_TREE_MODES = ("compile-reduce-overhead", "tscompile")
GENERATE_PROMPT_LEN = 32
TSCOMPILE_USER_KEYS = ("user_captures", "user_replays", "user_whole_graphs", "user_padded_pieces", "user_padded_runs",
                       "user_live_pieces", "user_above_ladder", "user_graphs_refused", "graphs", "pieces_compiled",
                       "breaks")


# -- the model -------------------------------------------------------------------------------------
def load_hf_model(spec: str, dtype: torch.dtype, device: torch.device, seed: int):
    """A transformers causal LM on ``device`` in ``dtype``, SDPA attention (``split_sdpa`` breaks at
    it): a checkpoint directory's weights, or a preset's shape in its family's transformers config
    with weights drawn by transformers' own initialisation under ``seed`` (``hf_presets.py``)."""
    import transformers

    if check_model_spec(spec) == "checkpoint":
        model = transformers.AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, attn_implementation="sdpa")
        return model.to(device).eval()
    return build_preset_model(spec, dtype, device, seed)


def _prompt(seed: int, length: int, vocab: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100003 + length)
    return torch.randint(0, vocab, (1, length), generator=g).to(device)


# -- counters --------------------------------------------------------------------------------------
def counter_snapshot() -> dict:
    """Dynamo's process-wide counters (graphs, frames, recompiles, breaks, CUDA-graph skips) beside
    tscompile's; figures are differences of two snapshots (``counter_delta``)."""
    import torch._dynamo.utils as dynamo_utils

    from tscompile.counters import counters as ts

    dyn = dynamo_utils.counters
    base = compile_stats.snapshot()
    return {"graphs_compiled": base["graphs_compiled"], "recompile_records": base["recompile_records"],
            "graph_breaks": base["graph_breaks"], "frames_total": dyn["frames"]["total"],
            "frames_ok": dyn["frames"]["ok"], "cudagraph_skips": dyn["inductor"]["cudagraph_skips"],
            **{k: ts[k] for k in TSCOMPILE_USER_KEYS}}


def counter_delta(before: dict, after: dict) -> dict:
    out = {k: after[k] - before[k] for k in after if k != "recompile_records"}
    out["recompiles"] = after["recompile_records"] - before["recompile_records"]
    return out


# -- one mode --------------------------------------------------------------------------------------
def _token_clock():
    """A ``generate`` streamer that timestamps every ``put``: the prompt's (before the prefill),
    then one per new token. ``put`` gets CPU tensors (transformers copies, which synchronizes)."""
    from transformers.generation.streamers import BaseStreamer

    class TokenClock(BaseStreamer):
        def __init__(self):
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    return TokenClock()


def _spread(ms: list[float]) -> dict:
    ms = sorted(ms)
    return {"median": statistics.median(ms), "min": ms[0], "max": ms[-1]}


class HFBench:
    def __init__(self, args: argparse.Namespace, device: torch.device, dtype: torch.dtype, model):
        self.args, self.device, self.dtype, self.model = args, device, dtype, model
        self.vocab = model.config.vocab_size
        self.rows: list[dict] = []
        self.eager_last_logits: dict[int, torch.Tensor] = {}  # length -> eager's last logits row (float32, cpu)
        self.eager_tokens: list[int] | None = None

    def _forward(self, call, ids: torch.Tensor, mode: str) -> torch.Tensor:
        if variants.split(mode)[0] in GRAPH_TREE_MODES:
            # stock reduce-overhead (and tscompile's unsplit graph under the same trees): the previous
            # call's outputs are dead, so the trees may replay into their memory
            torch.compiler.cudagraph_mark_step_begin()
        return call(input_ids=ids, use_cache=self.args.use_cache).logits

    def forward_rows(self, mode: str, row: dict, bar) -> None:
        a, model = self.args, self.model
        row["lengths"] = {}
        snap0 = counter_snapshot()
        with torch.no_grad():
            for i, length in enumerate(a.hf_lens):
                bar.set_postfix_str(f"{mode} forward {length}")
                ids = _prompt(a.seed, length, self.vocab, self.device)
                for w in range(a.hf_warmups):
                    t0 = time.perf_counter()
                    with Timer(self.device):
                        logits = self._forward(model, ids, mode)
                        last = logits[0, -1].float().cpu()  # copied out before any later call overwrites it
                    if i == 0 and w == 0:
                        row["first_call_s"] = time.perf_counter() - t0
                        row["counters_first_call"] = counter_delta(snap0, counter_snapshot())
                        snap1 = counter_snapshot()
                del logits
                times = []
                for _ in range(a.num_iters):
                    with Timer(self.device) as timer:
                        self._forward(model, ids, mode)
                    times.append(timer.seconds * 1e3)
                entry = {f"ms_{k}": v for k, v in _spread(times).items()}
                if a.kernel_table:
                    entry["kernel_table"] = guarded_table(lambda: self._forward_kernels(model, ids, mode), a.verbose)
                # the last warm-up's row: under the trees, the call that recorded the graph
                if mode == "eager":
                    self.eager_last_logits[length] = last
                ref = self.eager_last_logits.get(length)
                entry["max_abs_diff_vs_eager"] = float((last - ref).abs().max()) if ref is not None else None
                row["lengths"][str(length)] = entry
                bar.update(1)
        snap2 = counter_snapshot()
        row["counters_after_first_call"] = counter_delta(snap1, snap2)
        row["counters_forward"] = counter_delta(snap0, snap2)
        row["recompiles_after_first_call"] = row["counters_after_first_call"]["recompiles"]
        row["graphs_after_first_call"] = row["counters_after_first_call"]["graphs_compiled"]
        diffs = [e["max_abs_diff_vs_eager"] for e in row["lengths"].values() if e["max_abs_diff_vs_eager"] is not None]
        row["max_abs_diff_vs_eager"] = max(diffs) if diffs else None

    def _forward_kernels(self, model, ids: torch.Tensor, mode: str) -> dict:
        """``--kernel-table-steps`` forwards of ``ids``, profiled whole (bound by FLOPs: no bandwidth)."""
        a = self.args
        prof = kernel_table.profile_calls(lambda: self._forward(model, ids, mode), a.kernel_table_steps,
                                          self.device.type)
        return kernel_table.table(kernel_table.stats_of(prof, self.device.type, self.dtype.itemsize),
                                  a.kernel_table_steps, self.device.type, a.kernel_table_top,
                                  timeline=kernel_table.timeline_of(prof, self.device.type))

    def stream_row(self, mode: str, row: dict, bar) -> None:
        """Every stream length once from a fresh compile, then again in another order: wall times,
        graphs recorded, CUDA memory held after the stream and at its peak (both less what was held
        before the compile)."""
        a, cuda = self.args, self.device.type == "cuda"
        lengths = stream_lengths(a.seed, a.hf_stream_prompts, *a.hf_stream_lens)
        prompts = {n: _prompt(a.seed + 2, n, self.vocab, self.device) for n in lengths}
        again = list(reversed(lengths))
        bar.set_postfix_str(f"{mode} stream")
        snap0, trees0 = counter_snapshot(), _tree_graphs(self.device)
        reserved0 = _settled_reserved(self.device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        with torch.no_grad():
            passes = []
            for order in (lengths, again):
                start = time.perf_counter()
                for n in order:
                    self._forward(self.model, prompts[n], mode)
                if cuda:
                    torch.cuda.synchronize(self.device)
                passes.append(time.perf_counter() - start)
        delta = counter_delta(snap0, counter_snapshot())
        trees = _tree_graphs(self.device)
        held = _settled_reserved(self.device)
        row["stream"] = {
            "prompts": len(lengths), "lens": list(a.hf_stream_lens), "first_pass_s": passes[0],
            "second_pass_s": passes[1], "second_pass_ms_per_prompt": passes[1] / len(lengths) * 1e3,
            "recompiles": delta["recompiles"], "graphs_compiled": delta["graphs_compiled"],
            "graphs_recorded": (trees - trees0 if cuda else 0) + delta["user_captures"],
            "held_gib": (held - reserved0) / 2**30 if cuda else None,
            "peak_gib": (torch.cuda.max_memory_reserved(self.device) - reserved0) / 2**30 if cuda else None,
            "counters": delta}
        bar.update(1)

    def _generate(self, ids: torch.Tensor) -> tuple[list[int], object, float]:
        n = self.args.hf_generate_tokens
        clock = _token_clock()
        t0 = time.perf_counter()
        # disable_compile: transformers would otherwise compile the static-cache decode itself (on
        # CUDA), and eager would not be eager; min_new_tokens: a checkpoint's eos does not cut a run short
        out = self.model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  cache_implementation="static", disable_compile=True, streamer=clock)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return out[0, ids.shape[1]:].tolist(), clock, time.perf_counter() - t0

    def generate_row(self, mode: str, row: dict, bar) -> None:
        a = self.args
        bar.set_postfix_str(f"{mode} generate")
        ids = _prompt(a.seed + 1, GENERATE_PROMPT_LEN, self.vocab, self.device)
        snap0 = counter_snapshot()
        with torch.no_grad():
            tokens, _, row["generate_first_call_s"] = self._generate(ids)
            snap1 = counter_snapshot()
            per_token, first_token, totals = [], [], []
            for _ in range(a.num_iters):
                again, clock, total = self._generate(ids)
                if again != tokens:
                    raise RuntimeError("greedy generate gave different tokens on a repeated call")
                t = clock.times
                first_token.append((t[1] - t[0]) * 1e3)
                totals.append(total * 1e3)
                if len(t) > 2:  # the decode steps only: from the first new token to the last
                    per_token.append((t[-1] - t[1]) / (len(t) - 2) * 1e3)
        row["counters_generate_first_call"] = counter_delta(snap0, snap1)
        row["counters_generate_timed"] = counter_delta(snap1, counter_snapshot())
        row["generate_tokens"] = tokens
        row["generate_ms_per_token"] = statistics.median(per_token) if per_token else None
        row["generate_ms_per_token_spread"] = _spread(per_token) if per_token else None
        row["generate_first_token_ms"] = statistics.median(first_token)
        row["generate_total_ms"] = statistics.median(totals)
        if mode == "eager":
            self.eager_tokens = tokens
        row["tokens_vs_eager"] = _compare_tokens(tokens, self.eager_tokens)
        bar.update(1)

    def run_mode(self, mode: str, bar) -> dict:
        given = variants.parse(getattr(self.args, "kernel_variants", None))
        forward_kwargs = compile_kwargs(mode, given)
        row: dict = {"mode": mode, "error": None, "compile_kwargs": forward_kwargs,
                     "generate_compile_kwargs": generate_compile_kwargs(mode, given)}
        self.rows.append(row)
        torch._dynamo.reset()
        errors = []
        try:
            parts = {"forward": (self.forward_rows, len(self.args.hf_lens), forward_kwargs),
                     "generate": (self.generate_row, 1, row["generate_compile_kwargs"]),
                     "stream": (self.stream_row, 1, forward_kwargs)}
            for part in self.args.hf_parts:
                fn, steps, kwargs = parts[part]
                done = bar.n
                try:
                    self._compile(kwargs)
                    fn(mode, row, bar)
                except Exception as e:  # noqa: BLE001  (a failed part is an error in the row; the rest runs)
                    errors.append(f"{part}: {self._report(mode, part, e, bar)}")
                    bar.update(steps - (bar.n - done))
        finally:
            self.model._compiled_call_impl = None  # back to eager for the next mode
            torch._dynamo.reset()
            gc.collect()  # the compiled pieces and their CUDA graphs (memory pools) go with the mode
            if self.device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        row["error"] = "; ".join(errors) or None
        return row

    def _compile(self, kwargs: dict | None) -> None:
        """Each part compiles afresh: its own ``torch.compile`` arguments, no graphs of the other part."""
        self.model._compiled_call_impl = None
        torch._dynamo.reset()
        if kwargs is not None:
            self.model.compile(**kwargs)

    def _report(self, mode: str, where: str, e: BaseException, bar) -> str:
        return report.report_failure(mode, where, e, bar, self.args.verbose)


def stream_lengths(seed: int, count: int, lo: int, hi: int) -> list[int]:
    """``count`` distinct prompt lengths from ``lo..hi`` in a seeded random order."""
    g = torch.Generator().manual_seed(seed)
    picks = torch.randperm(hi - lo + 1, generator=g)[:count] + lo
    return picks.tolist()


def _settled_reserved(device: torch.device) -> int | None:
    """CUDA memory reserved once dead tensors are collected and the allocator's free blocks are handed
    back: what live tensors and graph pools hold (the previous part's cached blocks would otherwise
    hide a mode's new allocations)."""
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)


def _tree_graphs(device: torch.device) -> int | None:
    """The graphs Inductor's CUDA-graph trees have recorded on ``device`` (0 before any), or None off CUDA."""
    if device.type != "cuda":
        return None
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_container(device.index or 0).tree_manager
    if manager is None:
        return 0
    # itertools.count has no read: its repr is "count(N)", N the next graph id
    return int(repr(manager.graph_counter).removeprefix("count(").removesuffix(")"))


def _compare_tokens(tokens: list[int], eager: list[int] | None) -> str | None:
    """"same", "differs at step K" (0 = the first new token), or None without eager's tokens."""
    if eager is None:
        return None
    for k, (x, y) in enumerate(zip(tokens, eager)):
        if x != y:
            return f"differs at step {k}"
    return "same" if len(tokens) == len(eager) else f"differs at step {min(len(tokens), len(eager))}"


# -- orchestration ---------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from tscompile.utils import resolve_dtype

    device = fill_defaults(args)
    dtype = resolve_dtype(args.dtype, device)
    threads = torch.get_num_threads()
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    metrics_limit = compile_stats.keep_compilation_metrics()
    try:
        return _run(args, device, dtype, tqdm)
    finally:
        compile_stats.restore_compilation_metrics(metrics_limit)
        torch.set_num_threads(threads)


def _environment(device: torch.device) -> dict:
    import transformers

    return {**environment.environment(device), "transformers_version": transformers.__version__,
            "torch_threads": torch.get_num_threads()}


def _run(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, tqdm) -> int:
    import tscompile  # noqa: F401  (registers backend="tscompile" in this process, entry point or not)

    # each tscompile-split row again per kernel variant (refused before the model loads where none runs)
    modes = variants.labelled(args.hf_modes, variants.parse(getattr(args, "kernel_variants", None)))
    env = _environment(device)
    t0 = time.perf_counter()
    model = load_hf_model(args.hf_model, dtype, device, args.seed)
    load_s = time.perf_counter() - t0
    bench = HFBench(args, device, dtype, model)

    def save(complete: bool) -> tuple[dict, str]:
        result = {"date": report.now_iso(), "kind": "hf-model", "hf_model": args.hf_model,
                  "hf_model_kind": args.hf_model_kind, "model_config": model.config.to_dict(),
                  "model_class": type(model).__name__, "device": str(device), "dtype": args.dtype,
                  "gpu_name": env.get("gpu_name"), "torch_version": torch.__version__,
                  "transformers_version": env["transformers_version"], "env": env, "load_s": load_s,
                  "args": {k: v for k, v in vars(args).items() if not callable(v)}, "modes_run": modes,
                  "complete": complete, "rows": bench.rows}
        md = hf_report.markdown(result)
        report.write_outputs(result, md, args)
        return result, md

    total = len(modes) * (len(args.hf_lens) * ("forward" in args.hf_parts) + ("generate" in args.hf_parts)
                          + ("stream" in args.hf_parts))
    with torch._dynamo.config.patch(cache_size_limit=64), \
            tqdm(total=total, desc="bench --hf-model", disable=args.no_progress, file=sys.stderr) as bar:
        for mode in modes:
            bench.run_mode(mode, bar)
            save(complete=False)  # a run cut short keeps the modes it finished
    _, md = save(complete=True)
    print(md)
    return 0 if any(not r["error"] for r in bench.rows if r["mode"] in args.hf_requested) else 1
