"""A transformers ``Qwen3NextForCausalLM`` checkpoint (model_type ``qwen3_next``) -> the native hybrid
model: its ``config.json`` read into a ``Qwen3NextConfig`` (mixture-of-experts layers refused) and
the plan of where each stored tensor lands (q/gate, k and v fused into ``wqkv``, gate/up into
``w13``, in_proj_qkvz and in_proj_ba into ``in_proj``, its rows regrouped by kind; the other
linear-attention tensors load under their own names). The way back for the config:
``hf_qwen3_next_config``, transformers' ``Qwen3NextConfig`` of a native one."""

from __future__ import annotations

from types import SimpleNamespace

from tscompile.models.hf_config import _required, architecture_of, model_config_from_hf, rope_from_hf
from tscompile.models.hf_save import hf_rope_parameters
from tscompile.models.llama import ModelConfig
from tscompile.models.qwen3_next import Qwen3NextConfig
from tscompile.models.qwen3_next_linear import check_dense, in_proj_rows

ARCHITECTURE = "Qwen3NextForCausalLM"

# the linear-attention tensors stored and native under the same name below ``linear_attn.``; the two
# input projections go into one native ``in_proj``, their rows regrouped (``qwen3_next_linear.in_proj_rows``)
LINEAR_TENSORS = ("conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight")


def _without_partial_rotary(raw: dict) -> tuple[dict, float]:
    """``raw`` with its partial rotary factor taken out (``rope_from_hf`` reads the rest) and the factor."""
    params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    factor = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    stripped = {k: v for k, v in raw.items() if k != "partial_rotary_factor"}
    for key in ("rope_scaling", "rope_parameters"):
        if raw.get(key):
            stripped[key] = {k: v for k, v in raw[key].items() if k != "partial_rotary_factor"}
    return stripped, factor


def native_config_from_hf(raw: dict) -> ModelConfig:
    """The native config of any supported architecture's ``config.json``: Qwen3-Next's here, the
    Llama family's through ``hf_config.model_config_from_hf``."""
    name, _ = architecture_of(raw)
    return qwen3_next_config_from_hf(raw) if name == ARCHITECTURE else model_config_from_hf(raw)


def qwen3_next_config_from_hf(raw: dict) -> Qwen3NextConfig:
    """The native config of a Qwen3-Next ``config.json``; a config with experts on any layer, or
    with flags the dense model has no weights for, is refused."""
    check_dense(SimpleNamespace(num_experts=raw.get("num_experts", 0), mlp_only_layers=raw.get("mlp_only_layers"),
                                decoder_sparse_step=raw.get("decoder_sparse_step", 1),
                                num_hidden_layers=_required(raw, "num_hidden_layers")))
    if raw.get("attention_bias"):
        raise ValueError("tscompile: attention_bias=true is not supported for Qwen3-Next (the native model has no "
                         "attention biases); pass a checkpoint without them")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"tscompile: hidden_act {act!r} is not supported; only silu (SwiGLU) is")
    stripped, partial = _without_partial_rotary(raw)
    theta, scaling = rope_from_hf(stripped)
    n_heads = _required(raw, "num_attention_heads")
    return Qwen3NextConfig(
        vocab_size=_required(raw, "vocab_size"), dim=_required(raw, "hidden_size"),
        n_layers=_required(raw, "num_hidden_layers"), n_heads=n_heads,
        n_kv_heads=raw.get("num_key_value_heads") or n_heads, intermediate_size=_required(raw, "intermediate_size"),
        rope_theta=theta, rope_scaling=scaling, norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position=_required(raw, "max_position_embeddings"), head_dim=raw.get("head_dim"),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        layer_types=tuple(_required(raw, "layer_types")),
        linear_num_key_heads=_required(raw, "linear_num_key_heads"),
        linear_num_value_heads=_required(raw, "linear_num_value_heads"),
        linear_key_head_dim=_required(raw, "linear_key_head_dim"),
        linear_value_head_dim=_required(raw, "linear_value_head_dim"),
        linear_conv_kernel_dim=_required(raw, "linear_conv_kernel_dim"),
        partial_rotary_factor=partial,
    )


