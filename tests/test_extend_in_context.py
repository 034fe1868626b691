"""scripts/extend_in_context.py on the CPU (Triton interpreter, tiny shape): every configuration is
checked against the float32 oracle before it is timed, the shipped one is timed in all four
surroundings and the others among the MLP's matmuls, a configuration off the oracle is listed with its
error and no time, and a malformed --configs entry is refused."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

from tscompile.custom_ops import triton_extend as te

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "extend_in_context.py"
_spec = importlib.util.spec_from_file_location("extend_in_context", _PATH)
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)

TINY = ["--device", "cpu", "--dtype", "float32", "--hq", "4", "--hkv", "2", "--d", "16", "--tokens", "19",
        "--page", "4", "--max-kv", "32", "--layers", "2", "--reps", "1", "--hidden", "8", "--intermediate", "16"]


def test_each_config_is_checked_then_timed_in_its_surroundings(tmp_path):
    assert script.main([*TINY, "--configs", "32,16,4,1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "extend_in_context.json").read_text())
    shipped, other = result["rows"]
    assert shipped["config"] == list(te.EXTEND_DENSE_CONFIGS[16]) and shipped["shipped"]
    assert other["config"] == [32, 16, 4, 1] and not other["shipped"]
    for row in (shipped, other):
        assert row["error"] is None and row["max_abs_err"] < 1e-4  # float32: oracle-close
    assert set(shipped["times"]) == set(script.CONDITIONS) and set(other["times"]) == {"mlp"}
    assert all(t["kernel_us"] > 0 and t["step_us"] >= t["kernel_us"] for t in shipped["times"].values())
    assert "(32, 16, 4, 1)" in (tmp_path / "extend_in_context.md").read_text()


def test_a_config_off_the_oracle_is_listed_with_its_error_and_not_timed(tmp_path):
    assert script.main([*TINY, "--configs", "--tol", "-1", "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "extend_in_context.json").read_text())["rows"]
    assert "against the float32 oracle" in row["error"] and row["times"] == {}


def test_a_malformed_config_is_refused():
    with pytest.raises(argparse.ArgumentTypeError, match="^tscompile: a config is rows,keys,warps,stages"):
        script.parse_config("64,64,4")
