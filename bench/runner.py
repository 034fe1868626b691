"""``tscompile bench``'s measurement: one ``Bench`` runs every mode's decode and prefill rows over
the same seeded weights, with a float32 reference of the same model for the correctness column."""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import time

import torch

from tscompile.counters import counters
from tscompile.utils import cdiv

from tscompile.kernel_policy import KernelPolicy

from . import (autotune_record, compile_stats, environment, gpu_clocks, impls, reference, report, roofline,
               row_kernels, variants, workloads)
from .package_mode import PACKAGE_MODE, PackageRunner

# engine counters recorded per measured row: they say whether the timed runs replayed graphs, ran
# without them, or captured/compiled something (which would inflate the time)
TIMED_COUNTERS = ("graphs", "prefill_graphed", "prefill_eager", "prefill_captures", "decode_replays", "decode_eager",
                  "decode_captures")

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


def _cleanup(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _fingerprint(model) -> float:
    with torch.no_grad():
        layer = model.layers[0]  # a hybrid model's first layer may be a linear-attention one
        first = layer.attention.wqkv.weight if hasattr(layer, "attention") else layer.linear_attn.in_proj.weight
        return float(model.output.weight[:64].float().sum() + first[:64].float().sum())


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


def rows_to_run(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    """The decode batch sizes and prefill lengths this run measures: all but the skipped ones."""
    skip_decode, skip_prefill = set(getattr(args, "skip_decode", [])), set(getattr(args, "skip_prefill", []))
    return ([bs for bs in args.batch_size if bs not in skip_decode],
            [n for n in args.prefill_lens if n not in skip_prefill])


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
        self.decode_sizes, self.prefill_lens = rows_to_run(args)
        self.tokens: dict[tuple[str, int], list[list[int]]] = {}
        # engine modes: (tokens, log-probabilities) of each batch size's first prompt, for the reference check
        self.logprobs: dict[tuple[str, int], tuple[list[int], list[float]]] = {}
        self.references: dict[int, reference.ReferenceRun] = {}  # batch size -> its first request's run
        self.reference_info: dict = {"error": None, "skipped": bool(getattr(args, "no_reference", False))}
        self.on_row = lambda: None  # called after every row: the caller saves what is measured so far
        self.impls = impls.model_impls(args)  # --model-impl: several label their rows (bench/impls.py)
        self._hf_checkpoint: str | None = None  # --model-impl transformers of a preset: its weights' checkpoint

    # -- the float32 reference ---------------------------------------------------------------------
    def run_reference(self, bar) -> None:
        """Greedy tokens (and each step's top logits) of every batch size's first prompt, float32."""
        from tscompile.models import build_model

        a = self.args
        if getattr(self.cfg, "layer_types", None) is not None:
            self.reference_info["skipped"] = "hybrid"  # the static-cache reference has no linear-attention layers
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
                for bs in self.decode_sizes:
                    prompt = _prompts(a.seed, bs, a.input_len, self.cfg.vocab_size)[0]
                    self.references[bs] = reference.reference_greedy(model, prompt, a.output_len, self.device)
                    bar.update(1)
        except Exception as e:  # noqa: BLE001  (no reference: the rows say so, the modes still run)
            self.reference_info["error"] = self._report("float32 reference", "run", e, bar)
            bar.update(len(self.decode_sizes) - len(self.references))
        self.reference_info["seconds"] = time.perf_counter() - t0
        self.reference_info["runs"] = {
            str(bs): {"tokens": r.tokens, "margins": [reference.margin_at(c, c.ids[0])["margin"] for c in r.steps]}
            for bs, r in self.references.items()}
        del model
        _cleanup(self.device)

    # -- one mode ----------------------------------------------------------------------------------
    def make_runner(self, mode: str, model, model_impl: str | None = None, kernels: dict | None = None):
        """The runner of ``mode`` (a mode's name, no label); an engine mode runs ``model_impl``
        (default: the run's one --model-impl value), a compiled one with ``kernels`` (a variant's
        KernelPolicy fields) over the run's compile options."""
        a = self.args
        if mode in workloads.STATIC_MODES:
            return workloads.StaticCacheRunner(model, mode, self.device)
        budget = a.max_num_batched_tokens or max(max(a.batch_size) * a.input_len, max(a.prefill_lens), 2048)
        if mode == PACKAGE_MODE:
            return PackageRunner(a.model, self.cfg, package=getattr(a, "package", None), device=self.device,
                                 dtype=self.dtype, max_num_seqs=max(a.batch_size), max_model_len=self.max_model_len,
                                 page_size=a.page_size, max_num_batched_tokens=budget, seed=a.seed,
                                 first_prompt=_prompts(a.seed, 1, a.input_len, self.cfg.vocab_size)[0],
                                 cuda_graphs=getattr(a, "package_cuda_graphs", False))
        backend = "torch" if mode == "eager" else mode.removeprefix("tscompile-")
        if mode != "eager":
            ok, why = backend_available(backend, self.device)
            if not ok:
                raise RuntimeError(f"backend {backend!r} unavailable: {why}")
        options = None if mode == "eager" else self.compile_options(kernels)
        impl = model_impl or self.impls[0]
        tp = getattr(a, "tensor_parallel_size", 1)
        return workloads.EngineRunner(self.engine_model(model, impl) if tp == 1 else a.model, attention_backend=backend,
                                      enforce_eager=mode == "eager", device=self.device, dtype=self.dtype,
                                      max_num_seqs=max(a.batch_size), max_model_len=self.max_model_len,
                                      page_size=a.page_size, max_num_batched_tokens=budget, seed=a.seed,
                                      compile_options=options, model_impl=impl,
                                      enable_prefix_caching=not getattr(a, "no_prefix_caching", False),
                                      tensor_parallel_size=tp)

    def compile_options(self, kernels: dict | None) -> dict | None:
        """A compiled engine mode's compile options: the run's, with a variant's ``kernels`` over them."""
        options = getattr(self.args, "tscompile_options", None)
        return variants.compile_options(options, kernels) if kernels else options

    def engine_model(self, model, model_impl: str):
        """What an engine mode builds its ``tscompile.LLM`` from: the mode's native model, or under
        ``--model-impl transformers`` a checkpoint directory of the same weights (the given one, or
        for a preset its seeded weights written once per run by transformers' ``save_pretrained``)."""
        from tscompile.models import is_checkpoint_dir

        if model_impl != "transformers":
            return model
        if is_checkpoint_dir(self.args.model):
            return str(self.args.model)
        if self._hf_checkpoint is None:
            import atexit
            import shutil
            import tempfile

            from tscompile.models.hf_save import save_hf_checkpoint

            folder = tempfile.mkdtemp(prefix="tscompile-bench-hf-")
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            save_hf_checkpoint(model, folder)
            self._hf_checkpoint = folder
        return self._hf_checkpoint

    def decode_row(self, mode: str, runner, bs: int, prev: dict) -> dict:
        a = self.args
        prompts = _prompts(a.seed, bs, a.input_len, self.cfg.vocab_size)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        warm = [runner.run_batch(prompts, a.output_len, per_call=(i == 0)) for i in range(a.num_iters_warmup)]
        before, compiled_before = dict(counters), compile_stats.snapshot()
        with gpu_clocks.ClockSampler(self.device) as clocks:
            runs = [runner.run_batch(prompts, a.output_len) for _ in range(a.num_iters)]
        timed = {k: counters[k] - before.get(k, 0) for k in TIMED_COUNTERS}
        # a compile inside the timed runs would inflate them: Dynamo's side of that, beside the engine's
        compiled = compile_stats.since(compiled_before)
        timed.update(dynamo_graphs_compiled=compiled["graphs_compiled"], dynamo_recompiles=compiled["recompiles"])
        self.tokens[(mode, bs)] = runs[-1].tokens
        if bs in self.references and hasattr(runner, "logprobs_of"):  # an engine mode: untimed, after the runs
            logprobs = runner.logprobs_of(prompts[0], a.output_len)
            if logprobs is not None:
                self.logprobs[(mode, bs)] = logprobs
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
               "timed_runs": timed, "gpu_clocks": clocks.summary}
        if isinstance(runner, workloads.StaticCacheRunner):
            if warm:
                row["compile_s"], row["capture_s"] = workloads.compile_excess(warm[0], ttft_s, tpot_s or 0.0,
                                                                              runner.cudagraphs)
            else:
                row["compile_s"] = row["capture_s"] = None
        else:
            for key, attr in (("compile_s", "compile_seconds"), ("capture_s", "capture_seconds")):
                cur = getattr(runner, attr)
                if cur is None and impls.split_label(mode, self.impls)[0] == "eager":
                    cur = 0.0
                row[key] = None if cur is None else cur - prev.get(key, 0.0)
                prev[key] = cur or 0.0
        row["peak_memory_gib"] = (torch.cuda.max_memory_allocated() / 2**30 if self.device.type == "cuda" else None)
        ctx = roofline.mean_decode_context(a.input_len, a.output_len)
        nbytes = roofline.decode_step_bytes(self.cfg, bs, ctx, self.dtype.itemsize)
        row.update(context_len=ctx, weight_bytes=nbytes.weight_bytes, kv_bytes=nbytes.kv_bytes,
                   state_bytes=nbytes.state_bytes, step_bytes=nbytes.total, roofline_ms=roofline.roofline_ms(nbytes.total, self.bw))
        applies, why = roofline.roofline_applies(self.device, nbytes.total)
        row["roofline_note"] = why or None
        if tpot["median"]:
            # against the median step, the figure the table shows
            row["achieved_gbps"] = nbytes.total / (tpot["median"] / 1e3) / 1e9
            row["pct_of_roofline"] = 100.0 * row["roofline_ms"] / tpot["median"] if applies else None
        return row

    # -- kernel tables (--kernel-table) -------------------------------------------------------------
    def kernel_tables(self, mode: str, runner, bar) -> None:
        """Every measured row of ``mode`` gets its kernel table, after all of the mode's timed rows: a
        finished profiler session can leave the profiling library attached to the process, which may
        slow the host work of what is timed after it, so no timed row of a mode follows one of its profiles."""
        a = self.args
        for row in self.results:
            if row["mode"] == mode and not row.get("error") and "kernel_table" not in row:
                bar.set_postfix_str(f"{mode} kernels bs={row['batch_size']}")
                prompts = _prompts(a.seed, row["batch_size"], a.input_len, self.cfg.vocab_size)
                row["kernel_table"] = row_kernels.guarded_table(
                    lambda: row_kernels.decode_kernel_table(runner, prompts, row, a, self.device, self.dtype), a.verbose)
                self.on_row()
        for row in self.prefill:
            if row["mode"] == mode and not row.get("error") and "kernel_table" not in row:
                bar.set_postfix_str(f"{mode} kernels prefill {row['prompt_len']}")
                prompt = _prompts(a.seed, 1, row["prompt_len"], self.cfg.vocab_size)[0]
                row["kernel_table"] = row_kernels.guarded_table(
                    lambda: row_kernels.prefill_kernel_table(runner, prompt, a, self.device, self.dtype), a.verbose)
                self.on_row()

    def prefill_row(self, mode: str, runner, length: int) -> dict:
        a = self.args
        prompt = _prompts(a.seed, 1, length, self.cfg.vocab_size)[0]
        for _ in range(a.num_iters_warmup):
            runner.run_prefill(prompt)
        before = dict(counters)
        times, launches = [], []
        with gpu_clocks.ClockSampler(self.device) as clocks:
            for _ in range(a.num_iters):
                times.append(runner.run_prefill(prompt))
                if getattr(runner, "host_launch_s", None) is not None:  # the engine's runner: its host share
                    launches.append(runner.host_launch_s)
        times.sort()
        # what the timed runs did: graphed or not, and whether anything was captured or compiled in them
        steps = {k: counters[k] - before.get(k, 0) for k in TIMED_COUNTERS}
        secs = statistics.median(times)  # the median: one slow run (a GC pause, the OS) moves it least
        flops = roofline.prefill_flops(self.cfg, length)
        row = {"mode": mode, "prompt_len": length, "error": None, "prefill_ms": secs * 1e3,
                "prefill_ms_min": times[0] * 1e3, "prefill_ms_max": times[-1] * 1e3,
                "prefill_ms_mean": sum(times) / len(times) * 1e3, "prefill_tokens_per_s": length / secs,
                "prefill_flops": flops, "prefill_tflops": flops / secs / 1e12,
                "mfu": roofline.mfu(flops, secs, self.peak_tflops), "timed_runs": steps,
                "host_launch_ms": statistics.median(launches) * 1e3 if launches else None,
                "gpu_clocks": clocks.summary}
        return row

    def run_mode(self, mode: str, bar) -> None:
        """Every row of one mode; ``mode`` is its row label (``tscompile-triton+transformers`` names
        the transformers implementation's run in a run of several, bench/impls.py)."""
        from tscompile.models import build_model

        a = self.args
        base_label, variant = variants.split(mode)
        plain_mode, impl = impls.split_label(base_label, self.impls)
        kernels = variants.parse(getattr(a, "kernel_variants", None))[variant] if variant else None
        info: dict = {"error": None}
        self.modes[mode] = info
        if kernels:
            info["kernel_variant"] = kernels
        if variants.is_variant_mode(plain_mode):  # the kernel choices this mode's engine runs with, here
            options = self.compile_options(kernels) or {}
            info["kernel_paths"] = environment.kernel_paths(KernelPolicy.from_options(options.get("kernels")))
        if len(self.impls) > 1 and impls.is_engine_mode(plain_mode):
            info["model_impl"] = impl
        torch._dynamo.reset()
        compiled_before, modules_before = compile_stats.snapshot(), autotune_record.snapshot()

        def note_compiles() -> None:  # after every row, so a run cut short keeps them too
            info["compile_stats"] = compile_stats.since(compiled_before)
            info["recompile_reasons"] = compile_stats.recompile_reasons(compiled_before)
            info["compile_phases"] = compile_stats.compile_phases(compiled_before)
            # the launch configurations Inductor chose at run time (two runs differ there, not in code)
            info["autotuned_kernels"] = autotune_record.collect(modules_before)

        runner = model = None
        try:
            t0 = time.perf_counter()
            sharded = getattr(a, "tensor_parallel_size", 1) > 1 and plain_mode not in workloads.STATIC_MODES
            if plain_mode != PACKAGE_MODE and not sharded:  # a package brings its own weights; ranks build their shards
                model = build_model(a.model, dtype=self.dtype, device=self.device, seed=a.seed)
                info["weights_fingerprint"] = _fingerprint(model)
            runner = self.make_runner(plain_mode, model, impl, kernels)
            info["setup_s"] = time.perf_counter() - t0
            if isinstance(runner, workloads.StaticCacheRunner):
                info["gqa"], info["gqa_why"] = runner.gqa, runner.gqa_why
            if isinstance(runner, PackageRunner):
                info.update(runner.info())
        except Exception as e:  # noqa: BLE001
            info["error"] = self._report(mode, "setup", e, bar)
        prev: dict = {}
        for bs in self.decode_sizes:
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
        for length in self.prefill_lens:
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
        if getattr(a, "kernel_table", False) and runner is not None:
            self.kernel_tables(mode, runner, bar)
        for key in ("compile_s", "capture_s"):
            vals = [r.get(key) for r in self.results if r["mode"] == mode and not r.get("error")]
            info[key] = sum(vals) if vals and None not in vals else None
        if runner is not None:
            runner.close()
        del runner, model
        torch._dynamo.reset()
        _cleanup(self.device)

    def _report(self, mode: str, where: str, e: BaseException, bar) -> str:
        return report.report_failure(mode, where, e, bar, self.args.verbose)

    def mark_agreement(self) -> None:
        """``reference_check``: the first request's greedy tokens against the float32 reference's
        (``reference.compare``; in a float32 run any difference fails); ``match_eager``: how many
        requests' tokens equal eager's (of the row's own implementation) at the same batch size (a
        consistency figure, not a correctness check: eager runs in the bench dtype too)."""
        threshold = self.args.margin_threshold
        exact = self.dtype == torch.float32  # the reference's own dtype: any difference is a bug
        for row in self.results:
            got = self.tokens.get((row["mode"], row["batch_size"]))
            if got is None:
                continue
            ref = self.references.get(row["batch_size"])
            if ref is not None:
                row["reference_check"] = reference.compare(ref, got[0], threshold, exact=exact,
                                                           logprobs=self.logprobs.get((row["mode"], row["batch_size"])))
            elif self.reference_info.get("error"):
                row["reference_check"] = {"error": self.reference_info["error"]}
            eager = self.tokens.get((impls.same_impl(variants.split(row["mode"])[0], "eager"), row["batch_size"]))
            if eager is not None:
                row["match_eager"] = f"{sum(x == y for x, y in zip(got, eager))}/{len(eager)}"

    def failed_checks(self) -> list[str]:
        """The rows whose float32 check failed, as "mode bs=N" (the bench exits non-zero on any)."""
        return [f"{r['mode']} bs={r['batch_size']}" for r in self.results if reference.failed(r.get("reference_check"))]
