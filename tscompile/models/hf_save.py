"""Write a native Llama-family model as a Hugging Face checkpoint (transformers' ``save_pretrained``),
the inverse of ``checkpoint.py``: q/k/v and gate/up unfused. Used to build checkpoints of the
presets' random weights for tests and benchmarks; plain Llama layouts only (no q/k/v bias, no q/k
norm)."""

from __future__ import annotations

import os

import torch

from tscompile.models.llama import ModelConfig, Transformer


def hf_rope_parameters(cfg: ModelConfig) -> dict:
    """transformers 5's ``rope_parameters`` of a native config (RoPE ``default``, ``llama3`` or
    ``linear``), the inverse of ``hf_config.rope_from_hf``."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    scaling = dict(cfg.rope_scaling or ())
    kind = scaling.get("rope_type", "llama3") if scaling else "default"
    if kind == "llama3":
        rope.update(rope_type="llama3", factor=scaling["factor"], low_freq_factor=scaling["low_freq_factor"],
                    high_freq_factor=scaling["high_freq_factor"],
                    original_max_position_embeddings=int(scaling["original_max_position"]))
    elif kind == "linear":
        rope.update(rope_type="linear", factor=scaling["factor"])
    return rope


def hf_llama_config(cfg: ModelConfig):
    """transformers' ``LlamaConfig`` of a native config (RoPE ``default`` or ``llama3``)."""
    import transformers

    if cfg.qkv_bias or cfg.qk_norm or cfg.narrow_layer is not None:
        raise ValueError("tscompile: only a plain Llama layout (no q/k/v bias, no q/k norm, no narrowing) is "
                         "written as a transformers checkpoint")
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position, rms_norm_eps=cfg.norm_eps,
        rope_parameters=hf_rope_parameters(cfg), tie_word_embeddings=cfg.tie_embeddings, eos_token_id=None,
        bos_token_id=None)


def hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The native model's weights under transformers' Llama names (views, no copies)."""
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


def to_hf_model(model: Transformer):
    """A transformers ``LlamaForCausalLM`` holding ``model``'s weights, on its device and dtype."""
    import transformers

    weight = model.tok_embeddings.weight
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(weight.dtype)
    try:
        with torch.device(weight.device):
            hf = transformers.LlamaForCausalLM(hf_llama_config(model.config)).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    with torch.no_grad():
        missing, unexpected = hf.load_state_dict({k: v.detach() for k, v in hf_state_dict(model).items()},
                                                 strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return hf


def save_hf_checkpoint(model: Transformer, path: str | os.PathLike, max_shard_size: str = "5GB"):
    """Write ``model`` as a transformers checkpoint directory; returns the transformers model."""
    hf = to_hf_model(model)
    hf.save_pretrained(path, max_shard_size=max_shard_size)
    return hf
