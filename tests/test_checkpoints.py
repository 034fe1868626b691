"""Hugging Face checkpoints: tiny random models written by transformers, loaded natively, compared to transformers.

Each family's checkpoint is written once per module. Weights are redrawn at O(1) scale (norm weights
around 1, not 1) so attention is sharp and a RoPE, q/k-norm, bias or fusion mistake moves the logits.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import tscompile
from tscompile.runtime.dynamic_sizes import min_logits_rows
from tscompile.bench.workloads import StaticCacheRunner
from tscompile.models import ModelConfig, build_model, is_checkpoint_dir, load_checkpoint, load_model
from tscompile.models.hf_config import eos_token_ids, model_config_from_hf, rope_from_hf

transformers = pytest.importorskip("transformers")

PROMPTS = [[17], [5, 250, 3, 99, 42], list(range(7, 20)), [(i * 37) % 300 for i in range(30)]]
NEW_TOKENS = 8
TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)


def run_engine(model, prompts, max_new_tokens=NEW_TOKENS):
    """Every engine call of this file: ``(new token ids per prompt, prefill logits [len(prompts), vocab])``.

    The prefill logits are the LM head's output at the first step, whose rows are each request's last row."""
    captured = []
    hook = model.output.register_forward_hook(lambda mod, args, out: captured.append(out.detach().float().clone()))
    try:
        llm = tscompile.LLM(model, enforce_eager=True, device="cpu", attention_backend="torch", max_model_len=64,
                            max_num_seqs=4, page_size=4)
        tokens = [o.outputs[0].token_ids
                  for o in llm.generate(prompts, tscompile.SamplingParams(max_new_tokens=max_new_tokens))]
    finally:
        hook.remove()
    # every prompt prefills in the first step; a one-request step samples min_logits_rows rows (row 0 its own)
    assert captured[0].shape[0] == max(len(prompts), min_logits_rows(4)), "all prompts must prefill in the first step"
    return tokens, captured[0][: len(prompts)]


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1 + 0.3 * r)
            elif name.endswith("bias"):
                p.copy_(0.5 * r)
            elif "embed_tokens" in name:
                p.copy_(r)
            else:
                p.copy_(r / p.shape[-1] ** 0.5)


FAMILIES = {
    # llama3 scaling with original length 32: the head's wavelengths fall in all three bands
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True, rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0,
                                                       low_freq_factor=1.0, high_freq_factor=4.0,
                                                       original_max_position_embeddings=32))),
    "llama-linear": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=False, rope_parameters=dict(rope_type="linear", rope_theta=5000.0, factor=4.0))),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, use_sliding_window=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (checkpoint directory, the transformers model it holds)."""
    out = {}
    for seed, (family, (config_cls, model_cls, extra)) in enumerate(FAMILIES.items()):
        torch.manual_seed(seed)
        cfg = getattr(transformers, config_cls)(**TINY, **extra)
        hf = getattr(transformers, model_cls)(cfg).eval()
        _randomize(hf, seed)
        path = tmp_path_factory.mktemp(family)
        hf.save_pretrained(path, max_shard_size="100KB" if family == "llama3" else "50MB")
        hf.generation_config.eos_token_id = None  # both sides run the full length
        hf.generation_config.pad_token_id = 0
        out[family] = (path, hf)
    # what real Qwen2 configs carry: a window value that use_sliding_window=false switches off
    qwen2_config = out["qwen2"][0] / "config.json"
    raw = json.loads(qwen2_config.read_text())
    qwen2_config.write_text(json.dumps({**raw, "sliding_window": 16, "use_sliding_window": False}))
    return out


@torch.no_grad()
def _hf_last_logits(hf, prompts) -> torch.Tensor:
    return torch.stack([hf(torch.tensor([p])).logits[0, -1].float() for p in prompts])


@torch.no_grad()
def _hf_greedy(hf, prompt) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                      min_new_tokens=NEW_TOKENS)
    return out[0, len(prompt):].tolist()


