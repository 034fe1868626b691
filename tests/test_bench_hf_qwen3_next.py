"""``tscompile bench --hf-model qwen3-next-tiny`` on the CPU: the hybrid preset built as transformers'
``Qwen3NextForCausalLM`` with the engine preset's shapes (layer types, Gated DeltaNet heads, conv
kernel, dense MLPs, tied embeddings), and the bench's rows on it: the logits and greedy tokens of
tscompile-split against eager's in float32, also with its pieces padded to the bucket as under CUDA
graphs. Every hf mode and part runs for this model on the CPU (eager, stock ``torch.compile``
default and reduce-overhead, tscompile and tscompile-split; forward, generate and stream), so none
is an error row; the Inductor-compiled modes take minutes on two cores and are left to the bench
itself, as in test_bench_hf_model.py. What the split graph cannot graph is said: the Gated DeltaNet
piece of the tiny preset runs at the live rows, and a model with those layers in two pieces (the
1B preset's pattern) gets no CUDA graphs. No timing is asserted."""

from __future__ import annotations

import pytest
import torch

from tscompile.bench import hf_args
from tscompile.bench.hf_presets import build_preset_model, preset_hf_config
from tscompile.models import build_config
from tscompile.models.qwen3_next import Qwen3NextTransformer
from tscompile.models.qwen3_next_checkpoint import qwen3_next_config_from_hf
from helpers import one_thread_fixture
from test_bench_hf_model import LENS, NEW_TOKENS, eager_pieces, run_cli  # noqa: F401  (a fixture)

transformers = pytest.importorskip("transformers")

one_thread = pytest.fixture(autouse=True)(one_thread_fixture)

PRESET = "qwen3-next-tiny"


def _engine_fields(cfg) -> dict:
    """The native config's shape under transformers' ``Qwen3NextConfig`` names."""
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.max_position, "rms_norm_eps": cfg.norm_eps,
            "tie_word_embeddings": cfg.tie_embeddings, "layer_types": list(cfg.layer_types),
            "linear_num_key_heads": cfg.linear_num_key_heads, "linear_num_value_heads": cfg.linear_num_value_heads,
            "linear_key_head_dim": cfg.linear_key_head_dim, "linear_value_head_dim": cfg.linear_value_head_dim,
            "linear_conv_kernel_dim": cfg.linear_conv_kernel_dim, "num_experts": 0}


@pytest.mark.parametrize("name", ["qwen3-next-tiny", "qwen3-next-1b"])
def test_preset_config_has_the_engine_presets_shape(name):
    """Field by field, and back through the checkpoint loader's own reading of a config.json."""
    assert name in hf_args.hf_presets()
    cfg, hf = build_config(name), preset_hf_config(name)
    assert type(hf) is transformers.Qwen3NextConfig and hf._attn_implementation == "sdpa"
    assert {k: getattr(hf, k) for k in _engine_fields(cfg)} == _engine_fields(cfg)
    assert hf.rope_parameters["rope_theta"] == cfg.rope_theta
    assert hf.rope_parameters["partial_rotary_factor"] == cfg.partial_rotary_factor
    assert hf.mlp_only_layers == list(range(cfg.n_layers))  # every MLP dense
    assert qwen3_next_config_from_hf(hf.to_dict()) == cfg


@pytest.mark.parametrize("name", ["qwen3-next-tiny", "qwen3-next-1b"])
def test_preset_model_has_the_native_models_parameters(name):
    """The transformers model holds as many parameters as the native one (on the meta device: no
    weights drawn), its layers are the preset's layer types, its MLPs dense, its head tied as the
    preset says."""
    cfg, meta = build_config(name), torch.device("meta")
    model = build_preset_model(name, torch.bfloat16, meta, seed=0)
    with meta:
        native = Qwen3NextTransformer(cfg)
    assert type(model) is transformers.Qwen3NextForCausalLM
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in native.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    layers = model.model.layers
    assert ["linear_attention" if hasattr(layer, "linear_attn") else "full_attention" for layer in layers] \
        == list(cfg.layer_types)
    assert all(type(layer.mlp).__name__ == "Qwen3NextMLP" for layer in layers)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == cfg.tie_embeddings


def test_preset_weights_are_seeded_and_drawn_in_the_bench_dtype():
    cpu = torch.device("cpu")
    a, b = (build_preset_model(PRESET, torch.float32, cpu, seed=0) for _ in range(2))
    other = build_preset_model(PRESET, torch.bfloat16, cpu, seed=1)
    conv = "model.layers.0.linear_attn.conv1d.weight"
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert other.state_dict()[conv].dtype == torch.bfloat16
    assert not torch.equal(a.state_dict()[conv], other.state_dict()[conv].float())


