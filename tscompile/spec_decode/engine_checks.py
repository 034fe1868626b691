"""What ``tscompile.LLM(speculative_config=...)`` checks before any model loads: the settings
themselves (``SpeculativeConfig``), the verify window against the widest window the engine sizes
its decode buffers and graphs for, the draft model's vocabulary against the target's, and the
engine settings speculation cannot run with.

A model's vocabulary is read without loading weights (a preset's config, a ``ModelConfig``, a
built model, a checkpoint's ``config.json``); a named model not fetched yet is checked once built
(``check_built_vocab``)."""

from __future__ import annotations

from pathlib import Path

from tscompile.spec_decode.config import MAX_NUM_SPECULATIVE_TOKENS, SpeculativeConfig

# The widest verify window an engine sizes its decode buffers (``allocate_decode_buffers``) and
# graph keys for: every k SpeculativeConfig accepts fits.
MAX_VERIFY_WIDTH = MAX_NUM_SPECULATIVE_TOKENS + 1


def vocab_size_without_loading(model) -> int | None:
    """``model``'s vocabulary as ``LLM`` takes it, or None when only loading it would tell (a named
    model, or a string that is neither a preset nor a directory: the loader refuses that itself)."""
    from tscompile.models import PRESETS, ModelConfig, Transformer
    from tscompile.models.hf_config import read_json_object

    if isinstance(model, Transformer):
        return model.config.vocab_size
    if isinstance(model, ModelConfig):
        return model.vocab_size
    if isinstance(model, str) and model in PRESETS:
        return PRESETS[model].vocab_size
    config_file = Path(str(model)) / "config.json"
    if config_file.is_file():
        raw = read_json_object(config_file)
        vocab = raw.get("vocab_size", (raw.get("text_config") or {}).get("vocab_size"))
        return vocab if isinstance(vocab, int) else None
    return None


def check_engine_speculation(speculative_config, *, model, tensor_parallel_size: int,
                             max_width: int = MAX_VERIFY_WIDTH) -> SpeculativeConfig | None:
    """The parsed ``speculative_config`` (None: no speculation), or a refusal."""
    spec = SpeculativeConfig.from_dict(speculative_config)
    if spec is None:
        return None
    spec.check_graph_widths(max_width)
    if tensor_parallel_size > 1:
        raise ValueError(f"tscompile: speculative_config (method={spec.method!r}) with tensor_parallel_size="
                         f"{tensor_parallel_size} is not supported (the drafters run on one device); use "
                         "tensor_parallel_size=1 or leave speculative_config unset")
    if spec.method == "draft_model":
        draft_vocab = vocab_size_without_loading(spec.model)
        if draft_vocab is None:
            raise ValueError(f"tscompile: speculative_config model={spec.model!r} is neither a preset nor a local "
                             "checkpoint directory with a config.json; pass the draft checkpoint's directory")
        target_vocab = vocab_size_without_loading(model)
        if target_vocab is not None:
            spec.check_draft_vocab(target_vocab, draft_vocab)
    return spec


def check_built_vocab(spec: SpeculativeConfig | None, target_vocab: int) -> None:
    """After the target is built: the draft vocabulary check for a target only loading could size."""
    if spec is not None and spec.method == "draft_model":
        spec.check_draft_vocab(target_vocab, vocab_size_without_loading(spec.model))
