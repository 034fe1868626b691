"""Reference models, their presets, and local Hugging Face checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tscompile.models.checkpoint import CheckpointInfo, is_checkpoint_dir, load_checkpoint
from tscompile.models.llama import PRESETS, ModelConfig, Transformer, build_config
from tscompile.models.narrow import NarrowingTransformer


def build_model(config: ModelConfig | str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", seed: int = 0) -> Transformer:
    """A model on ``device`` in ``dtype``: seeded random weights for a preset name or a ``ModelConfig``,
    the stored weights for a checkpoint directory (see ``load_model`` for its info)."""
    return load_model(config, dtype=dtype, device=device, seed=seed)[0]


def load_model(model: ModelConfig | str | os.PathLike, *, dtype: torch.dtype | None = None,
               device: torch.device | str | None = None, seed: int = 0,
               max_model_len: int | None = None,
               model_impl: str = "native") -> tuple[Transformer, CheckpointInfo | None]:
    """The one entry point for a preset name, a ``ModelConfig`` or a local checkpoint directory.

    Returns the model and, for a checkpoint, its ``CheckpointInfo`` (tokenizer directory, eos ids, load
    GB/s). ``dtype`` None: float32 for a preset, the checkpoint's own on CUDA (float32 on CPU) for a
    checkpoint. ``seed`` seeds random weights; ``max_model_len`` is checked against a checkpoint's
    sliding window and sizes its RoPE tables (a preset's hold every position up to max_position).
    ``model_impl``: for a checkpoint, ``"native"``, ``"transformers"`` (a ``TransformersModel``,
    ``models/hf_transformers.py``) or ``"auto"`` (native where it exists); a preset is native only."""
    from tscompile.models.hf_transformers import choose_model_impl, load_transformers_checkpoint

    if isinstance(model, ModelConfig) or (isinstance(model, str) and model in PRESETS):
        if model_impl == "transformers":
            raise ValueError(f"tscompile: model_impl='transformers' needs a checkpoint directory, and "
                             f"{model if isinstance(model, str) else 'a ModelConfig'} is a native model; pass "
                             "model_impl='auto' or 'native', or a checkpoint directory")
        cfg = build_config(model) if isinstance(model, str) else model
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        return _random_model(cfg, dtype=dtype or torch.float32, device=device, seed=seed), None
    if is_checkpoint_dir(model) and choose_model_impl(model, model_impl) == "transformers":
        return load_transformers_checkpoint(model, dtype=dtype, device=device, max_model_len=max_model_len)
    return load_checkpoint(model, dtype=dtype, device=device, max_model_len=max_model_len)


def model_config(model: ModelConfig | str | os.PathLike) -> ModelConfig:
    """The native config of a preset, a ``ModelConfig`` or a checkpoint directory (its config.json
    only: no weight is read)."""
    from tscompile.models.hf_config import model_config_from_hf, read_json_object

    if isinstance(model, ModelConfig):
        return model
    if isinstance(model, str) and model in PRESETS:
        return build_config(model)
    if not is_checkpoint_dir(model):
        return build_config(str(model))  # refuses with the list of presets and the checkpoint hint
    path = Path(model) / "config.json"
    if not path.is_file():
        raise ValueError(f"tscompile: checkpoint directory {str(model)!r} has no config.json")
    return model_config_from_hf(read_json_object(path))


def _random_model(cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device, seed: int) -> Transformer:
    cls = NarrowingTransformer if cfg.narrow_layer is not None else Transformer
    with torch.device(device):
        model = cls(cfg)
    model.init_weights(seed)
    model = model.to(dtype=dtype).eval()
    model.reset_rope(device)  # RoPE stays float32 in any dtype
    return model


__all__ = ["PRESETS", "CheckpointInfo", "ModelConfig", "NarrowingTransformer", "Transformer", "build_config",
           "build_model", "is_checkpoint_dir", "load_checkpoint", "load_model", "model_config"]
