"""scripts/startup.py: the compile-phase profile that explains a cold start's compile time."""

import importlib.util
from pathlib import Path

import torch

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "startup.py"
_spec = importlib.util.spec_from_file_location("startup_script", _PATH)
startup = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(startup)


def test_compile_phases_sum_this_process_compiles_and_keep_only_named_phases():
    before = startup._compile_phases().get("_compile.compile_inner", 0.0)
    fn = torch.compile(lambda x: torch.cos(x) * 3 + x.sum(), backend="inductor")
    fn(torch.randn(17))
    phases = startup._compile_phases()
    assert set(phases) <= set(startup.PHASES)
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
    md = startup.markdown(result)
    assert "| Dynamo, all in (tracing plus the backend) (`_compile.compile_inner`) | 6.0 | 1.5 |" in md
    assert "(`create_aot_dispatcher_function`) | 4.2 | - |" in md
    del result["starts"]["cold"]["compile_phases"]
    assert "Where the compile time goes" not in startup.markdown(result)
