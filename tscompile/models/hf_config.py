"""Hugging Face ``config.json`` -> ``ModelConfig``: the supported architectures and one small mapping per concern.

Both config dialects are read: transformers 4 (top-level ``rope_theta``, a ``rope_scaling`` dict whose type
is under ``rope_type`` or ``type``, ``torch_dtype``) and transformers 5 (``rope_parameters`` holding
``rope_theta``, ``rope_type`` and the scaling parameters, ``dtype``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tscompile.models.llama import ModelConfig


@dataclass(frozen=True)
class ArchitectureSpec:
    """What a ``*ForCausalLM`` class adds to the Llama decoder (weight names are shared by all of them)."""

    qkv_bias: bool = False  # q/k/v projections always carry biases (Qwen2 hard-codes them)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    # config flags that would add weights the native model has no place for (o_proj / MLP biases)
    must_be_false: tuple[str, ...] = ("attention_bias", "mlp_bias")


ARCHITECTURES: dict[str, ArchitectureSpec] = {
    "LlamaForCausalLM": ArchitectureSpec(),
    "MistralForCausalLM": ArchitectureSpec(),
    "Qwen2ForCausalLM": ArchitectureSpec(qkv_bias=True),
    "Qwen3ForCausalLM": ArchitectureSpec(qk_norm=True),
    # the hybrid family: its own config reader and weight plan (models/qwen3_next_checkpoint.py)
    "Qwen3NextForCausalLM": ArchitectureSpec(qk_norm=True),
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_json_object(path: Path) -> dict:
    """The JSON object in ``path`` (a checkpoint's ``config.json``, ``generation_config.json`` or
    ``model.safetensors.index.json``); a file that is not one is refused naming it, not with a parser
    traceback."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"tscompile: {str(path)!r} is not valid JSON ({e}); the checkpoint is damaged: "
                         "write or download that file again") from None
    if not isinstance(raw, dict):
        raise ValueError(f"tscompile: {str(path)!r} must hold a JSON object, got {type(raw).__name__}; the "
                         "checkpoint is damaged: write or download that file again")
    return raw


def architecture_of(raw: dict) -> tuple[str, ArchitectureSpec]:
    names = raw.get("architectures") or []
    if len(names) != 1 or names[0] not in ARCHITECTURES:
        raise ValueError(f"tscompile: checkpoint architecture {names} is not supported; supported: "
                         f"{', '.join(ARCHITECTURES)}")
    return names[0], ARCHITECTURES[names[0]]


def _required(raw: dict, key: str):
    if raw.get(key) is None:
        raise ValueError(f"tscompile: config.json has no {key!r}; the checkpoint's config is incomplete")
    return raw[key]


def rope_from_hf(raw: dict) -> tuple[float, tuple | None]:
    """``(rope_theta, ModelConfig.rope_scaling)`` from either dialect's RoPE fields."""
    params = dict(raw.get("rope_scaling") or {})  # transformers 4
    params.update(raw.get("rope_parameters") or {})  # transformers 5 (wins where both are present)
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"tscompile: partial_rotary_factor {partial} is not supported; RoPE must cover the "
                         "whole head (1.0)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, (("factor", float(params["factor"])), ("rope_type", "linear"))
    if rope_type == "llama3":
        # transformers falls back to max_position_embeddings when the original length is absent
        orig = params.get("original_max_position_embeddings", raw.get("max_position_embeddings"))
        return theta, tuple(sorted({
            "factor": float(params["factor"]), "low_freq_factor": float(params["low_freq_factor"]),
            "high_freq_factor": float(params["high_freq_factor"]), "original_max_position": float(orig),
            "rope_type": "llama3",
        }.items()))
    raise ValueError(f"tscompile: RoPE type {rope_type!r} is not supported; supported: default, linear, llama3")


def checkpoint_dtype(raw: dict) -> torch.dtype | None:
    """The dtype the weights were saved in (``dtype`` in transformers 5, ``torch_dtype`` in 4), if stated as
    one of float32/bfloat16/float16; otherwise None and the caller reads the stored tensors' dtype."""
    return _DTYPES.get(raw.get("dtype") or raw.get("torch_dtype"))


def active_sliding_window(raw: dict) -> int | None:
    """The sliding window attention uses, or None. Qwen2/Qwen3 configs carry ``sliding_window`` next to
    ``use_sliding_window: false``, which means no window; Mistral has no switch, only the value."""
    if not raw.get("use_sliding_window", True):
        return None
    return raw.get("sliding_window")


def check_sliding_window(raw: dict, max_model_len: int) -> None:
    """A window at least ``max_model_len`` long never masks anything, so full attention is exact."""
    window = active_sliding_window(raw)
    if window is not None and window < max_model_len:
        raise ValueError(f"tscompile: sliding_window {window} is active and shorter than max_model_len "
                         f"{max_model_len}; sliding-window attention is not supported, so pass "
                         f"max_model_len <= {window}")


def eos_token_ids(*sources: dict | None) -> tuple[int, ...]:
    """The union of ``eos_token_id`` (an int, a list or null) over the sources, first-seen order kept."""
    ids: list[int] = []
    for src in sources:
        value = (src or {}).get("eos_token_id")
        for i in [value] if isinstance(value, int) else (value or []):
            if i not in ids:
                ids.append(int(i))
    return tuple(ids)


def model_config_from_hf(raw: dict) -> ModelConfig:
    """The native config of a Llama-family architecture's ``config.json`` (as a dict); a hybrid
    Qwen3-Next config goes through ``qwen3_next_checkpoint.native_config_from_hf``."""
    name, spec = architecture_of(raw)
    if name == "Qwen3NextForCausalLM":  # its own reader (models/qwen3_next_checkpoint.py), which imports this one
        raise ValueError("tscompile: a Qwen3-Next config.json is read by native_config_from_hf, not by the Llama "
                         "family's model_config_from_hf")
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "?")
        raise ValueError(f"tscompile: quantized checkpoints (quantization_config, quant_method {method!r}) are not "
                         "supported; pass a float32/bfloat16/float16 checkpoint")
    for flag in spec.must_be_false:
        if raw.get(flag):
            raise ValueError(f"tscompile: {flag}=true is not supported (the native model has no o_proj/MLP "
                             "biases); only q/k/v biases are")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"tscompile: hidden_act {act!r} is not supported; only silu (SwiGLU) is")
    theta, scaling = rope_from_hf(raw)
    n_heads = _required(raw, "num_attention_heads")
    return ModelConfig(
        vocab_size=_required(raw, "vocab_size"),
        dim=_required(raw, "hidden_size"),
        n_layers=_required(raw, "num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=raw.get("num_key_value_heads") or n_heads,
        intermediate_size=_required(raw, "intermediate_size"),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position=_required(raw, "max_position_embeddings"),
        head_dim=raw.get("head_dim"),  # None: hidden_size // heads, as transformers derives it
        qkv_bias=spec.qkv_bias,
        qk_norm=spec.qk_norm,
        # absent means False: the default of every class in ARCHITECTURES
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )
