"""scripts/startup.py: the compile-phase profile that explains a cold start's compile time, and the
phases that explain the rest of a start (the engine's construction, the first calls after it)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shared_packages import BOUNDS, shared_package

_SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(_SCRIPTS))  # startup.py imports its sibling modules, as when it runs from there
_spec = importlib.util.spec_from_file_location("startup_script", _SCRIPTS / "startup.py")
startup = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(startup)
import startup_phases  # noqa: E402  (found through the path above)
import startup_report  # noqa: E402


def test_compile_phases_sum_this_process_compiles_and_keep_only_named_phases():
    before = startup_phases.compile_phases().get("_compile.compile_inner", 0.0)
    fn = torch.compile(lambda x: torch.cos(x) * 3 + x.sum(), backend="inductor")
    fn(torch.randn(17))
    phases = startup_phases.compile_phases()
    assert set(phases) <= set(startup_phases.PHASES)
    assert phases["_compile.compile_inner"] > before
    # nested timers: the backend's share never exceeds Dynamo's all-in figure
    assert phases["OutputGraph.call_user_compiler"] <= phases["_compile.compile_inner"] + 1e-3


def test_markdown_lists_cold_phases_beside_warm_ones_and_dashes_missing_ones():
    base = {"total_s": 10.0, "process_s": 0.1, "imports_s": 2.0, "weights_s": 1.0, "compile_s": 6.0,
            "capture_s": 0.5, "prefill_capture_s": 0.2, "other_s": 0.4}
    result = {"args": {"model": "m", "max_num_seqs": 4, "max_model_len": 64, "prompt_len": 8}, "env": "cpu",
              "starts": {"cold": {**base, "compile_phases": {"_compile.compile_inner": 6.0,
                                                             "create_aot_dispatcher_function": 4.25}},
                         "warm": {**base, "compile_phases": {"_compile.compile_inner": 1.5}}}}
    md = startup_report.markdown(result)
    assert "| Dynamo, all in (tracing plus the backend) (`_compile.compile_inner`) | 6.0 | 1.5 |" in md
    assert "(`create_aot_dispatcher_function`) | 4.2 | - |" in md
    del result["starts"]["cold"]["compile_phases"]
    assert "Where the compile time goes" not in startup_report.markdown(result)


# -- the phase timer -------------------------------------------------------------------------------
class FakeClock:
    """``perf_counter`` for the phase timer: time moves only when a test says so."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


