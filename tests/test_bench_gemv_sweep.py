"""``tscompile bench --gemv-sweep``: the projection shapes of any model, the launches timed at each
row count, every launch checked before it is timed, and a JSON the launch-table readers take. On the
CPU the kernel runs in the Triton interpreter (its times say nothing about a GPU; the logic is what
is tested)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tscompile.bench import cli, gemv_sweep
from tscompile.custom_ops import triton_gemv as tg


def test_projection_shapes_come_from_the_model_built_on_the_meta_device():
    assert gemv_sweep.projection_shapes("llama-8b") == {
        (6144, 4096): ["layers.attention.wqkv"], (4096, 4096): ["layers.attention.wo"],
        (28672, 4096): ["layers.feed_forward.w13"], (4096, 14336): ["layers.feed_forward.w2"],
        (128256, 4096): ["output"]}
    hybrid = gemv_sweep.projection_shapes("qwen3-next-1b")
    # the Gated DeltaNet projections beside attention's; one shape, every projection that has it
    assert hybrid[(12352, 2048)] == ["layers.linear_attn.in_proj"]
    assert set(hybrid[(2048, 4096)]) == {"layers.linear_attn.out_proj", "layers.feed_forward.w2",
                                         "layers.attention.wo"}
    assert (151936, 2048) in hybrid


def test_acc_launches_run_at_every_row_count_whose_accumulator_fits_in_registers():
    at_one, at_four = gemv_sweep.launches(1, 4096, 4096, ["acc"]), gemv_sweep.launches(4, 4096, 4096, ["acc"])
    assert (1, 2048, 1, 8, 1, "acc") in at_one and (1, 2048, 1, 8, 1, "acc") in at_four
    assert (4, 2048, 1, 16, 1, "acc") in at_four and (4, 2048, 2, 16, 1, "acc_sum") in at_four
    assert (2, 4096, 1, 8, 1, "acc") in at_four
    # 4 x 4096 on 4 warps holds 128 floats a thread at one row, 512 at four: spilled, not timed
    assert (4, 4096, 1, 4, 1, "acc") in at_one and (4, 4096, 1, 4, 1, "acc") not in at_four
    assert all(gemv_sweep.acc_fits(4, c[0], c[1], c[3]) for c in at_four if c[5].startswith("acc"))
    assert at_four[0] == tg.default_config(4, 4096, 4096)  # the module's own launch is always timed
    assert all(c[5].startswith("dot") for c in gemv_sweep.launches(16, 4096, 4096, ["fma", "dot"])[1:])
    for config in gemv_sweep.launches(8, 4096, 4096):
        assert tg.check_config(config) == config
    # a split the kernel would reduce is not timed twice: one launch per split that runs
    for m in (1, 4, 8):
        runs = [(c[:2] + c[3:], tg.split_layout(4096, c[1], c[2])[0]) for c in gemv_sweep.launches(m, 4096, 4096)]
        assert len(runs) == len(set(runs)), m
    assert not any(c[1] == 4096 and c[5] == "acc_sum" for c in at_four)  # K = 4096 in one chunk: no split


@pytest.fixture
def small_grid(monkeypatch):
    """One tile per kind, one timed call per launch: an interpreter run of seconds."""
    monkeypatch.setattr(gemv_sweep, "TILES", {"acc": [(2, 256, 4, 1, "acc")], "fma": [(8, 128, 4, 2, "fma")],
                                              "dot": [(16, 64, 4, 2, "dot")]})
    monkeypatch.setattr(gemv_sweep, "SUM_SPLITS", (2,))
    monkeypatch.setattr(gemv_sweep, "CPU_REPEATS", 1)


def _sweep(tmp_path, *flags):
    out = tmp_path / "sweep.json"
    assert cli.main(["--gemv-sweep", "--model", "llama-tiny", "--device", "cpu", "--gemv-shapes", "layers.attention.wo",
                     "--output-json", str(out), "--output-md", str(tmp_path / "sweep.md"), "--no-progress",
                     *flags]) == 0
    return json.loads(out.read_text())


def test_a_sweep_checks_every_launch_and_its_json_feeds_the_launch_tables(tmp_path, small_grid):
    result = _sweep(tmp_path, "--gemv-rows", "1,4", "--gemv-modes", "acc", "fma")
    assert result["rows_m"] == [1, 4] and result["env"]["torch_version"] == torch.__version__
    rows = result["rows"]
    assert [(r["shape"], r["n"], r["k"], r["m"]) for r in rows] == [("llama-tiny/layers.attention.wo", 256, 256, 1),
                                                                     ("llama-tiny/layers.attention.wo", 256, 256, 4)]
    for r in rows:
        assert set(r["cublas"]) == {"matmul", "linear"}
        launched = {tuple(entry["launch"]) for entry in r["triton"].values()}
        assert launched == set(gemv_sweep.launches(r["m"], 256, 256, ["acc", "fma"]))
        for entry in r["triton"].values():  # float32: every launch agrees with the product and is timed
            assert entry["max_diff"] <= 1e-4 and entry["s"] > 0
    summary = result["summary"]["llama-tiny/layers.attention.wo"]
    best = {m: e["best"] for m, e in summary["best_by_m"].items()}
    assert set(best) == {"1", "4"} and summary["best_m1"] == best["1"]
    # the readers of the launch tables take the file as written; with cuBLAS made slow on paper, every
    # row's pick becomes an entry
    for e in summary["best_by_m"].values():
        e["speedup"] = 2.0
    summary["speedup_m1"] = 2.0
    assert tg.decode_table_from_sweep(result) == {(256, 256): tuple(best["1"])}
    assert tg.batch_table_from_sweep(result) == {(4, 256, 256): tuple(best["4"])}
    md = (tmp_path / "sweep.md").read_text()
    assert "| layers.attention.wo | 256 | 256 | 4 |" in md and "DECODE_GEMV_CONFIGS: none" in md


def test_a_wrong_launch_is_recorded_and_never_picked(tmp_path, small_grid, monkeypatch):
    bad = (8, 128, 1, 4, 2, "fma")
    real = tg.gemv

    def gemv(x, w, out=None, config=None, **kw):
        result = real(x, w, out, config=config, **kw)
        if config == bad:
            out[:, 0] += 1.0  # one wrong column
        return result

    monkeypatch.setattr(tg, "gemv", gemv)
    result = _sweep(tmp_path, "--gemv-rows", "2", "--gemv-modes", "fma")
    entry = result["rows"][0]["triton"][",".join(map(str, bad))]
    assert entry["max_diff"] == pytest.approx(1.0, abs=1e-3) and "s" not in entry
    assert result["summary"]["llama-tiny/layers.attention.wo"]["best_by_m"]["2"]["best"] != list(bad)


@pytest.mark.parametrize("flags,words", [
    (["--gemv-rows", "0"], r"--gemv-rows \[0\] outside \[1, 32\]"),
    (["--gemv-rows", "4,33"], r"--gemv-rows \[33\] outside \[1, 32\]"),
    (["--gemv-rows", "one"], r"--gemv-rows 'one' must be comma-separated row counts"),
    (["--speculative", "ngram"], r"--gemv-sweep times kernels alone and runs no engine; leave out --speculative"),
    (["--compare", "a.json", "b.json"], r"--gemv-sweep times kernels alone and runs no engine; leave out --compare"),
    (["--gemv-shapes", "wqkv"], r"--gemv-shapes \['wqkv'\] names no projection of llama-tiny; its projections: "
                                r"\['layers.attention.wo', 'layers.attention.wqkv'"),
])
def test_bad_sweep_flags_are_refused(tmp_path, capsys, flags, words):
    assert cli.main(["--gemv-sweep", "--model", "llama-tiny", "--device", "cpu", "--output-json",
                     str(tmp_path / "x.json"), *flags]) != 0
    assert re.search(r"^tscompile: " + words, capsys.readouterr().err, re.MULTILINE)
    assert not (tmp_path / "x.json").exists()
