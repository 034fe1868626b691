"""``tscompile bench``: the baselines measure the same model, the roofline byte model, and a CPU smoke run.

No timing is asserted anywhere: only shapes of the output and token agreement.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

import tscompile
from tscompile.bench import cli as bench_cli
from tscompile.bench import roofline
from tscompile.bench.static_cache_model import StaticCacheModel
from tscompile.bench.workloads import StaticCacheRunner
from tscompile.cli import main as tscompile_main
from tscompile.models import PRESETS, build_model
from helpers import ids


@pytest.fixture(autouse=True)
def one_thread():
    """A tiny model gains nothing from intra-op threads, and on a shared host they only contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("max_len", [24, 40])
def test_static_cache_model_greedy_equals_engine(max_len):
    """The compile baselines run the tscompile model's own weights and RoPE: same greedy tokens as the
    eager engine with the torch oracle (float32), whatever the static cache length."""
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(0, PRESETS["llama-tiny"].vocab_size, (2, 11), generator=g)
    model = build_model("llama-tiny", dtype=torch.float32, device="cpu", seed=0)
    runner = StaticCacheRunner(model, "compile-default", torch.device("cpu"), compiled=False, cache_len=max_len)
    static = runner.run_batch(prompts.tolist(), 12).tokens
    llm = tscompile.LLM("llama-tiny", enforce_eager=True, attention_backend="torch", dtype=torch.float32,
                        device="cpu", seed=0, max_model_len=64)
    ref = ids(llm.generate(prompts.tolist(), tscompile.SamplingParams(max_new_tokens=12)))
    assert static == ref


def test_static_cache_model_refuses_narrowing_and_overflow():
    with pytest.raises(ValueError, match="narrowing"):
        StaticCacheModel(build_model("narrow-tiny", seed=0), batch_size=1, max_len=16)
    model = build_model("llama-tiny", seed=0)
    runner = StaticCacheRunner(model, "compile-default", torch.device("cpu"), compiled=False, cache_len=8)
    with pytest.raises(ValueError, match="exceed the static cache"):
        runner.run_batch([[1] * 6], 4)


