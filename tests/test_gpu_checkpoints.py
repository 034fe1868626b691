"""Checkpoints on the GPU: the 1B and 8B presets' random weights written by transformers'
``save_pretrained`` load back into the same tokens, transformers' bf16 logits agree, and the load
speed is reported (``TSCOMPILE_REPORT_DIR`` collects it as JSON). Skipped without CUDA."""

import json
import os

import pytest
import torch

import tscompile
from tscompile import SamplingParams
from tscompile.models import ModelConfig

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu

PROMPTS = [[(13 * i + 7 * j) % 30000 + 5 for j in range(17 + 11 * i)] for i in range(4)]


def hf_config(cfg: ModelConfig):
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    scaling = dict(cfg.rope_scaling or ())
    if scaling.get("rope_type", "llama3") == "llama3" and scaling:
        rope.update(rope_type="llama3", factor=scaling["factor"], low_freq_factor=scaling["low_freq_factor"],
                    high_freq_factor=scaling["high_freq_factor"],
                    original_max_position_embeddings=int(scaling["original_max_position"]))
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        max_position_embeddings=cfg.max_position, rms_norm_eps=cfg.norm_eps, rope_parameters=rope,
        tie_word_embeddings=cfg.tie_embeddings, eos_token_id=None, bos_token_id=None)


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """The native model's weights under transformers' Llama names (q/k/v and gate/up unfused)."""
    cfg = model.config
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    sd = {"model.embed_tokens.weight": model.tok_embeddings.weight, "model.norm.weight": model.norm.weight,
          "lm_head.weight": model.output.weight}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        wq, wk, wv = layer.attention.wqkv.weight.split([q, kv, kv])
        gate, up = layer.feed_forward.w13.weight.chunk(2)
        sd.update({p + "self_attn.q_proj.weight": wq, p + "self_attn.k_proj.weight": wk,
                   p + "self_attn.v_proj.weight": wv, p + "self_attn.o_proj.weight": layer.attention.wo.weight,
                   p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                   p + "mlp.down_proj.weight": layer.feed_forward.w2.weight,
                   p + "input_layernorm.weight": layer.attention_norm.weight,
                   p + "post_attention_layernorm.weight": layer.ffn_norm.weight})
    return sd


def _engine(model, **kw):
    return tscompile.LLM(model, enforce_eager=True, device="cuda", dtype=torch.bfloat16, max_model_len=256,
                         max_num_seqs=4, page_size=16, attention_backend="triton", **kw)


def _prefill_logits(llm, prompt):
    seen = []
    hook = llm.model.output.register_forward_hook(lambda m, a, out: seen.append(out.float().clone()))
    try:
        llm.generate([prompt], SamplingParams(max_new_tokens=1))
    finally:
        hook.remove()
    return seen[0][0]


def _report(name: str, value: dict) -> None:
    folder = os.environ.get("TSCOMPILE_REPORT_DIR")
    if folder:
        with open(os.path.join(folder, f"{name}.json"), "w") as f:
            json.dump(value, f, indent=1)


@pytest.mark.parametrize("preset", ["llama-1b", pytest.param("llama-8b", marks=pytest.mark.slow)])
def test_a_checkpoint_saved_by_transformers_gives_the_presets_tokens(preset, tmp_path):
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    reference = _engine(preset)
    expected = [o.outputs[0].token_ids for o in reference.generate(PROMPTS, params)]
    cfg = reference.model.config
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            hf = transformers.LlamaForCausalLM(hf_config(cfg)).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    with torch.no_grad():
        hf.load_state_dict({k: v.detach() for k, v in hf_state_dict(reference.model).items()}, strict=False)
    hf.save_pretrained(tmp_path, max_shard_size="5GB")
    assert (tmp_path / "model.safetensors.index.json").exists() or preset == "llama-1b"

    loaded = _engine(str(tmp_path))
    info = loaded.parts.checkpoint
    got = [o.outputs[0].token_ids for o in loaded.generate(PROMPTS, params)]
    assert got == expected
    ours = _prefill_logits(loaded, PROMPTS[1])
    with torch.no_grad():
        theirs = hf(torch.tensor([PROMPTS[1]], device="cuda")).logits[0, -1].float()
    rel = float((ours - theirs).norm() / theirs.norm())
    assert rel < 3e-2, f"bf16 logits differ from transformers' by {rel:.3g} (relative L2)"
    _report(f"checkpoint_{preset}", {"gb": info.bytes_read / 1e9, "load_seconds": info.load_seconds,
                                     "gb_per_s": info.gb_per_s, "logits_rel_l2_vs_transformers": rel,
                                     "top1_equal": int(ours.argmax()) == int(theirs.argmax())})
    print(f"{preset}: loaded {info.bytes_read / 1e9:.1f} GB in {info.load_seconds:.2f} s "
          f"({info.gb_per_s:.2f} GB/s); logits rel L2 vs transformers {rel:.2e}")