def hf_qwen3_next_config(cfg: Qwen3NextConfig):
    """transformers' ``Qwen3NextConfig`` of a native config (the inverse of ``qwen3_next_config_from_hf``):
    the same layer types and shapes, every MLP dense, no token ids (nothing stops a generation)."""
    import transformers

    rope = {**hf_rope_parameters(cfg), "partial_rotary_factor": cfg.partial_rotary_factor}
    return transformers.Qwen3NextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position, rms_norm_eps=cfg.norm_eps,
        rope_parameters=rope, tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu", attention_bias=False,
        layer_types=list(cfg.layer_types), linear_num_key_heads=cfg.linear_num_key_heads,
        linear_num_value_heads=cfg.linear_num_value_heads, linear_key_head_dim=cfg.linear_key_head_dim,
        linear_value_head_dim=cfg.linear_value_head_dim, linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
        num_experts=0, mlp_only_layers=list(range(cfg.n_layers)),
        eos_token_id=None, bos_token_id=None, pad_token_id=None)


def qwen3_next_weight_plan(cfg: Qwen3NextConfig, target) -> dict:
    """Checkpoint tensor name -> ``target(param, start, stop)`` (checkpoint.py's ``_Target``)."""
    d, q, kv, inter = cfg.head_dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.intermediate_size
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value_dim, hv = cfg.linear_num_value_heads * cfg.linear_value_head_dim, cfg.linear_num_value_heads
    qkvz = 2 * key_dim + 2 * value_dim
    linear_rows = dict(zip(LINEAR_TENSORS, (2 * key_dim + value_dim, hv, hv, cfg.linear_value_head_dim, cfg.dim)))
    native_rows = in_proj_rows(cfg.linear_num_key_heads, hv, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    qkvz_rows, ba_rows = native_rows[:qkvz], native_rows[qkvz:]
    plan = {
        "model.embed_tokens.weight": target("tok_embeddings.weight", 0, cfg.vocab_size),
        "model.norm.weight": target("norm.weight", 0, cfg.dim),
    }
    if not cfg.tie_embeddings:
        plan["lm_head.weight"] = target("output.weight", 0, cfg.vocab_size)
    for i, kind in enumerate(cfg.layer_types):
        hf, nat = f"model.layers.{i}.", f"layers.{i}."
        if kind == "linear_attention":
            for name, rows in linear_rows.items():
                plan[f"{hf}linear_attn.{name}"] = target(f"{nat}linear_attn.{name}", 0, rows)
            in_proj = f"{nat}linear_attn.in_proj.weight"
            plan[f"{hf}linear_attn.in_proj_qkvz.weight"] = target(in_proj, 0, qkvz, rows=qkvz_rows)
            plan[f"{hf}linear_attn.in_proj_ba.weight"] = target(in_proj, qkvz, qkvz + 2 * hv,
                                                                rows=tuple(r - qkvz for r in ba_rows))
        else:
            attn = f"{nat}attention."
            plan[f"{hf}self_attn.q_proj.weight"] = target(f"{attn}wqkv.weight", 0, 2 * q)
            plan[f"{hf}self_attn.k_proj.weight"] = target(f"{attn}wqkv.weight", 2 * q, 2 * q + kv)
            plan[f"{hf}self_attn.v_proj.weight"] = target(f"{attn}wqkv.weight", 2 * q + kv, 2 * q + 2 * kv)
            plan[f"{hf}self_attn.o_proj.weight"] = target(f"{attn}wo.weight", 0, cfg.dim)
            plan[f"{hf}self_attn.q_norm.weight"] = target(f"{attn}q_norm.weight", 0, d)
            plan[f"{hf}self_attn.k_norm.weight"] = target(f"{attn}k_norm.weight", 0, d)
        plan[f"{hf}mlp.gate_proj.weight"] = target(f"{nat}feed_forward.w13.weight", 0, inter)
        plan[f"{hf}mlp.up_proj.weight"] = target(f"{nat}feed_forward.w13.weight", inter, 2 * inter)
        plan[f"{hf}mlp.down_proj.weight"] = target(f"{nat}feed_forward.w2.weight", 0, cfg.dim)
        plan[f"{hf}input_layernorm.weight"] = target(f"{nat}attention_norm.weight", 0, cfg.dim)
        plan[f"{hf}post_attention_layernorm.weight"] = target(f"{nat}ffn_norm.weight", 0, cfg.dim)
    return plan
