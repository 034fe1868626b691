"""``tscompile bench``: the baselines measure the same model, the roofline byte model, and a CPU smoke run.

No timing is asserted anywhere: only shapes of the output, token agreement, the FLOP and byte models,
the divergence report and the compile counters.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

import tscompile
from tscompile.bench import cli as bench_cli
from tscompile.bench import runner as bench_runner
from tscompile.bench import compile_stats, reference, roofline
from tscompile.bench.reference import Candidates, ReferenceRun
from tscompile.bench.static_cache_model import StaticCacheModel
from tscompile.bench.workloads import EngineRunner, StaticCacheRunner
from tscompile.cli import main as tscompile_main
from tscompile.models import PRESETS, build_model
from helpers import ids, one_thread_fixture


one_thread = pytest.fixture(autouse=True)(one_thread_fixture)


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


def test_static_cache_model_refuses_narrowing_hybrids_and_overflow():
    with pytest.raises(ValueError, match="narrowing"):
        StaticCacheModel(build_model("narrow-tiny", seed=0), batch_size=1, max_len=16)
    with pytest.raises(ValueError, match=r"^tscompile: the static-cache baseline has no linear-attention .* "
                                         r"`tscompile bench --hf-model PRESET` \(qwen3-next-tiny"):
        StaticCacheModel(build_model("qwen3-next-tiny", seed=0), batch_size=1, max_len=16)
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
                                                  "compile-reduce-overhead-tuned", "tscompile-torch"]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "tscompile-triton" in bench_cli.resolve_modes(args, cpu)
    args = argparse.Namespace(modes=["eager", "tscompile"], attention_backends=["torch"])
    assert bench_cli.resolve_modes(args, cpu) == ["eager", "tscompile-torch"]
    with pytest.raises(ValueError, match="unknown bench mode"):
        bench_cli.resolve_modes(argparse.Namespace(modes=["fast"], attention_backends=None), cpu)


REQUIRED_ROW_KEYS = {"mode", "batch_size", "error", "ttft_ms", "tpot_ms", "decode_tokens_per_s", "compile_s",
                     "capture_s", "peak_memory_gib", "step_bytes", "roofline_ms", "achieved_gbps", "pct_of_roofline",
                     "ttft_ms_median", "ttft_ms_min", "ttft_ms_max", "tpot_ms_median", "tpot_ms_min", "tpot_ms_max",
                     "reference_check", "gpu_clocks"}
COMPILE_KEYS = {"recompiles", "graph_breaks", "graphs_compiled", *compile_stats.FX_CACHE_KEYS,
                *compile_stats.AOT_CACHE_KEYS, *compile_stats.TSCOMPILE_KEYS}
NEW_MARKDOWN_COLUMNS = ("| mode | bs | TPOT ms (median) | TPOT min-max | decode tok/s | TTFT ms (median) | TTFT min-max |",
                        "vs f32 reference (req 0) |", "| dynamo graphs | recompiles | graph breaks | FX cache hit/miss/bypass | AOT cache hit/miss/bypass | tscompile graphs |",
                        "| prefill tok/s | TFLOP/s | MFU | SM MHz (min), power-capped | error |",
                        "| % roofline | SM MHz (min), power-capped | vs f32 reference")


def test_bench_cli_cpu_smoke(tmp_path, capsys):
    out_json, out_md = tmp_path / "bench.json", tmp_path / "bench.md"
    argv = ["bench", "--model", "llama-tiny", "--device", "cpu", "--batch-size", "1", "2", "--input-len", "8",
            "--output-len", "4", "--prefill-lens", "8", "--num-iters", "1", "--num-iters-warmup", "1",
            "--modes", "eager", "compile-default", "--output-json", str(out_json), "--output-md", str(out_md),
            "--no-progress", "--bandwidth-mib", "16"]
    assert tscompile_main(argv) == 0
    stdout = capsys.readouterr().out
    assert all(col in stdout for col in NEW_MARKDOWN_COLUMNS), stdout
    assert "| compile-default | 2 |" in stdout
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
        assert r["peak_memory_gib"] is None and r["gpu_clocks"] is None  # cpu: no memory peak, no clocks
        # same weights, float32: the compiled static-cache baseline decodes eager's tokens, and both
        # decode the float32 reference's
        assert r["match_eager"] == f"{r['batch_size']}/{r['batch_size']}"
        check = r["reference_check"]
        if r["mode"] == "eager":  # an engine mode: its log-probabilities are the reference's too
            assert check.pop("max_logprob_diff") < 1e-4 and check.pop("logprob_diff_at") in range(4), check
        assert check == {"agrees": True, "compared_tokens": 4}
        assert r["tokens_req0"] == result["reference"]["runs"][str(r["batch_size"])]["tokens"]
        # every timed figure: median inside [min, max]; TTFT for every mode, not only tscompile's
        for fig in ("tpot_ms", "ttft_ms"):
            assert 0 < r[f"{fig}_min"] <= r[f"{fig}_median"] <= r[f"{fig}_max"], (fig, r)
        # the CPU's caches hold llama-tiny's step: no roofline percentage, the bytes still reported
        assert r["pct_of_roofline"] is None and r["roofline_note"].startswith("cpu") and r["achieved_gbps"] > 0
    for mode in ("eager", "compile-default"):
        stats = result["modes"][mode]["compile_stats"]
        assert set(stats) == COMPILE_KEYS and all(type(v) is int and v >= 0 for v in stats.values()), stats
    # eager compiles nothing; the baseline compiles its prefill and decode steps, and a second batch
    # size under dynamic=True recompiles (0/1 specialization of the batch dimension)
    assert not any(result["modes"]["eager"]["compile_stats"].values())
    assert result["modes"]["compile-default"]["compile_stats"]["graphs_compiled"] >= 2
    # every graph Inductor compiled went through its FX graph cache: a hit, a miss or a bypass each
    fx = result["modes"]["compile-default"]["compile_stats"]
    assert fx["fx_cache_hits"] + fx["fx_cache_misses"] + fx["fx_cache_bypasses"] >= fx["graphs_compiled"]
    assert f'| {fx["fx_cache_hits"]}/{fx["fx_cache_misses"]}/{fx["fx_cache_bypasses"]} |' in out_md.read_text()
    # and through AOTAutograd's cache (when this torch has it on): a hit, a miss or a bypass each
    from torch._functorch import config as functorch_config

    aot = f'{fx["aot_cache_hits"]}/{fx["aot_cache_misses"]}/{fx["aot_cache_bypasses"]}'
    assert f"| {aot} |" in out_md.read_text()
    if getattr(functorch_config, "enable_autograd_cache", False):
        assert fx["aot_cache_hits"] + fx["aot_cache_misses"] + fx["aot_cache_bypasses"] >= fx["graphs_compiled"], fx
    # where the compile time went: eager has no compile record; the baseline's frames took time in
    # Dynamo and AOTAutograd (Inductor's share may be none: every graph a cache hit)
    assert result["modes"]["eager"]["compile_phases"] == {}
    phases = result["modes"]["compile-default"]["compile_phases"]
    assert phases["frame_s"] > 0 and phases["aot_autograd_s"] > 0, phases
    assert set(phases) <= set(compile_stats.PHASE_FIELDS) and all(v >= 0 for v in phases.values())
    assert "| compile-default | " + f'{phases["frame_s"]:.2f} | {phases["aot_autograd_s"]:.2f} |' in stdout
    # the modules Inductor loaded per mode (on the CPU C++ kernels: no run-time-chosen Triton config)
    assert result["modes"]["eager"]["autotuned_kernels"] == {"kernels": [], "graphs": 0}
    assert result["modes"]["compile-default"]["autotuned_kernels"]["graphs"] >= 2
    assert result["modes"]["compile-default"]["autotuned_kernels"]["kernels"] == []
    assert "| eager | 2 | " in stdout and "| - | agrees (4 tok, logprobs within " in stdout
    assert result["peak_tflops"] is None and all(p["mfu"] is None and p["prefill_tflops"] > 0 for p in result["prefill"])
    assert "MFU \"-\"" in stdout and "% roofline \"-\"" in stdout
    assert sorted((p["mode"], p["prompt_len"]) for p in result["prefill"]) == [("compile-default", 8), ("eager", 8)]
    assert all(p["error"] is None and p["prefill_ms"] > 0 for p in result["prefill"])
    # the host's share until the launch: the engine's runs only, inside the row's wall time
    prefill = {p["mode"]: p for p in result["prefill"]}
    assert 0 < prefill["eager"]["host_launch_ms"] <= prefill["eager"]["prefill_ms_max"]
    assert prefill["compile-default"]["host_launch_ms"] is None
    assert "| host until launch ms |" in stdout
    # the engine counters of the timed runs: eager's steps ran without graphs and compiled nothing;
    # the static-cache baseline does not go through the engine
    timed = {(r["mode"], r.get("batch_size", r.get("prompt_len"))): r["timed_runs"] for r in rows + result["prefill"]}
    assert timed[("eager", 8)]["prefill_eager"] == 1 and timed[("eager", 8)]["graphs"] == 0
    assert all(timed[("eager", b)]["decode_eager"] == 3 for b in (1, 2))
    assert not any(timed[("compile-default", k)][c] for k in (1, 2, 8) for c in ("prefill_eager", "decode_eager"))
    assert result["modes"]["eager"]["weights_fingerprint"] == result["modes"]["compile-default"]["weights_fingerprint"]


def _small_bench(tmp_path, model: str, modes: list[str], *, length: int, new_tokens: int, warmup: int) -> dict:
    """One CPU bench run at bs=1 (prompt and prefill of ``length`` tokens); its JSON result."""
    out_json = tmp_path / "bench.json"
    argv = ["bench", "--model", model, "--device", "cpu", "--batch-size", "1", "--input-len", str(length),
            "--output-len", str(new_tokens), "--prefill-lens", str(length), "--num-iters", "1",
            "--num-iters-warmup", str(warmup), "--modes", *modes, "--output-json", str(out_json), "--no-progress",
            "--bandwidth-mib", "16"]
    assert tscompile_main(argv) == 0
    return json.loads(out_json.read_text())


def test_bench_failed_mode_is_an_error_row(tmp_path, capsys):
    """narrow-tiny has no static-cache formulation: compile-default rows carry the error, eager still runs."""
    result = _small_bench(tmp_path, "narrow-tiny", ["eager", "compile-default"], length=6, new_tokens=3, warmup=0)
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


# -- the tuned stock baseline -----------------------------------------------------------------------
def test_gqa_formulations_give_the_same_logits():
    """SDPA's enable_gqa and the query heads folded into rows read the n_kv_heads cache as it is; the
    repeat_interleave copy is the straightforward formulation. Same logits over a prefill and two
    decode steps (float32)."""
    model = build_model("llama-tiny", dtype=torch.float32, device="cpu", seed=3)
    assert model.config.n_heads != model.config.n_kv_heads  # a real group, or the test proves nothing
    prompt = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    outs = {}
    for gqa in ("repeat_interleave", "enable_gqa", "grouped_query_rows"):
        sm = StaticCacheModel(model, batch_size=2, max_len=16, gqa=gqa)
        steps = [sm(prompt, torch.arange(9))]
        for pos in (9, 10):
            steps.append(sm(steps[-1].argmax(-1, keepdim=True), torch.tensor([pos])))
        outs[gqa] = torch.stack(steps)
    torch.testing.assert_close(outs["enable_gqa"], outs["repeat_interleave"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs["grouped_query_rows"], outs["repeat_interleave"], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="tscompile: gqa='copy' .*allowed"):
        StaticCacheModel(model, batch_size=1, max_len=16, gqa="copy")


def test_tuned_inductor_config_is_set_only_around_the_tuned_modes_calls():
    """gpt-fast's Inductor settings hold inside the tuned runner's calls (where it compiles) and are
    restored after; the untuned runner's calls see the defaults."""
    import torch._inductor.config as inductor_config

    default = inductor_config.coordinate_descent_tuning
    assert default is False  # else this test cannot tell the patch from the default
    model = build_model("llama-tiny", seed=0)
    seen = {}
    for mode in ("compile-reduce-overhead", "compile-reduce-overhead-tuned"):
        runner = StaticCacheRunner(model, mode, torch.device("cpu"), compiled=False)
        calls = seen[mode] = []

        def spy(fn, calls=calls):
            def wrapped(*a):
                calls.append(inductor_config.coordinate_descent_tuning)
                return fn(*a)
            return wrapped

        runner.prefill_fn, runner.decode_fn = spy(runner.prefill_fn), spy(runner.decode_fn)
        runner.run_batch([[3, 1, 4, 1, 5]], 3)
        runner.run_prefill([2, 7, 1, 8])
        assert inductor_config.coordinate_descent_tuning is default
    assert seen["compile-reduce-overhead"] == [False] * 4 and seen["compile-reduce-overhead-tuned"] == [True] * 4
    assert StaticCacheRunner(model, "compile-reduce-overhead-tuned", torch.device("cpu"), compiled=False).gqa in \
        ("enable_gqa", "grouped_query_rows")
    assert StaticCacheRunner(model, "compile-reduce-overhead", torch.device("cpu"), compiled=False).gqa == \
        "repeat_interleave"


