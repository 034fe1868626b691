"""The presets ``tscompile bench --hf-model PRESET`` builds as stock transformers models: a tscompile
preset's shape in the transformers config of its family (``LlamaConfig`` for the Llama presets,
``Qwen3NextConfig`` for the hybrid Qwen3-Next ones), with weights drawn by transformers' own
initialisation under a seed. Presets transformers cannot express (the narrowing layer, q/k norms or
q/k/v biases on a Llama layout) are not offered."""

from __future__ import annotations

import torch


def _hf_config_builder(cfg):
    """The function writing ``cfg`` as a transformers config, or None if its family has none."""
    from tscompile.models import Qwen3NextConfig
    from tscompile.models.hf_save import hf_llama_config
    from tscompile.models.qwen3_next_checkpoint import hf_qwen3_next_config

    if isinstance(cfg, Qwen3NextConfig):  # before the Llama test: a Qwen3-Next config has q/k norms
        return hf_qwen3_next_config
    if cfg.narrow_layer is None and not cfg.qk_norm and not cfg.qkv_bias:
        return hf_llama_config
    return None


def hf_presets() -> list[str]:
    """The tscompile presets that have a stock transformers equivalent."""
    from tscompile.models import PRESETS

    return sorted(name for name, cfg in PRESETS.items() if _hf_config_builder(cfg) is not None)


def preset_hf_config(name: str):
    """transformers' config of preset ``name`` (``LlamaConfig`` or ``Qwen3NextConfig``), SDPA attention
    (``split_sdpa`` breaks at it)."""
    from tscompile.models import build_config

    cfg = build_config(name)
    builder = _hf_config_builder(cfg)
    if builder is None:
        raise ValueError(f"tscompile: preset {name!r} has no stock transformers equivalent; --hf-model presets: "
                         f"{', '.join(hf_presets())}")
    hf_cfg = builder(cfg)
    hf_cfg._attn_implementation = "sdpa"
    return hf_cfg


def build_preset_model(name: str, dtype: torch.dtype, device: torch.device, seed: int):
    """transformers' causal LM of preset ``name`` (``LlamaForCausalLM`` or ``Qwen3NextForCausalLM``)
    on ``device``, its weights drawn in ``dtype`` under ``seed``."""
    import transformers

    hf_cfg = preset_hf_config(name)
    model_class = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_cfg)]
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # drawn in the bench dtype: no float32 copy of a large model
    try:
        with torch.device(device):
            model = model_class(hf_cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()
