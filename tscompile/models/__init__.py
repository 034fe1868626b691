"""Reference models, their presets, named downloadable models, and local Hugging Face checkpoints.

A model is named in one of four ways, resolved here for every caller: a ``ModelConfig``, a preset name
(seeded random weights, ``PRESETS``), a named downloadable model (trained weights converted once into
a cached checkpoint directory, ``NAMED_MODELS``), or a local checkpoint directory."""

from __future__ import annotations

import os

import torch

from tscompile.models.checkpoint import CheckpointInfo, checkpoint_root, is_checkpoint_dir, load_checkpoint, \
    native_model
from tscompile.models.demo import NAMED_MODELS, is_named_model
from tscompile.models.llama import PRESETS, ModelConfig, Transformer, build_config
from tscompile.models.narrow import NarrowingTransformer
from tscompile.models.parallel import TensorParallel
from tscompile.models.qwen3_next import QWEN3_NEXT_PRESETS, Qwen3NextConfig, Qwen3NextTransformer

PRESETS.update(QWEN3_NEXT_PRESETS)  # one preset table for every family (it lives in llama.py)


def build_model(config: ModelConfig | str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", seed: int = 0, tp: TensorParallel | None = None) -> Transformer:
    """A model on ``device`` in ``dtype``: seeded random weights for a preset name or a ``ModelConfig``,
    the stored weights for a checkpoint directory (see ``load_model`` for its info and ``tp``)."""
    return load_model(config, dtype=dtype, device=device, seed=seed, tp=tp)[0]


def load_model(model: ModelConfig | str | os.PathLike, *, dtype: torch.dtype | None = None,
               device: torch.device | str | None = None, seed: int = 0,
               max_model_len: int | None = None,
               model_impl: str = "native",
               tp: TensorParallel | None = None) -> tuple[Transformer, CheckpointInfo | None]:
    """The one entry point for a preset name, a ``ModelConfig`` or a local checkpoint directory.

    Returns the model and, for a checkpoint, its ``CheckpointInfo`` (tokenizer directory, eos ids, load
    GB/s). ``dtype`` None: float32 for a preset, the checkpoint's own on CUDA (float32 on CPU) for a
    checkpoint. ``seed`` seeds random weights; ``max_model_len`` is checked against a checkpoint's
    sliding window and sizes its RoPE tables (a preset's hold every position up to max_position).
    ``model_impl``: for a checkpoint, ``"native"``, ``"transformers"`` (a ``TransformersModel``,
    ``models/hf_transformers.py``) or ``"auto"`` (native where it exists); a preset is native only.
    ``tp``: build only this tensor-parallel rank's shard of a native model (``models/parallel.py``)."""
    from tscompile.models.hf_transformers import choose_model_impl, load_transformers_checkpoint

    if isinstance(model, ModelConfig) or (isinstance(model, str) and model in PRESETS):
        if model_impl == "transformers":
            raise ValueError(f"tscompile: model_impl='transformers' needs a checkpoint directory, and "
                             f"{model if isinstance(model, str) else 'a ModelConfig'} is a native model; pass "
                             "model_impl='auto' or 'native', or a checkpoint directory")
        cfg = build_config(model) if isinstance(model, str) else model
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        return _random_model(cfg, dtype=dtype or torch.float32, device=device, seed=seed, tp=tp), None
    model = resolve_model(model)
    if is_checkpoint_dir(model) and choose_model_impl(model, model_impl) == "transformers":
        if tp is not None:
            raise ValueError("tscompile: tensor parallelism needs the native model; pass model_impl='native'")
        return load_transformers_checkpoint(model, dtype=dtype, device=device, max_model_len=max_model_len)
    return load_checkpoint(model, dtype=dtype, device=device, max_model_len=max_model_len, tp=tp)


def resolve_model(model):
    """A named downloadable model's checkpoint directory (converted into the user cache on first use,
    see ``tscompile.models.demo``); any other model as given."""
    if is_named_model(model):
        from tscompile.models.demo import checkpoint_dir

        return checkpoint_dir(model)
    return model


def model_config(model: ModelConfig | str | os.PathLike) -> ModelConfig:
    """The native config of a preset, a ``ModelConfig`` or a checkpoint directory (its config.json
    only: no weight is read)."""
    from tscompile.models.hf_config import read_json_object
    from tscompile.models.qwen3_next_checkpoint import native_config_from_hf

    if isinstance(model, ModelConfig):
        return model
    if isinstance(model, str) and model in PRESETS:
        return build_config(model)
    # an unknown name is refused with the presets, the named models and the checkpoint hint
    root = checkpoint_root(resolve_model(model))
    return native_config_from_hf(read_json_object(root / "config.json"))


def _random_model(cfg: ModelConfig, *, dtype: torch.dtype, device: torch.device, seed: int,
                  tp: TensorParallel | None = None) -> Transformer:
    with torch.device(device):
        model = NarrowingTransformer(cfg) if cfg.narrow_layer is not None else native_model(cfg, tp)
    model.init_weights(seed)
    model = model.to(dtype=dtype).eval()
    model.reset_rope(device)  # RoPE stays float32 in any dtype
    return model


__all__ = ["NAMED_MODELS", "PRESETS", "CheckpointInfo", "ModelConfig", "NarrowingTransformer", "Qwen3NextConfig",
           "Qwen3NextTransformer", "TensorParallel",
           "Transformer", "build_config", "build_model", "is_checkpoint_dir", "load_checkpoint", "load_model",
           "model_config", "resolve_model"]