def test_choose_gqa_avoids_sdpas_math_fallback(monkeypatch):
    """enable_gqa where SDPA's dispatcher gives it a fused kernel; where it would take the math kernel
    (which repeats K/V per head), the query heads folded into rows."""
    from torch.nn.attention import SDPBackend

    from tscompile.bench.static_cache_model import choose_gqa

    model = build_model("llama-tiny", seed=0)
    for backend, expected in ((SDPBackend.EFFICIENT_ATTENTION, "enable_gqa"), (SDPBackend.MATH, "grouped_query_rows")):
        asked = []

        def choice(q, k, v, *, attn_mask, enable_gqa, backend=backend):
            asked.append((q.shape[1], k.shape[1], q.shape[2], attn_mask.dtype, enable_gqa))
            return backend.value

        monkeypatch.setattr(torch, "_fused_sdp_choice", choice)
        gqa, why = choose_gqa(model)
        assert gqa == expected, why
        assert asked[0] == (4, 2, 1, torch.bool, True)  # the model's heads, a decode row, a boolean mask


def test_tuned_mode_runs_and_decodes_eager_tokens_float32(tmp_path):
    """The tuned baseline, compiled (fullgraph, reduce-overhead decode), decodes eager's and the float32
    reference's greedy tokens on llama-tiny in float32."""
    result = _small_bench(tmp_path, "llama-tiny", ["eager", "compile-reduce-overhead-tuned"], length=8, new_tokens=4,
                          warmup=1)
    rows = {r["mode"]: r for r in result["results"]}
    tuned = rows["compile-reduce-overhead-tuned"]
    assert tuned["error"] is None and tuned["tpot_ms"] > 0
    assert tuned["tokens_req0"] == rows["eager"]["tokens_req0"] and tuned["match_eager"] == "1/1"
    assert tuned["reference_check"]["agrees"] is True
    stats = result["modes"]["compile-reduce-overhead-tuned"]["compile_stats"]
    assert stats["graphs_compiled"] >= 2 and stats["graph_breaks"] == 0  # fullgraph: a break would have raised
    assert [p["error"] for p in result["prefill"]] == [None, None]