def test_roofline_bytes_llama_tiny_by_hand():
    cfg = PRESETS["llama-tiny"]  # dim 256, 2 layers, 4 heads, 2 kv heads, head_dim 64, ffn 512, vocab 512
    # per layer: wqkv 256*512 + wo 256*256 + w13 256*1024 + w2 512*256 + norms 2*256 = 590_336
    # 2 layers + final norm 256 + output 512*256 + embedding rows bs*256
    assert roofline.weight_params_per_step(cfg, 1) == 2 * 590_336 + 256 + 131_072 + 256 == 1_312_256
    assert roofline.weight_params_per_step(cfg, 4) == 1_312_256 + 3 * 256
    # KV: 2 layers * (K, V) * 2 kv heads * 64 dims * 4 bytes = 2048 bytes per cached token
    b = roofline.decode_step_bytes(cfg, batch_size=4, context_len=40, dtype_bytes=4)
    assert b.weight_bytes == 4 * 1_313_024 == 5_252_096
    assert b.kv_bytes == 4 * 40 * 2048 == 327_680
    assert b.total == 5_579_776
    # the formula counts what the model holds: every parameter, less the unread embedding rows
    model = build_model("llama-tiny", seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    assert roofline.weight_params_per_step(cfg, 4) == n_params - cfg.vocab_size * cfg.dim + 4 * cfg.dim


def test_roofline_bytes_llama_8b_and_helpers():
    # Llama-3-8B has 8_030_261_248 parameters; a bs=1 step reads all but 128255 embedding rows
    cfg = PRESETS["llama-8b"]
    assert roofline.weight_params_per_step(cfg, 1) == 8_030_261_248 - 128_256 * 4096 + 4096
    # bf16 KV of one token: 32 layers * 2 * 8 kv heads * 128 * 2 bytes = 131072
    assert roofline.kv_bytes_per_step(cfg, 8, 576, 2) == 8 * 576 * 131_072
    assert roofline.mean_decode_context(512, 128) == 576
    assert roofline.mean_decode_context(32, 1) == 32
    assert roofline.roofline_ms(2_000_000_000, 1000.0) == pytest.approx(2.0)
    # tied embeddings (llama-1b): the output projection reads the table whole, counted once
    one_b = PRESETS["llama-1b"]
    assert roofline.weight_params_per_step(one_b, 64) == roofline.weight_params_per_step(one_b, 1)
    assert roofline.measure_copy_bandwidth(torch.device("cpu"), nbytes=4 << 20, iters=2) > 0


def test_default_modes_follow_the_device(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = argparse.Namespace(modes=None, attention_backends=None)
    cpu = torch.device("cpu")
    assert bench_cli.resolve_modes(args, cpu) == ["eager", "compile-default", "compile-reduce-overhead",
                                                  "tscompile-torch"]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "tscompile-triton" in bench_cli.resolve_modes(args, cpu)
    args = argparse.Namespace(modes=["eager", "tscompile"], attention_backends=["torch"])
    assert bench_cli.resolve_modes(args, cpu) == ["eager", "tscompile-torch"]
    with pytest.raises(ValueError, match="unknown bench mode"):
        bench_cli.resolve_modes(argparse.Namespace(modes=["fast"], attention_backends=None), cpu)


REQUIRED_ROW_KEYS = {"mode", "batch_size", "error", "ttft_ms", "tpot_ms", "decode_tokens_per_s", "compile_s",
                     "capture_s", "peak_memory_gib", "step_bytes", "roofline_ms", "achieved_gbps", "pct_of_roofline"}


def test_bench_cli_cpu_smoke(tmp_path, capsys):
    out_json, out_md = tmp_path / "bench.json", tmp_path / "bench.md"
    argv = ["bench", "--model", "llama-tiny", "--device", "cpu", "--batch-size", "1", "2", "--input-len", "8",
            "--output-len", "4", "--prefill-lens", "8", "--num-iters", "1", "--num-iters-warmup", "1",
            "--modes", "eager", "compile-default", "--output-json", str(out_json), "--output-md", str(out_md),
            "--no-progress", "--bandwidth-mib", "16"]
    assert tscompile_main(argv) == 0
    stdout = capsys.readouterr().out
    assert "| mode | bs | TPOT ms |" in stdout and "| compile-default | 2 |" in stdout
    assert out_md.read_text().strip() == stdout.strip()

    result = json.loads(out_json.read_text())
    for key in ("date", "model", "args", "env", "copy_bandwidth_gbps", "results", "prefill", "modes"):
        assert key in result, key
    assert result["complete"] is True
    assert result["model"] == "llama-tiny" and result["args"]["batch_size"] == [1, 2]
    for key in ("torch_version", "triton_version", "cuda_version", "cpu_name", "gpu_name"):
        assert key in result["env"], key
    rows = result["results"]
    assert sorted((r["mode"], r["batch_size"]) for r in rows) == sorted(
        (m, b) for m in ("eager", "compile-default") for b in (1, 2))
    for r in rows:
        assert r["error"] is None, r["error"]
        assert REQUIRED_ROW_KEYS <= set(r), REQUIRED_ROW_KEYS - set(r)
        assert r["tpot_ms"] > 0 and r["decode_steps_per_iter"] == 3 and r["non_decode_steps"] == 0
        assert r["peak_memory_gib"] is None  # cpu
        # same weights, float32: the compiled static-cache baseline decodes eager's tokens
        assert r["match_eager"] == f"{r['batch_size']}/{r['batch_size']}"
    assert sorted((p["mode"], p["prompt_len"]) for p in result["prefill"]) == [("compile-default", 8), ("eager", 8)]
    assert all(p["error"] is None and p["prefill_ms"] > 0 for p in result["prefill"])
    # the engine counters of the timed runs: eager's steps ran without graphs and compiled nothing;
    # the static-cache baseline does not go through the engine
    timed = {(r["mode"], r.get("batch_size", r.get("prompt_len"))): r["timed_runs"] for r in rows + result["prefill"]}
    assert timed[("eager", 8)]["prefill_eager"] == 1 and timed[("eager", 8)]["graphs"] == 0
    assert all(timed[("eager", b)]["decode_eager"] == 3 for b in (1, 2))
    assert not any(timed[("compile-default", k)][c] for k in (1, 2, 8) for c in ("prefill_eager", "decode_eager"))
    assert result["modes"]["eager"]["weights_fingerprint"] == result["modes"]["compile-default"]["weights_fingerprint"]


def test_bench_failed_mode_is_an_error_row(tmp_path, capsys):
    """narrow-tiny has no static-cache formulation: compile-default rows carry the error, eager still runs."""
    out_json = tmp_path / "bench.json"
    argv = ["bench", "--model", "narrow-tiny", "--device", "cpu", "--batch-size", "1", "--input-len", "6",
            "--output-len", "3", "--prefill-lens", "6", "--num-iters", "1", "--num-iters-warmup", "0",
            "--modes", "eager", "compile-default", "--output-json", str(out_json), "--no-progress",
            "--bandwidth-mib", "16"]
    assert tscompile_main(argv) == 0
    result = json.loads(out_json.read_text())
    by_mode = {r["mode"]: r for r in result["results"]}
    assert by_mode["eager"]["error"] is None and by_mode["eager"]["tpot_ms"] > 0
    assert "narrowing" in by_mode["compile-default"]["error"]
    assert [p["error"] is None for p in result["prefill"]] == [True, False]
    assert "narrowing" in capsys.readouterr().out  # the markdown table shows the error row


def test_bench_saves_finished_rows_when_a_run_is_cut_short(tmp_path, monkeypatch):
    """A bench killed part-way (a time limit) leaves the rows it finished in its JSON and markdown."""
    out_json, out_md = tmp_path / "bench.json", tmp_path / "bench.md"

    def killed(self, mode, runner, length):
        raise KeyboardInterrupt  # not an Exception: the bench does not turn it into an error row

    monkeypatch.setattr(bench_cli.Bench, "prefill_row", killed)
    argv = ["bench", "--model", "llama-tiny", "--device", "cpu", "--batch-size", "1", "--input-len", "6",
            "--output-len", "3", "--prefill-lens", "6", "--num-iters", "1", "--num-iters-warmup", "0",
            "--modes", "eager", "--output-json", str(out_json), "--output-md", str(out_md), "--no-progress",
            "--bandwidth-mib", "16"]
    with pytest.raises(KeyboardInterrupt):
        tscompile_main(argv)
    result = json.loads(out_json.read_text())
    assert result["complete"] is False and result["prefill"] == []
    assert [(r["mode"], r["batch_size"], r["error"]) for r in result["results"]] == [("eager", 1, None)]
    md = out_md.read_text()
    assert result["results"][0]["tpot_ms"] > 0 and "| eager | 1 |" in md and "**Partial run**" in md
