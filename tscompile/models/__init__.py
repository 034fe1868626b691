"""Reference models and their presets."""

from __future__ import annotations

import torch

from tscompile.models.llama import PRESETS, ModelConfig, Transformer, build_config, rope_frequencies
from tscompile.models.narrow import NarrowingTransformer


def build_model(config: ModelConfig | str, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                seed: int = 0) -> Transformer:
    """A reference model with seeded random weights, on ``device`` in ``dtype``."""
    cfg = build_config(config) if isinstance(config, str) else config
    cls = NarrowingTransformer if cfg.narrow_layer is not None else Transformer
    with torch.device(device):
        model = cls(cfg)
    model.init_weights(seed)
    model = model.to(dtype=dtype).eval()
    model.inv_freq = rope_frequencies(cfg).float().to(device)  # RoPE stays float32 in any dtype
    return model


__all__ = ["PRESETS", "ModelConfig", "NarrowingTransformer", "Transformer", "build_config", "build_model"]