# -- the loaded model computes what transformers computes ------------------------------------------------------

@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_greedy_tokens_match_transformers(checkpoints, family):
    path, hf = checkpoints[family]
    model, info = load_checkpoint(path, device="cpu")
    assert info.architecture == FAMILIES[family][1]
    tokens, prefill_logits = run_engine(model, PROMPTS)
    want = _hf_last_logits(hf, PROMPTS)
    assert (prefill_logits - want).abs().max().item() < 1e-4
    assert want.std() > 0.5  # logits spread enough that the tolerance means something
    assert tokens == [_hf_greedy(hf, p) for p in PROMPTS]


def test_sharded_tied_llama3_layout(checkpoints):
    path, _ = checkpoints["llama3"]
    assert (path / "model.safetensors.index.json").is_file()
    assert len(set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    model, info = load_checkpoint(path, device="cpu")
    cfg = model.config
    assert cfg.tie_embeddings and model.output.weight is model.tok_embeddings.weight
    assert cfg.rope_type == "llama3" and dict(cfg.rope_scaling)["original_max_position"] == 32.0
    stored = sum(t.numel() * t.element_size() for f in path.glob("*.safetensors") for t in load_file(f).values())
    assert info.bytes_read == stored and info.load_seconds > 0 and info.gb_per_s > 0
    assert info.max_position == 128 and info.path == path and info.checkpoint_dtype == torch.float32


def test_qwen3_head_dim_and_qk_norm(checkpoints):
    model, _ = load_checkpoint(checkpoints["qwen3"][0], device="cpu")
    cfg = model.config
    assert cfg.qk_norm and cfg.head_dim == 32 != cfg.dim // cfg.n_heads
    attn = model.layers[0].attention
    assert attn.wqkv.weight.shape == ((4 + 2 * 2) * 32, 64) and attn.wo.weight.shape == (64, 4 * 32)
    assert not torch.allclose(attn.q_norm.weight, torch.ones(32))


def test_qwen2_biases_are_fused(checkpoints):
    path, hf = checkpoints["qwen2"]
    model, _ = load_checkpoint(path, device="cpu")  # sliding_window 16 with use_sliding_window false loads
    hf_attn = hf.model.layers[1].self_attn
    want = torch.cat([hf_attn.q_proj.bias, hf_attn.k_proj.bias, hf_attn.v_proj.bias])
    assert torch.equal(model.layers[1].attention.wqkv.bias, want)


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama-linear"])
def test_static_cache_baseline_matches_transformers(checkpoints, family):
    path, hf = checkpoints[family]
    model, _ = load_checkpoint(path, device="cpu")
    prompt = PROMPTS[2]
    runner = StaticCacheRunner(model, "compile-default", torch.device("cpu"), compiled=False, cache_len=32)
    got = runner.run_batch([prompt], NEW_TOKENS).tokens
    assert got[0] == _hf_greedy(hf, prompt)


def test_dtype_override_keeps_rope_float32(checkpoints):
    model, info = load_checkpoint(checkpoints["qwen3"][0], device="cpu", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.inv_freq.dtype == torch.float32 and info.checkpoint_dtype == torch.float32
    default, _ = load_checkpoint(checkpoints["qwen3"][0], device="cpu")
    assert {p.dtype for p in default.parameters()} == {torch.float32}


def test_load_model_and_build_model_take_all_three_kinds(checkpoints):
    path = checkpoints["mistral"][0]
    assert is_checkpoint_dir(path) and is_checkpoint_dir(str(path)) and not is_checkpoint_dir("llama-tiny")
    model, info = load_model(str(path), device="cpu")
    assert info.architecture == "MistralForCausalLM"
    assert build_model(path).config == model.config
    assert load_model("llama-tiny", device="cpu")[1] is None
    assert load_model(ModelConfig(head_dim=32, qk_norm=True), device="cpu")[0].config.head_dim == 32


# -- config dialects ---------------------------------------------------------------------------------------------

def test_transformers4_config_dialect_loads_the_same_model(checkpoints, tmp_path):
    src = checkpoints["llama-linear"][0]
    raw = json.loads((src / "config.json").read_text())
    assert raw["rope_parameters"]["rope_type"] == "linear"  # the v5 dialect, as written by save_pretrained
    old = {k: v for k, v in raw.items() if k not in ("rope_parameters", "dtype")}
    old.update(rope_theta=5000.0, rope_scaling={"type": "linear", "factor": 4.0}, torch_dtype="float32",
               eos_token_id=2)
    (tmp_path / "config.json").write_text(json.dumps(old))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    shutil.copy(src / "model.safetensors", tmp_path / "model.safetensors")
    v4_model, v4_info = load_checkpoint(tmp_path, device="cpu")
    v5_model, _ = load_checkpoint(src, device="cpu")
    assert v4_model.config == v5_model.config and v4_model.config.rope_type == "linear"
    assert v4_model.config.rope_theta == 5000.0
    assert v4_info.eos_token_ids == (7, 2) and v4_info.checkpoint_dtype == torch.float32
    v4_state, v5_state = v4_model.state_dict(), v5_model.state_dict()
    assert v4_state.keys() == v5_state.keys() and all(torch.equal(v4_state[k], v5_state[k]) for k in v4_state)
    assert torch.equal(v4_model.inv_freq, v5_model.inv_freq)


def test_llama3_rope_in_both_dialects():
    scaling = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    v4 = {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **scaling}, "max_position_embeddings": 1}
    v5 = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **scaling}}
    assert rope_from_hf(v4) == rope_from_hf(v5) == (500000.0, tscompile.models.PRESETS["llama-1b"].rope_scaling)
    assert rope_from_hf({"rope_theta": 1e6}) == (1e6, None)
    assert rope_from_hf({"rope_parameters": {"rope_type": "default", "rope_theta": 7.0}}) == (7.0, None)
    # without original_max_position_embeddings transformers uses max_position_embeddings
    fallback = dict(rope_from_hf({"rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0}, "max_position_embeddings": 64})[1])
    assert fallback["original_max_position"] == 64.0


def test_rope_frequencies_match_transformers(checkpoints):
    for family in ("llama3", "llama-linear"):
        path, hf = checkpoints[family]
        model, _ = load_checkpoint(path, device="cpu")
        torch.testing.assert_close(model.inv_freq, hf.model.rotary_emb.inv_freq.float(), rtol=1e-6, atol=0)


def test_rope_rows_match_transformers_and_stay_float32_in_any_dtype(checkpoints):
    """The forward gathers cos / sin rows from tables built once; they must be transformers' own cos /
    sin at those positions (its rotary embedding in float32), and stay float32 under a bf16 load."""
    for family in ("llama3", "llama-linear"):
        path, hf = checkpoints[family]
        for dtype in (torch.float32, torch.bfloat16):
            model, _ = load_checkpoint(path, device="cpu", dtype=dtype)
            assert model.rope_cos.dtype == model.rope_sin.dtype == torch.float32
            assert model.rope_cos.shape == (model.config.max_position, model.config.head_dim // 2)
            positions = torch.randint(0, model.config.max_position, (37,))
            positions[0] = model.config.max_position - 1
            cos, sin = model.rope(positions)
            want_cos, want_sin = hf.model.rotary_emb(torch.randn(1, 37, model.config.head_dim), positions[None])
            half = model.config.head_dim // 2
            torch.testing.assert_close(cos, want_cos[0, :, :half].float())
            torch.testing.assert_close(sin, want_sin[0, :, :half].float())


def test_a_random_bf16_model_gathers_the_float32_rope_rows_it_would_compute():
    model = build_model(ModelConfig(max_position=300, rope_theta=500000.0,
                                    rope_scaling=tscompile.models.PRESETS["llama-1b"].rope_scaling),
                        dtype=torch.bfloat16, device="cpu")
    assert model.tok_embeddings.weight.dtype == torch.bfloat16 and model.rope_cos.dtype == torch.float32
    positions = torch.tensor([299, 0, 7, 150, 7])
    freqs = positions.float()[:, None] * model.inv_freq[None, :]  # what each forward computed before the tables
    cos, sin = model.rope(positions)
    assert torch.equal(cos, torch.cos(freqs)) and torch.equal(sin, torch.sin(freqs))
    model.to(torch.bfloat16)  # a cast of the whole model rounds the tables: refused, not used
    with pytest.raises(ValueError, match=r"^tscompile: RoPE tables are torch.bfloat16.*reset_rope"):
        model.rope(positions)
    model.reset_rope("cpu")
    assert torch.equal(model.rope(positions)[0], cos)


def test_eos_ids_union_keeps_order():
    assert eos_token_ids({"eos_token_id": [5, 7]}, {"eos_token_id": 9}) == (5, 7, 9)
    assert eos_token_ids({"eos_token_id": 7}, {"eos_token_id": [9, 7]}) == (7, 9)
    assert eos_token_ids(None, {"eos_token_id": None}) == ()


# -- refusals ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["meta-llama/Llama-3.2-1B", "/no/such/checkpoint"])
def test_hub_id_or_missing_directory_is_refused(name):
    with pytest.raises(ValueError, match=r"^tscompile: .*local checkpoint directory"):
        load_checkpoint(name)
    with pytest.raises(ValueError, match=r"^tscompile: .*local checkpoint directory"):
        build_model(name)


def _copy_with_config(src: Path, dst: Path, **changes) -> Path:
    raw = {**json.loads((src / "config.json").read_text()), **changes}
    (dst / "config.json").write_text(json.dumps(raw))
    shutil.copy(src / "model.safetensors", dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("changes,message", [
    ({"architectures": ["GPT2LMHeadModel"]}, r"GPT2LMHeadModel.*supported: LlamaForCausalLM, MistralForCausalLM, "
                                             r"Qwen2ForCausalLM, Qwen3ForCausalLM"),
    ({"attention_bias": True}, r"attention_bias=true is not supported"),
    ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, r"RoPE type 'yarn'.*llama3"),
    ({"quantization_config": {"quant_method": "awq"}}, r"quantized checkpoints .*'awq'"),
], ids=["architecture", "attention-bias", "activation", "rope-type", "quantized"])
def test_unsupported_configs_are_refused(checkpoints, tmp_path, changes, message):
    path = _copy_with_config(checkpoints["mistral"][0], tmp_path, **changes)
    with pytest.raises(ValueError, match=r"^tscompile: .*" + message):
        load_checkpoint(path, device="cpu")


def test_active_mistral_window_is_refused(checkpoints, tmp_path):
    path = _copy_with_config(checkpoints["mistral"][0], tmp_path, sliding_window=16)
    with pytest.raises(ValueError, match=r"^tscompile: sliding_window 16 .*max_model_len 64"):
        load_checkpoint(path, device="cpu", max_model_len=64)
    with pytest.raises(ValueError, match=r"^tscompile: sliding_window 16 .*max_model_len 128"):
        load_checkpoint(path, device="cpu")  # default: the config's max position
    model, _ = load_checkpoint(path, device="cpu", max_model_len=16)  # a window that covers it masks nothing
    assert model.config.max_position == 128


def _with_tensors(src: Path, dst: Path, edit) -> Path:
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


K0 = "model.layers.0.self_attn.k_proj.weight"
UP1 = "model.layers.1.mlp.up_proj.weight"


@pytest.mark.parametrize("edit,messages", [
    (lambda t: t.pop(K0), [rf"missing tensor {K0}: expected shape \(32, 64\), found none"]),
    (lambda t: t.pop("lm_head.weight"), [r"missing tensor lm_head.weight: expected shape \(300, 64\), found none "
                                         r"\(a checkpoint may omit it only with tie_word_embeddings: true\)"]),
    (lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}),
     [r"unexpected tensor model.layers.0.self_attn.o_proj.bias: expected none, found shape \(64,\)"]),
    (lambda t: t.update({UP1: torch.randn(95, 64)}), [rf"tensor {UP1}: expected shape \(96, 64\), found \(95, 64\)"]),
    (lambda t: (t.pop(K0), t.update({UP1: torch.randn(96, 63)})),  # every problem is reported, not the first
     [r"\(2 problems\)", rf"missing tensor {K0}", rf"tensor {UP1}: expected shape \(96, 64\), found \(96, 63\)"]),
], ids=["missing", "missing-untied-head", "unexpected", "wrong-shape", "several"])
def test_tensor_mismatches_are_refused(checkpoints, tmp_path, edit, messages):
    path = _with_tensors(checkpoints["mistral"][0], tmp_path, edit)
    with pytest.raises(ValueError, match=r"^tscompile: checkpoint .* does not match its config") as err:
        load_checkpoint(path, device="cpu")
    for message in messages:
        assert re.search(message, str(err.value)), (message, str(err.value))


def _truncate(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _garbage(path: Path) -> None:
    path.write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0),
                                   dtype=torch.uint8).numpy().tobytes())


