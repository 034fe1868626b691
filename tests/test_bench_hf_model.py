"""``tscompile bench --hf-model`` (bench/hf_model.py) on the CPU: the tiny preset through the CLI entry,
the JSON and markdown it writes, the logits and generate columns against eager (and that they catch a
wrong compiled mode), no recompile after the first call for tscompile-split, checkpoint directories,
and the argument refusals. No timing is asserted.

The fast tests compile tscompile-split's pieces with ``piece_compiler="eager"`` (Dynamo's graphs,
splits and guards are the same; Inductor's C++ build of the pieces takes about a minute on two
cores); the Inductor run is the slow test."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from tscompile.bench import hf_args, hf_model
from tscompile.cli import main as tscompile_main
from helpers import one_thread_fixture

transformers = pytest.importorskip("transformers")

one_thread = pytest.fixture(autouse=True)(one_thread_fixture)

LENS = (12, 20)
NEW_TOKENS = 5


@pytest.fixture
def eager_pieces(monkeypatch):
    """tscompile-split with its options as the bench gives them, the pieces run without Inductor."""
    kwargs = copy.deepcopy(hf_model.MODE_COMPILE_KWARGS)
    kwargs["tscompile-split"]["options"]["piece_compiler"] = "eager"
    monkeypatch.setattr(hf_model, "MODE_COMPILE_KWARGS", kwargs)


def run_cli(tmp_path, model="llama-tiny", modes=("eager", "tscompile-split"), extra=(), device="cpu",
            lens=LENS) -> tuple[int, dict, str]:
    out_json, out_md = tmp_path / "hf.json", tmp_path / "hf.md"
    argv = ["bench", "--hf-model", str(model), "--device", device, "--hf-modes", *modes,
            "--hf-lens", *map(str, lens), "--hf-generate-tokens", str(NEW_TOKENS), "--num-iters", "1",
            "--output-json", str(out_json), "--output-md", str(out_md), "--no-progress", *extra]
    rc = tscompile_main(argv)
    return rc, json.loads(out_json.read_text()), out_md.read_text()


def test_tiny_preset_eager_and_split_through_the_cli(tmp_path, capsys, eager_pieces):
    rc, result, md = run_cli(tmp_path)
    assert rc == 0
    assert md.strip() == capsys.readouterr().out.strip()
    for key in ("device", "dtype", "gpu_name", "torch_version", "transformers_version", "model_config", "env",
                "rows", "complete"):
        assert key in result, key
    assert result["device"] == "cpu" and result["dtype"] == "float32" and result["complete"] is True
    assert result["torch_version"] == torch.__version__
    assert result["transformers_version"] == transformers.__version__
    cfg = result["model_config"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (256, 2, 512)  # llama-tiny
    rows = {r["mode"]: r for r in result["rows"]}
    assert list(rows) == ["eager", "tscompile-split"]
    for mode, r in rows.items():
        assert r["error"] is None, r["error"]
        assert sorted(r["lengths"], key=int) == [str(n) for n in LENS]
        for entry in r["lengths"].values():
            assert 0 < entry["ms_min"] <= entry["ms_median"] <= entry["ms_max"], entry
        assert r["first_call_s"] > 0 and r["generate_first_call_s"] > 0 and r["generate_ms_per_token"] > 0
        assert len(r["generate_tokens"]) == NEW_TOKENS
    eager, split = rows["eager"], rows["tscompile-split"]
    assert eager["max_abs_diff_vs_eager"] == 0 and eager["tokens_vs_eager"] == "same"
    assert not any(eager["counters_forward"].values())  # eager compiles nothing
    # float32 on the CPU: the split graph's logits are eager's within float32 rounding, at every length
    for n in LENS:
        assert split["lengths"][str(n)]["max_abs_diff_vs_eager"] < 1e-4, n
    assert split["tokens_vs_eager"] == "same" and split["generate_tokens"] == eager["generate_tokens"]
    # one compile at the first call, none after it at the other length
    assert split["counters_first_call"]["graphs_compiled"] == 1
    assert split["recompiles_after_first_call"] == 0 and split["graphs_after_first_call"] == 0
    assert split["counters_forward"]["graph_breaks"] == 0
    assert split["counters_forward"]["breaks"] >= 2  # tscompile split at the two layers' SDPA
    # the table shows it: lengths, first call, recompiles, generate, tokens, logits
    assert "| 12 tok ms (min-max) | 20 tok ms (min-max) | first call s | recompiles after 1st call |" in md
    assert "| generate ms/token | first generate s | tokens vs eager | max abs diff logits vs eager |" in md
    split_line = next(line for line in md.splitlines() if line.startswith("| tscompile-split |"))
    assert split_line.split(" | ")[4:5] == ["0"] and "| same |" in split_line


def test_a_kernel_variant_runs_the_split_graph_again_with_its_policy(tmp_path, eager_pieces):
    """``--kernel-variants`` with ``--hf-model``: ``tscompile-split`` once more per variant, in the same
    process, its options' kernels laid over (here the eager tail), labelled ``tscompile-split@NAME``."""
    variant = {"user_graph_eager_tail": True}
    rc, result, md = run_cli(tmp_path, extra=["--hf-parts", "forward", "--kernel-variants",
                                              f"tail={json.dumps(variant)}"])
    assert rc == 0
    rows = {r["mode"]: r for r in result["rows"]}
    assert list(rows) == ["eager", "tscompile-split", "tscompile-split@tail"]
    base, tail = rows["tscompile-split"], rows["tscompile-split@tail"]
    assert tail["error"] is None, tail["error"]
    assert "kernels" not in base["compile_kwargs"]["options"]
    assert tail["compile_kwargs"]["options"] == {**base["compile_kwargs"]["options"], "kernels": variant}
    for n in LENS:
        assert tail["lengths"][str(n)]["max_abs_diff_vs_eager"] < 1e-4, n
    assert any(line.startswith("| tscompile-split@tail |") for line in md.splitlines())


