"""scripts/decode_attn_sweep.py on the CPU (Triton interpreter, tiny shape): every setting is checked
against the float32 oracle before it is timed, a setting that does not match is listed with its error
and no time, the split-count rows run the fastest tile settings, and the module's defaults come back."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tscompile.custom_ops import triton_attention as ta

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "decode_attn_sweep.py"
_spec = importlib.util.spec_from_file_location("decode_attn_sweep", _PATH)
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)

TINY = ["--device", "cpu", "--hq", "4", "--hkv", "2", "--d", "16", "--page", "4", "--ctx", "22", "--max-kv", "32",
        "--static-len", "24", "--layers", "2", "--reps", "1", "--block-n", "16", "--warps", "4", "--stages", "1",
        "--min-split-tokens", "4"]


@pytest.fixture
def restore_min_split(monkeypatch):
    monkeypatch.setattr(ta, "DECODE_MIN_SPLIT_TOKENS", ta.DECODE_MIN_SPLIT_TOKENS)


def test_sweep_checks_each_setting_times_it_and_restores_the_defaults(tmp_path, restore_min_split):
    defaults = {k: getattr(ta, k) for k in sweep.KNOBS}
    assert sweep.main([*TINY, "--bs", "3", "--targets", "4", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "decode_attn_sweep.json").read_text())
    rows = result["per_bs"][0]["rows"]
    assert {r["what"] for r in rows} == {"default", "tile", "splits", "sdpa static cache (enable_gqa, mask)"}
    for r in rows:
        assert r["error"] is None, r
        assert r["max_abs_err"] < 1e-4 and r["us_per_layer"] > 0  # float32 on the CPU: oracle-close
    by_what = {r["what"]: r for r in rows}
    assert by_what["tile"]["splits"] > 1  # the combine kernel ran: splits of 16 over 22 positions
    assert by_what["splits"]["DECODE_TARGET_PROGRAMS"] == 4 and by_what["splits"]["splits"] == 1
    assert {k: getattr(ta, k) for k in sweep.KNOBS} == defaults
    assert "### bs=3" in (tmp_path / "decode_attn_sweep.md").read_text()


def test_the_sweep_times_the_engines_decode_path(tmp_path, restore_min_split, monkeypatch):
    """As the engine's op runs it, every timed launch carries the new K/V rows (the same values the
    cache holds, so the oracle still applies)."""
    seen = []
    real = ta.paged_decode

    def spy(*args, new_kv=None, **kw):
        seen.append(new_kv is not None)
        return real(*args, new_kv=new_kv, **kw)

    monkeypatch.setattr(ta, "paged_decode", spy)
    assert sweep.main([*TINY, "--bs", "3", "--targets", "4", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "decode_attn_sweep.json").read_text())["per_bs"][0]["rows"]
    assert rows and all(r["error"] is None for r in rows)
    assert seen and set(seen) == {True}


def test_a_setting_off_the_oracle_is_listed_with_its_error_and_not_timed(tmp_path, restore_min_split):
    assert sweep.main([*TINY, "--bs", "2", "--targets", "4", "--tol", "-1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "decode_attn_sweep.json").read_text())["per_bs"][0]["rows"]
    assert rows and all("against the float32 oracle" in r["error"] and "us_per_layer" not in r for r in rows)
    assert not [r for r in rows if r["what"] == "splits"]  # no timed tile setting to refine