# -- MFU ------------------------------------------------------------------------------------------
def test_prefill_flops_llama_tiny_by_hand_and_by_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    cfg = PRESETS["llama-tiny"]  # dim 256, 2 layers, 4 heads (head_dim 64), 2 kv heads, ffn 512, vocab 512
    # linears per layer: wqkv 256*512 + wo 256*256 + w13 256*1024 + w2 512*256 = 589_824
    assert roofline.linear_params_per_layer(cfg) == 589_824
    # L=8: 2 * 8 tokens * 2 layers * 589_824 + the last token's output projection 2 * 512 * 256
    matmuls = 2 * 8 * 2 * 589_824 + 2 * 512 * 256
    # causal attention: 2 layers * 4 * (8 * 9 / 2 score entries) * 4 heads * 64 dims
    attention = 2 * 4 * 36 * 4 * 64
    assert roofline.prefill_flops(cfg, 8) == matmuls + attention == 19_210_240
    # the matmul part is what torch's own FLOP counter sees in one prefill forward of the model
    sm = StaticCacheModel(build_model("llama-tiny", seed=0), batch_size=1, max_len=16)
    with FlopCounterMode(display=False) as fc:
        sm(torch.arange(8)[None], torch.arange(8))
    assert sum(fc.get_flop_counts()["Global"].values()) == matmuls
    # llama-8b at 2048 tokens: 2 * 2048 * 32 layers * 218_103_808 + 2 * 128_256 * 4096, plus attention
    big = PRESETS["llama-8b"]
    assert roofline.linear_params_per_layer(big) == 218_103_808
    assert roofline.prefill_flops(big, 2048) == (2 * 2048 * 32 * 218_103_808 + 2 * 128_256 * 4096
                                                 + 32 * 4 * (2048 * 2049 // 2) * 32 * 128)
    assert roofline.mfu(500e12, 1.0, 1000.0) == pytest.approx(0.5)
    assert roofline.mfu(500e12, 1.0, None) is None
    assert roofline.measure_matmul_tflops(torch.device("cpu"), torch.float32, n=64, iters=2, warmup=1) > 0
    assert roofline.roofline_applies(torch.device("cpu"), 10**12)[0] is False


# -- the divergence report ------------------------------------------------------------------------
def _synthetic_logits() -> torch.Tensor:
    logits = torch.randn(300, generator=torch.Generator().manual_seed(5)) * 0.1  # all below 0.5
    logits[7], logits[3], logits[50] = 3.0, 2.97, 1.0
    return logits


def test_margin_of_synthetic_logits():
    cand = reference.top_candidates(_synthetic_logits(), k=8)
    assert cand.ids[:3] == [7, 3, 50]
    near_tie = reference.margin_at(cand, 3)
    assert near_tie["margin"] == pytest.approx(0.03, abs=1e-6) and near_tie["chosen_rank"] == 2
    assert near_tie["chosen_gap"] == pytest.approx(0.03, abs=1e-6)
    third = reference.margin_at(cand, 50)
    assert third["chosen_rank"] == 3 and third["chosen_gap"] == pytest.approx(2.0) \
        and third["margin"] == pytest.approx(0.03, abs=1e-6)
    outside = next(i for i in range(300) if i not in cand.ids)
    far = reference.margin_at(cand, outside)
    assert far["chosen_rank"] is None and far["chosen_gap"] == pytest.approx(3.0 - cand.logits[-1])


def test_compare_names_the_first_diverging_step_and_flags_wide_gaps():
    cand = reference.top_candidates(_synthetic_logits(), k=8)
    clear = Candidates(ids=[11, 12], logits=[5.0, 1.0])
    ref = ReferenceRun(prompt=[1, 2], tokens=[11, 11, 7, 11], steps=[clear, clear, cand, clear])
    assert reference.compare(ref, [11, 11, 7, 11], 0.5) == {"agrees": True, "compared_tokens": 4}
    assert reference.describe(reference.compare(ref, [11, 11, 7, 11], 0.5)) == "agrees (4 tok)"
    tie = reference.compare(ref, [11, 11, 3, 9], 0.5)
    assert tie["first_divergence"] == 2 and tie["mode_token"] == 3 and tie["suspicious"] is False
    assert reference.describe(tie) == "diverges at 2 (margin 0.03)"
    wide = reference.compare(ref, [11, 11, 50, 9], 0.5)
    assert wide["suspicious"] is True
    assert reference.describe(wide) == "**suspicious**: diverges at 2 (margin 0.03; took rank 3, gap 2)"
    bug = reference.compare(ref, [11, 12, 7, 11], 0.5)  # the runner-up of a clear winner
    assert bug["first_divergence"] == 1 and bug["margin"] == pytest.approx(4.0) and bug["suspicious"] is True
    short = reference.compare(ref, [11, 11], 0.5)
    assert short["suspicious"] is True and "2 tokens" in reference.describe(short)


def test_bench_reports_a_forced_divergence(tmp_path, monkeypatch):
    """A mode whose third token is swapped for the reference's runner-up is reported as diverging at
    step 2 with the reference's margin there (the JSON and the markdown); in float32 that is a FAIL
    and the bench exits non-zero."""
    length, output_len = 8, 4
    model = build_model("llama-tiny", seed=0)
    prompt = bench_runner._prompts(0, 1, length, model.config.vocab_size)[0]
    ref = reference.reference_greedy(model, prompt, output_len, torch.device("cpu"))
    runner_up = ref.steps[2].ids[1]
    original = EngineRunner.run_batch

    def perturbed(self, prompts, n, per_call=False):
        timing = original(self, prompts, n, per_call)
        timing.tokens[0][2] = runner_up
        return timing

    monkeypatch.setattr(EngineRunner, "run_batch", perturbed)
    out_json = tmp_path / "bench.json"
    argv = ["bench", "--model", "llama-tiny", "--device", "cpu", "--batch-size", "1", "--input-len", str(length),
            "--output-len", str(output_len), "--prefill-lens", "8", "--num-iters", "1", "--num-iters-warmup", "0",
            "--modes", "eager", "--output-json", str(out_json), "--no-progress", "--bandwidth-mib", "16",
            "--margin-threshold", "1e-9"]
    assert tscompile_main(argv) == 1
    result = json.loads(out_json.read_text())
    check = result["results"][0]["reference_check"]
    margin = ref.steps[2].logits[0] - ref.steps[2].logits[1]
    assert check["first_divergence"] == 2 and check["mode_token"] == runner_up and check["chosen_rank"] == 2
    assert check["margin"] == pytest.approx(margin) and result["reference"]["runs"]["1"]["margins"][2] == \
        pytest.approx(margin)
    assert check["suspicious"] is True and check["fail"] is True  # any gap is above a 1e-9 threshold
    md = bench_cli.report.markdown(result)
    assert f"**FAIL** (float32 must match): diverges at 2 (margin {margin:.3g})" in md


# -- compile counters -----------------------------------------------------------------------------
def test_compile_stats_count_dynamo_recompiles_and_graph_breaks():
    torch._dynamo.reset()

    def f(x):
        y = x * 2
        torch._dynamo.graph_break()
        return y + 1

    # as the bench does: Dynamo keeps its last 64 compiles only, and a worker that already compiled
    # that many would drop one record per new compile (a count going down)
    old_limit = compile_stats.keep_compilation_metrics()
    try:
        before = compile_stats.snapshot()
        compiled = torch.compile(f, backend="eager", dynamic=False)
        compiled(torch.randn(3))
        first = compile_stats.since(before)
        compiled(torch.randn(3, dtype=torch.float64))  # a dtype guard fails: both frames recompile
        stats = compile_stats.since(before)
        reasons = compile_stats.recompile_reasons(before)
    finally:
        compile_stats.restore_compilation_metrics(old_limit)
    torch._dynamo.reset()
    assert first["recompiles"] == 0 and first["graph_breaks"] == 1 and first["graphs_compiled"] == 2
    assert stats["recompiles"] == 2 and stats["graph_breaks"] == 2 and stats["graphs_compiled"] == 4
    assert all(type(v) is int for v in stats.values())
    assert reasons and all("dtype" in r for r in reasons)


def test_compile_phases_sum_the_compile_records_since_the_snapshot():
    """Only the compiles after the snapshot count: a second compile adds its own phase times, a
    snapshot taken after both sees none of them."""
    torch._dynamo.reset()
    old_limit = compile_stats.keep_compilation_metrics()
    try:
        before = compile_stats.snapshot()
        torch.compile(lambda x: x.sin() + 1, backend="inductor")(torch.randn(8))
        one = compile_stats.compile_phases(before)
        torch.compile(lambda x: x.cos() * 2, backend="inductor")(torch.randn(8))
        two = compile_stats.compile_phases(before)
        after = compile_stats.compile_phases(compile_stats.snapshot())
    finally:
        compile_stats.restore_compilation_metrics(old_limit)
    torch._dynamo.reset()
    assert one["frame_s"] > 0 and one["aot_autograd_s"] > 0
    assert two["frame_s"] > one["frame_s"] and two["aot_autograd_s"] > one["aot_autograd_s"]
    assert after == {}
    assert set(two) <= set(compile_stats.PHASE_FIELDS)


def test_tscompile_options_reach_the_compiled_modes_only_and_are_reported(tmp_path, monkeypatch, capsys):
    """--tscompile-options '{"decode_ladder": [2, 4]}': the compiled tscompile mode's engine gets those
    compile options, the eager engine none; the markdown header names them. Engines are recorded,
    then stopped (an error row), so nothing compiles."""
    seen = []

    def recording_llm(model, **kw):
        seen.append((kw["enforce_eager"], kw.get("compile_options")))
        raise RuntimeError("recorded")

    monkeypatch.setattr(tscompile, "LLM", recording_llm)
    out_json, out_md = tmp_path / "bench.json", tmp_path / "bench.md"
    argv = ["bench", "--model", "llama-tiny", "--device", "cpu", "--batch-size", "1", "--input-len", "6",
            "--output-len", "3", "--prefill-lens", "6", "--num-iters", "1", "--num-iters-warmup", "0",
            "--modes", "eager", "tscompile-torch", "--tscompile-options", '{"decode_ladder": [2, 4]}',
            "--output-json", str(out_json), "--output-md", str(out_md), "--no-progress", "--bandwidth-mib", "16",
            "--no-reference"]
    assert tscompile_main(argv) == 1  # every row an error row
    assert sorted(seen, key=str) == sorted([(True, None), (False, {"decode_ladder": [2, 4]})], key=str)
    result = json.loads(out_json.read_text())
    assert result["args"]["tscompile_options"] == {"decode_ladder": [2, 4]}
    assert 'tscompile modes compiled with `{"decode_ladder": [2, 4]}`' in out_md.read_text()


@pytest.mark.parametrize("text", ["[2, 4]", "{decode_ladder: 2}"])
def test_tscompile_options_other_than_a_json_object_are_refused(text, capsys):
    with pytest.raises(SystemExit):
        tscompile_main(["bench", "--tscompile-options", text])
    assert "tscompile: --tscompile-options" in capsys.readouterr().err


@pytest.mark.parametrize("extra, match", [
    (["--modes", "eager", "tscompile-torch", "--tscompile-options", '{"decode_lader": [2]}'], "unknown option"),
    (["--modes", "eager", "--tscompile-options", '{"decode_ladder": [2]}'], "measures none of them"),
    (["--hf-model", "llama-tiny", "--tscompile-options", '{"decode_ladder": [2]}'], "own --hf-modes"),
])
def test_tscompile_options_are_refused_before_any_model_is_built(extra, match, monkeypatch, capsys):
    """A misspelt option, options no compiled tscompile mode would use, options beside --hf-model:
    refused up front (the CLI prints the refusal and exits 2), before a model or an engine exists."""
    import re

    monkeypatch.setattr(bench_runner.Bench, "__init__", lambda *a, **k: pytest.fail("a model was built"))
    from tscompile.bench import hf_model

    monkeypatch.setattr(hf_model, "run", lambda *a, **k: pytest.fail("the hf bench ran"))
    assert tscompile_main(["bench", "--device", "cpu", "--no-progress", *extra]) == 2
    assert re.search(r"^tscompile: .*" + re.escape(match), capsys.readouterr().err, re.MULTILINE)


def test_a_run_without_output_flags_writes_into_a_git_ignored_folder(tmp_path):
    import argparse
    import subprocess
    from pathlib import Path

    from tscompile.bench import report

    args = argparse.Namespace(model="/some/dir/Llama-3.2-1B", device="cuda:0", hf_model=None)
    first = report.default_output_paths(args, tmp_path / "out")
    assert first[0].parent == tmp_path / "out" and first[0].parent.is_dir()
    assert first[0].name.startswith("Llama-3.2-1B-cuda0-") and first[0].suffix == ".json" and first[1].suffix == ".md"
    first[0].write_text("{}")
    second = report.default_output_paths(args, tmp_path / "out")  # the same second: a free name, never the first's
    assert second[0] != first[0] and second[0].stem.startswith(first[0].stem)
    root = Path(__file__).resolve().parents[1]
    ignored = subprocess.run(["git", "-C", str(root), "check-ignore", "-q", f"{report.DEFAULT_OUTPUT_DIR}/x.json"])
    assert ignored.returncode == 0, f"{report.DEFAULT_OUTPUT_DIR}/ is not git-ignored"