def _check_split_against_eager(result: dict) -> dict:
    """The rows of eager and tscompile-split: no error, float32 logits within rounding of eager's at
    every length, eager's greedy tokens (which are not one token repeated: the check can fail)."""
    assert result["model_class"] == "Qwen3NextForCausalLM" and result["dtype"] == "float32"
    assert result["model_config"]["layer_types"] == list(build_config(PRESET).layer_types)
    rows = {r["mode"]: r for r in result["rows"]}
    assert list(rows) == ["eager", "tscompile-split"]
    for r in rows.values():
        assert r["error"] is None, r["error"]
    eager, split = rows["eager"], rows["tscompile-split"]
    assert len(eager["generate_tokens"]) == NEW_TOKENS and len(set(eager["generate_tokens"])) > 1
    for n in LENS:
        assert split["lengths"][str(n)]["max_abs_diff_vs_eager"] < 1e-4, n
    assert split["tokens_vs_eager"] == "same" and split["generate_tokens"] == eager["generate_tokens"]
    return split


def test_bench_runs_eager_and_split_with_eager_tokens(tmp_path, eager_pieces):
    """Forward, generate (transformers' static cache: its linear-attention layers hold the conv and
    recurrent states) and stream. The split graph breaks at the full-attention layer's SDPA; the
    piece holding the Gated DeltaNet layers reads the token dim through a causal conv (its padded
    output is longer than the token count), so it runs at the live rows: on CUDA without a graph."""
    rc, result, md = run_cli(tmp_path, model=PRESET, extra=("--hf-parts", "forward", "generate", "stream",
                                                            "--hf-stream-prompts", "3", "--hf-stream-lens", "9", "30"))
    assert rc == 0
    split = _check_split_against_eager(result)
    assert split["recompiles_after_first_call"] == 0 and split["graphs_after_first_call"] == 0
    forward = split["counters_forward"]
    assert forward["graph_breaks"] == 0 and forward["breaks"] >= 1
    assert forward["user_live_pieces"] >= 1 and forward["user_padded_pieces"] >= 1, forward
    assert forward["user_graphs_refused"] == 0
    assert split["stream"]["graphs_compiled"] == 1 and split["stream"]["recompiles"] == 0
    assert "(Qwen3NextForCausalLM)" in md and "### A stream of distinct lengths" in md


def test_split_pieces_padded_to_the_bucket_keep_eager_tokens(tmp_path, eager_pieces):
    """``pad_without_graphs``: the split mode pads the token dim to its bucket and slices at the
    breaks exactly as under CUDA graphs; with the default cache (``--hf-use-cache``: the Gated
    DeltaNet layers store their last conv rows and state) padding never shows in the logits or tokens."""
    from tscompile import user_graphs

    with user_graphs.pad_without_graphs():
        rc, result, _ = run_cli(tmp_path, model=PRESET, extra=("--hf-use-cache",))
    assert rc == 0 and result["args"]["use_cache"] is True
    split = _check_split_against_eager(result)
    assert split["counters_forward"]["user_padded_pieces"] >= 1


def test_split_graph_with_delta_rule_layers_in_two_pieces_is_refused_graphs(tmp_path, eager_pieces, caplog):
    """Eight layers, a full-attention layer every fourth (qwen3-next-1b's pattern), as a checkpoint
    directory: the chunked gated delta rule pads the token dim to a multiple of 64, and the pieces
    after the first SDPA take that padding's size as an input, which bucket padding cannot rewrite.
    The split graph gets no CUDA graphs, said in tscompile's log, the row's counters and the counters
    table; it runs unpadded, with eager's logits."""
    from dataclasses import replace

    from tscompile.models.qwen3_next_checkpoint import hf_qwen3_next_config

    cfg = replace(build_config(PRESET), n_layers=8, layer_types=())
    assert cfg.layers_of("full_attention") == (3, 7)
    torch.manual_seed(0)
    transformers.Qwen3NextForCausalLM(hf_qwen3_next_config(cfg)).save_pretrained(tmp_path / "ckpt")
    with caplog.at_level("WARNING", logger="tscompile"):
        rc, result, md = run_cli(tmp_path, model=tmp_path / "ckpt", extra=("--hf-parts", "forward"))
    assert rc == 0 and result["hf_model_kind"] == "checkpoint"
    split = {r["mode"]: r for r in result["rows"]}["tscompile-split"]
    assert split["error"] is None, split["error"]
    assert split["counters_forward"]["user_graphs_refused"] == 1 and split["counters_forward"]["breaks"] >= 2
    assert split["max_abs_diff_vs_eager"] < 1e-4
    refusals = [r.getMessage() for r in caplog.records if "runs without CUDA graphs" in r.getMessage()]
    assert refusals and refusals[0].startswith("tscompile: this graph runs without CUDA graphs: a size argument")
    assert _counters_cell(md, "tscompile-split", "graphs refused") == "1"


def _counters_cell(md: str, mode: str, column: str) -> str:
    """One cell of the markdown's counters table."""
    lines = md.splitlines()
    start = lines.index("### Compiles and graphs") + 2
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    row = next(line for line in lines[start:] if line.startswith(f"| {mode} |"))
    return [c.strip() for c in row.strip("|").split("|")][header.index(column)]