def test_kernel_table_lists_each_modes_forward_ops_per_length(tmp_path, eager_pieces):
    """``--kernel-table`` with ``--hf-model``: per mode and length, the profiled forwards' ops (on the
    CPU, aten ops by self time), in the JSON and under "### Kernels" in the markdown."""
    rc, result, md = run_cli(tmp_path, extra=["--kernel-table", "--kernel-table-steps", "2"], lens=(12,))
    assert rc == 0
    for row in result["rows"]:
        kt = row["lengths"]["12"]["kernel_table"]
        assert "error" not in kt, kt
        assert kt["steps"] == 2 and kt["kernels_per_step"] > 0 and kt["kernel_ms_per_step"] > 0
        names = [k["name"] for k in kt["top"]]
        # the projections, and the attention (the split mode's runs between its pieces)
        assert "aten::mm" in names and any("scaled_dot_product" in name for name in names), names
    assert "### Kernels" in md and "**eager forward 12 tokens**" in md and "**tscompile-split forward 12 tokens**" in md


def _patch_mode(monkeypatch, mode: str, backend) -> None:
    kwargs = copy.deepcopy(hf_model.MODE_COMPILE_KWARGS)
    kwargs[mode] = {"backend": backend, "dynamic": True}
    monkeypatch.setattr(hf_model, "MODE_COMPILE_KWARGS", kwargs)


@pytest.mark.parametrize("model", ["llama-tiny", "qwen3-next-tiny"])  # both with a vocabulary of 512
def test_a_wrong_mode_is_caught_and_eager_runs_first_unnamed(tmp_path, monkeypatch, model):
    """A mode that negates the logits (a wrong compiler) is caught by both columns: greedy tokens
    differ at the first step, logits far from eager's. Eager runs first though not named."""

    def negate(gm, example_inputs):
        def run(*args):
            out = gm(*args)
            return [-o if isinstance(o, torch.Tensor) and o.is_floating_point() and o.shape[-1] == 512 else o
                    for o in out]
        return run

    _patch_mode(monkeypatch, "compile-default", negate)
    rc, result, _ = run_cli(tmp_path, model=model, modes=("compile-default",))
    assert rc == 0
    rows = {r["mode"]: r for r in result["rows"]}
    assert list(rows) == ["eager", "compile-default"]
    wrong = rows["compile-default"]
    assert wrong["error"] is None, wrong["error"]
    assert wrong["tokens_vs_eager"] == "differs at step 0"
    assert wrong["max_abs_diff_vs_eager"] > 0.1