def test_phase_timer_counts_each_call_once_names_inner_phases_and_takes_off_excluded_seconds(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(startup_phases, "time", clock)
    timer = startup_phases.PhaseTimer()
    compiled = {"seconds": 0.0}

    def inner():
        clock.now += 2.0

    def compiling(runner):
        clock.now += 3.0
        runner["seconds"] += 1.25  # of its 3 s, 1.25 s are reported elsewhere (compile)

    def outer():
        clock.now += 1.0
        inner()
        compiling(compiled)
        clock.now += 0.5
        inner()

    inner, compiling = timer.wrap("inner", inner), timer.wrap("compiling", compiling, exclude=lambda r: r["seconds"])
    outer = timer.wrap("outer", outer)
    outer()
    inner()
    assert list(timer.spent) == ["outer", "outer/inner", "outer/compiling", "inner"]  # outer first: it started first
    assert timer.spent == {"outer": 1.5, "outer/inner": 4.0, "outer/compiling": 1.75, "inner": 2.0}
    # disjoint: everything the calls took, less what the exclusion reports, and nothing twice
    assert sum(timer.spent.values()) == clock.now - 100.0 - 1.25


def test_phase_timer_keeps_a_call_that_raises_and_leaves_no_phase_open(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(startup_phases, "time", clock)
    timer = startup_phases.PhaseTimer()

    def fails():
        clock.now += 0.75
        raise KeyError("x")

    fails = timer.wrap("fails", fails)
    with pytest.raises(KeyError):
        fails()
    after = timer.wrap("after", lambda: None)
    after()
    assert timer.spent == {"fails": 0.75, "after": 0.0}  # "after" is not named fails/after


# -- the children on llama-tiny on the CPU ---------------------------------------------------------
SMALL = ["--model", "llama-tiny", "--device", "cpu", "--max-num-seqs", "4", "--max-model-len", "64",
         "--prompt-len", "8"]
TOLERANCE_S = 0.05  # clocks read a few lines apart


def _child_env(tmp_path=None) -> dict:
    """The children's environment: Triton kernels interpreted on the CPU; packages built by a g++ whose
    libraries load (``CXX`` on the GPU machine names one that leaves libstdc++ out; see test_export.py)."""
    env = {**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    if env.get("CXX") and os.path.exists("/usr/bin/g++"):
        env["CXX"] = "/usr/bin/g++"
    if tmp_path is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    return env


def _assert_engine_start_explained(r: dict) -> None:
    assert not r.get("error"), r
    for key in ("engine_init_s", "init_compile_s", "init_capture_s", "first_token_s", "first_token_compile_s",
                "first_token_capture_s", "first_token_other_s", "second_prefill_s", "second_prefill_compile_s",
                "second_prefill_capture_s", "decode_8_tokens_s", "decode_8_compile_s", "decode_8_capture_s", "other_s"):
        assert r[key] >= 0.0, (key, r[key])
    assert r["cuda_init_s"] is None  # the CPU has no CUDA to initialise
    assert r["second_prefill_s"] > 0.0 and r["decode_8_tokens_s"] > 0.0
    assert r["second_prompt_len"] == 8 + startup.SECOND_PROMPT_EXTRA
    phases = r["init_phases"]
    # the engine's construction reached the wrapped functions, inside build_model_engine
    assert {"validate", "build", "build/attention_router", "build/pool_and_scheduler", "build/runner",
            "build/bind_kv_cache", "build/decode_graphs", "assemble"} <= set(phases)
    assert all(secs >= -1e-3 for secs in phases.values()), phases
    # disjoint phases, compile and capture apart: within the construction's time
    assert sum(phases.values()) <= r["engine_init_s"] - r["init_compile_s"] - r["init_capture_s"] + 1e-3
    assert r["other_unexplained_s"] >= -TOLERANCE_S
    assert r["other_unexplained_s"] <= r["other_s"] + 1e-9
    # the top-level parts still add up to the start
    parts = (r["process_s"] + r["imports_s"] + (r["cuda_init_s"] or 0.0) + r["weights_s"] + r["compile_s"]
             + r["capture_s"] + r["other_s"])
    assert abs(parts - r["total_s"]) < 1e-6


def test_engine_child_splits_construction_into_phases_and_times_the_second_prompt(tmp_path):
    # eager: the construction's phases and the prompts after the first run without a compile
    args = startup.parse_args(SMALL + ["--enforce-eager"])
    r = startup._spawn("engine", args, _child_env(tmp_path))
    _assert_engine_start_explained(r)
    assert r["enforce_eager"] and r["compile_s"] == 0.0 and "compile_config" not in r["init_phases"]
    md = startup_report.markdown({"args": vars(args), "env": "cpu", "starts": {"warm": r}})
    assert "| `build/runner` | ModelRunner construction" in md
    assert "| unexplained: other minus the rows above | | " in md
    assert f"| warm | {r['first_token_s']:.2f} | 0.00 | 0.00 | {r['second_prefill_s']:.2f} |" in md


@pytest.mark.slow
def test_compiled_engine_child_keeps_compile_out_of_its_phases(tmp_path):
    args = startup.parse_args(SMALL)
    r = startup._spawn("engine", args, _child_env(tmp_path))
    _assert_engine_start_explained(r)
    assert "compile_config" in r["init_phases"] and "piece_compiler_check" in r["init_phases"]
    assert r["first_token_compile_s"] > 0.0  # the first prefill compiles (on the CPU: no decode graphs at start)
    assert r["first_token_compile_s"] + r["first_token_other_s"] + r["first_token_capture_s"] == \
        pytest.approx(r["first_token_s"])


def test_export_child_exports_the_model_with_the_starts_bounds_and_reports_its_build(tmp_path, monkeypatch):
    """The export child (run in this process) hands export_package the script's model, device, dtype,
    bounds and weights, verified (export_package's default), and reports the build; the export itself
    is export_package's, tested by test_export.py and test_package_load_check.py."""
    import tscompile.export

    calls = []

    def export(model, out, **kw):
        calls.append((model, out, kw))
        return {"build_seconds": 1.5, "compiler": {"command": "g++", "path": "/usr/bin/g++", "source": "default"}}

    monkeypatch.setattr(tscompile.export, "export_package", export)
    package = str(tmp_path / "tiny.pt2")
    r = startup._child_export(startup.parse_args(SMALL + ["--package", package, "--dtype", "float32"]))
    assert calls == [("llama-tiny", package, dict(device="cpu", dtype="float32", max_num_seqs=4, max_model_len=64,
                                                  weights="external"))]
    assert r["build_s"] == 1.5 and r["export_s"] >= 0.0 and r["compiler"]["command"] == "g++"
    startup._child_export(startup.parse_args(SMALL + ["--package", package, "--weights", "inside"]))
    assert calls[1][2]["weights"] == "inside" and calls[1][2]["dtype"] is None


@pytest.mark.slow
def test_package_child_splits_its_first_token_into_first_calls(tmp_path, tmp_path_factory):
    # a package with SMALL's bounds, shared with test_export.py (its export child: the test above)
    package = shared_package(tmp_path_factory, "llama-tiny", device="cpu", weights="inside", bounds=BOUNDS)
    assert (BOUNDS["max_num_seqs"], BOUNDS["max_model_len"]) == (4, 64)  # SMALL's
    args = startup.parse_args(SMALL + ["--package", str(package)])
    r = startup._spawn("package", args, _child_env(tmp_path))
    assert not r.get("error"), r
    for key in ("first_token_s", "second_prefill_s", "decode_8_tokens_s", "load_package_s", "other_s"):
        assert r[key] >= 0.0, (key, r[key])
    assert r["cuda_init_s"] is None
    assert r["weights"] == "inside" and r["weights_s"] is None  # loaded with the libraries: no split
    # the first prompt calls the prefill program, the second prompt calls it again, the 8-token call decodes
    programs = {"prefill", "decode", "prefill_metadata"}
    assert programs <= set(r["first_call_phases"])
    # the attention kernel the programs call back into: its first layer and its second, per kind
    kernels = set(r["first_call_phases"]) - programs
    assert kernels and all(k.startswith("attention_") and k.endswith(("_extend", "_decode")) for k in kernels)
    assert any(k.endswith("_extend") for k in kernels) and any(k.endswith("_decode") for k in kernels)
    assert set(r["second_call_phases"]) == set(r["first_call_phases"])
    assert r["first_call_phases"]["prefill"] <= r["first_token_s"] + 1e-3
    assert r["second_call_phases"]["prefill"] <= r["second_prefill_s"] + 1e-3
    md = startup_report.markdown({"args": vars(args), "env": "cpu", "starts": {"package": r}})
    assert f"| prefill | {r['first_call_phases']['prefill']:.3f} | {r['second_call_phases']['prefill']:.3f} |" in md


def test_markdown_of_a_failed_start_fills_every_column_and_renders_results_without_the_new_fields():
    a = {"model": "m", "max_num_seqs": 4, "max_model_len": 64, "prompt_len": 8}
    old = {"total_s": 10.0, "process_s": 0.1, "imports_s": 2.0, "weights_s": 1.0, "compile_s": 6.0,
           "capture_s": 0.5, "prefill_capture_s": 0.2, "other_s": 0.4}  # a result from before cuda_init_s
    md = startup_report.markdown({"args": a, "env": "cpu", "starts": {"cold": {"error": "boom"}, "warm": old}})
    header = next(line for line in md.splitlines() if line.startswith("| start | to first token"))
    failed = next(line for line in md.splitlines() if line.startswith("| cold |"))
    assert failed.count("|") == header.count("|")
    assert "| warm | 10.0 | 0.1 | 2.0 | - | 1.0 | 6.0 | 0.5 | 0.2 | 0.4 |" in md
    assert "Where the engine's \"other\" goes" not in md and "first calls" not in md


def test_decode_tuning_on_turns_coordinate_descent_on_in_the_engine_the_child_builds(monkeypatch):
    from tscompile.config import TscompileConfig
    from tscompile.runtime.model_runner import decode_static_inductor_options

    off, on = startup.parse_args([]), startup.parse_args(["--decode-tuning", "on"])
    cuda = torch.device("cuda")
    tuned = decode_static_inductor_options(TscompileConfig.from_options(startup.compile_options(on)), cuda)
    untuned = decode_static_inductor_options(TscompileConfig.from_options(startup.compile_options(off)), cuda)
    assert tuned.get("coordinate_descent_tuning") is True
    assert not untuned.get("coordinate_descent_tuning", False)
    # the flag reaches the child processes that build the engines
    spawned = []
    monkeypatch.setattr(startup.subprocess, "run",
                        lambda argv, **kw: spawned.append(argv) or type("R", (), {"returncode": 1, "stdout": ""}))
    assert "error" in startup._spawn("engine", on, {})
    assert spawned[0][spawned[0].index("--decode-tuning") + 1] == "on"


def test_decode_ladder_reaches_the_engine_options_and_the_child_argv(monkeypatch):
    """--decode-ladder 2 4: the children's compile options carry that ladder (so a bs=1 step pads to
    2 and no bs=1 graph is compiled), the spawned child gets the flag, the table says so."""
    args = startup.parse_args(SMALL + ["--decode-ladder", "2", "4"])
    assert startup.compile_options(args)["decode_ladder"] == (2, 4)
    assert "decode_ladder" not in startup.compile_options(startup.parse_args(SMALL))
    seen = {}

    def fake_run(argv, **kw):
        seen["argv"] = argv
        return subprocess.CompletedProcess(argv, 1, stdout="", stderr="")

    monkeypatch.setattr(startup.subprocess, "run", fake_run)
    startup._spawn("engine", args, {})
    i = seen["argv"].index("--decode-ladder")
    assert seen["argv"][i + 1:i + 3] == ["2", "4"]
    assert startup.parse_args(seen["argv"][2:]).decode_ladder == [2, 4]  # the child parses it back
    md = startup_report.markdown({"args": vars(args), "env": "cpu", "starts": {}})
    assert "The engine starts use the decode ladder (2, 4) (--decode-ladder)." in md