def _first_shard(root: Path) -> Path:
    return root / sorted(set(json.loads((root / "model.safetensors.index.json").read_text())["weight_map"].values()))[0]


# family of the checkpoint damaged, the damage, the file the refusal must name, what it must say
DAMAGES = {
    "truncated-safetensors": ("mistral", lambda d: _truncate(d / "model.safetensors", 0.5), "model.safetensors",
                              "is not a readable safetensors file"),
    "safetensors-missing-its-last-bytes": ("mistral", lambda d: _truncate(d / "model.safetensors", 0.999),
                                           "model.safetensors", "is not a readable safetensors file"),
    "garbage-safetensors": ("mistral", lambda d: _garbage(d / "model.safetensors"), "model.safetensors",
                            "is not a readable safetensors file"),
    "malformed-config": ("mistral", lambda d: _truncate(d / "config.json", 0.5), "config.json", "is not valid JSON"),
    "config-not-an-object": ("mistral", lambda d: (d / "config.json").write_text("[1, 2]"), "config.json",
                             "must hold a JSON object, got list"),
    "malformed-generation-config": ("mistral", lambda d: (d / "generation_config.json").write_text("{"),
                                    "generation_config.json", "is not valid JSON"),
    "missing-shard": ("llama3", lambda d: _first_shard(d).unlink(), "model-00001-of-", "named by "
                      "model.safetensors.index.json is missing"),
    "truncated-shard": ("llama3", lambda d: _truncate(_first_shard(d), 0.5), "model-00001-of-",
                        "is not a readable safetensors file"),
    "malformed-index": ("llama3", lambda d: _truncate(d / "model.safetensors.index.json", 0.5),
                        "model.safetensors.index.json", "is not valid JSON"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_checkpoint_is_refused_naming_the_file(checkpoints, tmp_path, damage, capsys):
    from tscompile.cli import main

    family, edit, file, message = DAMAGES[damage]
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoints[family][0], path)
    if not (path / "generation_config.json").exists():
        (path / "generation_config.json").write_text("{}")
    edit(path)
    pattern = rf"^tscompile: .*{re.escape(file)}.*{re.escape(message)}"
    with pytest.raises(ValueError, match=pattern):
        tscompile.LLM(str(path), device="cpu", enforce_eager=True, max_model_len=32, max_num_seqs=2)
    # the command line says it in one line, without a traceback
    assert main(["generate", "--model", str(path), "--device", "cpu", "--enforce-eager", "--max-model-len", "32",
                 "--prompt-ids", "1,2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(pattern, err[0]), err
    if file == "config.json":  # what reads the config alone (the bench) refuses it the same way
        from tscompile.models import model_config

        with pytest.raises(ValueError, match=pattern):
            model_config(str(path))


# -- ModelConfig -----------------------------------------------------------------------------------------------

def test_model_config_round_trips_new_fields():
    cfg = ModelConfig(dim=64, n_heads=4, n_kv_heads=2, head_dim=32, qk_norm=True, qkv_bias=True,
                      tie_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert cfg.rope_scaling == (("factor", 4.0), ("rope_type", "linear")) and hash(cfg)
    again = ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and again.head_dim == 32 and again.qk_norm and again.rope_type == "linear"
    for preset in tscompile.models.PRESETS.values():  # each family's config class reads its own dicts
        assert type(preset).from_dict(json.loads(json.dumps(preset.to_dict()))) == preset


def test_model_config_reads_dicts_written_before_the_new_fields():
    old = tscompile.models.PRESETS["llama-1b"].to_dict()
    del old["head_dim"], old["qk_norm"]
    old["rope_scaling"] = {k: v for k, v in old["rope_scaling"].items() if k != "rope_type"}  # llama3 implied
    assert ModelConfig.from_dict(old) == tscompile.models.PRESETS["llama-1b"]
    assert ModelConfig.from_dict(old).head_dim == 64


def test_model_config_refuses_bad_rope_scaling_and_head_dim():
    with pytest.raises(ValueError, match=r"^tscompile: rope scaling type 'yarn'"):
        ModelConfig(rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match=r"^tscompile: linear rope scaling takes exactly \['factor'\]"):
        ModelConfig(rope_scaling={"rope_type": "linear"})
    with pytest.raises(ValueError, match=r"^tscompile: head_dim 15"):
        ModelConfig(head_dim=15)
    assert ModelConfig(rope_scaling={"rope_type": "default"}).rope_scaling is None


def test_qwen3_config_mapping():
    raw = {"architectures": ["Qwen3ForCausalLM"], **TINY, "head_dim": 32, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
           "tie_word_embeddings": True, "attention_bias": False, "sliding_window": None}
    cfg = model_config_from_hf(raw)
    assert (cfg.head_dim, cfg.qk_norm, cfg.qkv_bias, cfg.tie_embeddings, cfg.rope_theta) == (32, True, False, True, 1e6)


def test_a_native_model_saved_as_a_transformers_checkpoint_loads_back_identically(tmp_path):
    """``save_hf_checkpoint`` is the loader's inverse (the GPU tests write the presets with it)."""
    from tscompile.models.hf_save import save_hf_checkpoint

    cfg = ModelConfig(vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=96,
                      max_position=128, tie_embeddings=True,
                      rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                                    ("original_max_position", 64.0), ("rope_type", "llama3")))
    model = build_model(cfg, seed=3)
    hf = save_hf_checkpoint(model, tmp_path)
    loaded, _ = load_checkpoint(tmp_path, device="cpu")
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        if not name.endswith(("k_cache", "v_cache")):
            assert torch.equal(a, b), name
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        theirs = hf(ids).logits[0, -1]
    ours = run_engine(loaded, [PROMPTS[2]], max_new_tokens=1)[1][0]
    assert (ours - theirs).abs().max() < 1e-4


def test_compiled_engine_matches_transformers_batched_and_one_at_a_time(checkpoints):
    """The compiled engine (decode whole, prefill piecewise) from a checkpoint directory: the greedy
    tokens of transformers, for the batch and for each prompt alone. Qwen3: q/k norm and a head_dim
    apart from hidden / heads, the layout furthest from the presets (one compile keeps CI short)."""
    path, hf = checkpoints["qwen3"]
    llm = tscompile.LLM(str(path), device="cpu", attention_backend="torch", max_model_len=64, max_num_seqs=4,
                        page_size=4)
    params = tscompile.SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    alone = [llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in PROMPTS]
    assert batched == alone == [_hf_greedy(hf, p) for p in PROMPTS]