def test_a_failing_mode_is_an_error_row_and_the_others_run(tmp_path, monkeypatch):
    def broken(gm, example_inputs):
        raise RuntimeError("this backend is broken")

    _patch_mode(monkeypatch, "compile-reduce-overhead", broken)
    rc, result, md = run_cli(tmp_path, modes=("compile-reduce-overhead",))
    assert rc == 1  # eager ran, but the one mode asked for failed
    rows = {r["mode"]: r for r in result["rows"]}
    assert rows["eager"]["error"] is None and rows["eager"]["generate_ms_per_token"] > 0
    failed = rows["compile-reduce-overhead"]
    assert failed["error"].startswith("forward: BackendCompilerFailed") and "; generate: " in failed["error"]
    assert "RuntimeError: this backend is broken" in failed["error"]
    assert "this backend is broken" in md


def test_checkpoint_directory(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "ckpt")
    rc, result, _ = run_cli(tmp_path, model=tmp_path / "ckpt", modes=("eager",))
    assert rc == 0 and result["hf_model_kind"] == "checkpoint"
    assert result["model_config"]["vocab_size"] == 64
    assert result["rows"][0]["error"] is None and len(result["rows"][0]["generate_tokens"]) == NEW_TOKENS


def test_generate_part_alone_compiles_afresh(tmp_path, monkeypatch, eager_pieces):
    """``--hf-parts generate``: no forward rows; the static-cache generate compiles afresh with the
    mode's arguments and still gives eager's greedy tokens."""
    seen = []
    original = torch.nn.Module.compile

    def spy(self, *args, **kwargs):
        seen.append(kwargs)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "compile", spy)
    rc, result, md = run_cli(tmp_path, extra=("--hf-parts", "generate"))
    assert rc == 0 and result["args"]["hf_parts"] == ["generate"]
    rows = {r["mode"]: r for r in result["rows"]}
    split = rows["tscompile-split"]
    assert split["error"] is None and "lengths" not in split and split["generate_ms_per_token"] > 0
    assert split["tokens_vs_eager"] == "same"
    assert seen == [hf_model.MODE_COMPILE_KWARGS["tscompile-split"]]  # one compile, the generate's
    assert split["generate_compile_kwargs"] == seen[0]
    assert "parts: generate" in md


def test_stream_part_runs_distinct_lengths_twice_with_no_recompile(tmp_path, eager_pieces):
    """``--hf-parts stream``: every mode runs the same distinct lengths twice; the compiled mode
    compiles once (dynamic=True), then never again, and the markdown has the stream table."""
    rc, result, md = run_cli(tmp_path, extra=("--hf-parts", "stream", "--hf-stream-prompts", "4",
                                              "--hf-stream-lens", "9", "30", "--hf-use-cache"))
    assert rc == 0 and result["args"]["use_cache"] is True
    rows = {r["mode"]: r for r in result["rows"]}
    for mode in ("eager", "tscompile-split"):
        st = rows[mode]["stream"]
        assert rows[mode]["error"] is None and st["prompts"] == 4 and st["lens"] == [9, 30]
        assert st["first_pass_s"] > 0 and st["second_pass_ms_per_prompt"] > 0
    split = rows["tscompile-split"]["stream"]
    assert split["graphs_compiled"] == 1 and split["recompiles"] == 0
    assert rows["eager"]["stream"]["graphs_compiled"] == 0
    assert "### A stream of distinct lengths" in md and "use_cache=True" in md
    lengths = hf_model.stream_lengths(0, 4, 9, 30)
    assert len(set(lengths)) == 4 and all(9 <= n <= 30 for n in lengths)
    assert lengths == hf_model.stream_lengths(0, 4, 9, 30) != hf_model.stream_lengths(1, 4, 9, 30)


