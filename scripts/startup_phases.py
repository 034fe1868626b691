"""The phases ``scripts/startup.py`` times inside a start: ``PhaseTimer`` wraps what
``tscompile.LLM(...)`` calls while it is built (``INIT_PHASES``), and ``compile_phases`` reads
torch.compile's own timers (``PHASES``). Only the standard library at import: a child process's
imports are timed, so torch and tscompile load inside the functions, where the start imports them
anyway."""

from __future__ import annotations

import time


class PhaseTimer:
    """Wall time of wrapped functions, each call's own time only: a wrapped function called inside
    another is a phase of its own, named ``outer/inner``, and its time is not the outer one's, so the
    phases never overlap and sum to at most the time around them. ``exclude(*args)`` reads seconds
    that other figures report already (a runner's compile and capture); what it grew by during a call
    is taken off that call."""

    def __init__(self):
        self.spent: dict[str, float] = {}  # in the order the phases first ran
        self._open: list[list] = []  # per call in progress: [its name, seconds of wrapped calls inside]

    def wrap(self, name: str, fn, exclude=None):
        def wrapper(*args, **kwargs):
            frame = [f"{self._open[-1][0]}/{name}" if self._open else name, 0.0]
            self.spent.setdefault(frame[0], 0.0)  # listed where it starts: an outer phase before its inner ones
            self._open.append(frame)
            counted = exclude(*args, **kwargs) if exclude is not None else 0.0
            begin = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - begin
                if exclude is not None:
                    counted = exclude(*args, **kwargs) - counted
                self._open.pop()
                self.spent[frame[0]] = self.spent.get(frame[0], 0.0) + elapsed - frame[1] - counted
                if self._open:
                    self._open[-1][1] += elapsed
        return wrapper


# the phases of tscompile.LLM(...) besides compile and capture, by the function each times (the leaf
# of a phase's name: "build/memory_profile/profile_step" is profile_step inside memory_profile)
INIT_PHASES = {
    "validate": "argument checks",
    "compile_config": "compile options to a TscompileConfig",
    "piece_compiler_check": "the piece compiler's import check",
    "build": "build_model_engine, its own lines",
    "attention_router": "the attention backend's router",
    "graph_support": "which CUDA graphs the backend allows",
    "memory_profile": "KV pool sizing from device memory, its own lines (gc, empty_cache, sizing)",
    "profile_step": "the profiled eager step of the largest batch (activation peak)",
    "memory_probe": "reading free device memory (gc, synchronize, empty_cache, mem_get_info)",
    "pool_and_scheduler": "KV pool allocation and the scheduler",
    "runner": "ModelRunner construction (buffers, torch.compile wrappers)",
    "bind_kv_cache": "binding the pool to the model",
    "decode_graphs": "the decode capture path besides compile and capture",
    "prefill_plans": "start-up prefill placeholder plans",
    "prefill_graphs": "start-up prefill capture besides compile and capture",
    "assemble": "the engine over its parts",
}


def time_engine_construction(timer: PhaseTimer) -> None:
    """Wrap what ``tscompile.LLM(...)`` calls while it is built (INIT_PHASES), where it looks it up."""
    from tscompile.config import TscompileConfig
    from tscompile.models import Transformer
    from tscompile.runtime import build, engine, engine_setup
    from tscompile.runtime.model_runner import ModelRunner

    def runner_counted(runner, *args, **kwargs) -> float:  # reported as compile and capture already
        return runner.compile_seconds + runner.capture_seconds

    engine_setup.validate_engine_args = timer.wrap("validate", engine_setup.validate_engine_args)
    TscompileConfig.from_options = classmethod(timer.wrap("compile_config", TscompileConfig.from_options.__func__))
    engine_setup.check_piece_compiler_importable = timer.wrap("piece_compiler_check",
                                                             engine_setup.check_piece_compiler_importable)
    engine_setup.build_model_engine = timer.wrap("build", engine_setup.build_model_engine)
    build.create_attention_router = timer.wrap("attention_router", build.create_attention_router)
    build.resolve_cuda_graph_support = timer.wrap("graph_support", build.resolve_cuda_graph_support)
    build.pages_from_device_memory = timer.wrap("memory_profile", build.pages_from_device_memory)
    build.measure_activation_peak = timer.wrap("profile_step", build.measure_activation_peak)
    build.measure_device_memory = timer.wrap("memory_probe", build.measure_device_memory)
    build._pool_and_scheduler = timer.wrap("pool_and_scheduler", build._pool_and_scheduler)
    build.ModelRunner = timer.wrap("runner", ModelRunner)
    Transformer.bind_kv_cache = timer.wrap("bind_kv_cache", Transformer.bind_kv_cache)
    ModelRunner.capture_decode_graphs = timer.wrap("decode_graphs", ModelRunner.capture_decode_graphs,
                                                   exclude=runner_counted)
    build.startup_plans = timer.wrap("prefill_plans", build.startup_plans)
    ModelRunner.capture_prefill_graphs = timer.wrap("prefill_graphs", ModelRunner.capture_prefill_graphs,
                                                    exclude=runner_counted)
    engine.LLM._assemble = timer.wrap("assemble", engine.LLM._assemble)


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


def compile_phases() -> dict:
    """Seconds per compile phase (PHASES, as torch's compile timers name them in this version; a phase
    it does not time is left out), from ``torch._dynamo.utils.compilation_time_metrics``."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return {}
    totals = {name: sum(values) for name, values in compilation_time_metrics.items() if values}
    return {name: round(totals[name], 3) for name in PHASES if name in totals}