@pytest.mark.parametrize("extra, needle", [
    (["--hf-model", "llama-tiny", "--hf-parts", "stream", "--hf-stream-prompts", "50", "--hf-stream-lens", "17", "40"],
     "--hf-stream-prompts 50 distinct lengths do not fit --hf-stream-lens 17 40"),
    (["--hf-stream-prompts", "5"], "--hf-stream-prompts need --hf-model"),
    (["--hf-use-cache"], "--hf-use-cache need --hf-model"),
    (["--hf-model", "llama-tiny", "--hf-parts", "decode"], "unknown --hf-parts ['decode']"),
    (["--hf-model", "llama-tiny", "--hf-modes", "fast"], "unknown --hf-modes ['fast']"),
    (["--hf-model", "llama-tiny", "--hf-lens", "16", "0"], "--hf-lens [16, 0] has lengths < 1"),
    (["--hf-model", "llama-tiny", "--hf-generate-tokens", "0"], "--hf-generate-tokens 0 must be >= 1"),
    (["--hf-model", "llama-tiny", "--num-iters", "0"], "--num-iters 0 must be >= 1"),
    (["--hf-model", "llama-7b"], "'llama-7b' is neither a checkpoint directory nor a preset"),
    (["--hf-model", "narrow-tiny"], "neither a checkpoint directory nor a preset"),
    (["--hf-model", "llama-tiny", "--modes", "eager"], "with --hf-model use --hf-modes"),
    (["--hf-lens", "16"], "--hf-lens need --hf-model"),
    (["--hf-model", "llama-tiny", "--hf-modes", "compile-default", "--kernel-variants", 't={"state_pdl": true}'],
     "this run measures none of them"),
])
def test_argument_refusals(extra, needle, capsys):
    assert tscompile_main(["bench", "--device", "cpu", "--no-progress", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("tscompile: ") and needle in err, err


def test_directory_without_config_json_is_refused(tmp_path, capsys):
    assert tscompile_main(["bench", "--hf-model", str(tmp_path), "--device", "cpu", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("tscompile: ") and "is a directory without config.json" in err and str(tmp_path) in err


def test_presets_map_to_llama_configs():
    """llama-1b is the Llama-3.2-1B shape as transformers' LlamaConfig (no weights drawn here)."""
    from tscompile.models import build_config
    from tscompile.models.hf_save import hf_llama_config

    assert hf_args.hf_presets() == ["llama-1b", "llama-8b", "llama-tiny", "qwen3-next-1b", "qwen3-next-tiny"]
    cfg = hf_llama_config(build_config("llama-1b"))
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size) == (2048, 16, 32, 8, 8192, 128256)
    assert cfg.tie_word_embeddings is True and cfg.rope_parameters["rope_theta"] == 500000.0


@pytest.mark.slow
def test_split_with_inductor_pieces_compiles_once(tmp_path):
    """The bench's own options (Inductor pieces): about a minute of C++ builds on two cores."""
    rc, result, _ = run_cli(tmp_path)
    assert rc == 0
    split = {r["mode"]: r for r in result["rows"]}["tscompile-split"]
    assert split["error"] is None, split["error"]
    assert split["recompiles_after_first_call"] == 0 and split["counters_first_call"]["graphs_compiled"] == 1
    assert split["max_abs_diff_vs_eager"] < 1e-4 and split["tokens_vs_eager"] == "same"


@pytest.mark.gpu
def test_split_replays_piece_graphs_on_cuda(tmp_path, eager_pieces):
    """On CUDA the split mode's rows come from per-bucket piece graphs (20 -> 32, 40 -> 64 tokens),
    with no recompile after the first call, float32 logits at eager's and eager's greedy tokens."""
    rc, result, _ = run_cli(tmp_path, device="cuda", lens=(20, 40), extra=("--dtype", "float32"))
    assert rc == 0 and result["gpu_name"]
    split = {r["mode"]: r for r in result["rows"]}["tscompile-split"]
    assert split["error"] is None, split["error"]
    forward = split["counters_forward"]
    assert forward["user_captures"] > 0 and forward["user_replays"] > 0, forward
    assert split["recompiles_after_first_call"] == 0 and split["graphs_after_first_call"] == 0
    assert split["max_abs_diff_vs_eager"] < 1e-3 and split["tokens_vs_eager"] == "same"
