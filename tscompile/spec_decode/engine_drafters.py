"""The engine's drafter for a ``SpeculativeConfig``: n-gram lookup, a replay of given continuations
(benchmarks), or a draft model with its own engine parts (``draft_runner.py``), compiled and graphed
as the target is.

The draft model is built before the target: on CUDA the target's KV pool is sized from the device
memory left once the model is loaded, so the draft's weights and cache must already be there. Its
pool holds every request's whole context (``max_num_seqs`` requests of the target's
``max_model_len`` plus the k draft positions past it), so the draft never preempts.
"""

from __future__ import annotations

from pathlib import Path

from tscompile.spec_decode.config import SpeculativeConfig
from tscompile.spec_decode.draft_model import DraftModelDrafter
from tscompile.spec_decode.drafter import Drafter
from tscompile.spec_decode.ngram import NgramDrafter
from tscompile.spec_decode.replay import ReplayDrafter
from tscompile.utils import cdiv


def target_max_model_len(model, max_model_len: int | None) -> int:
    """The ``max_model_len`` the target engine will run with, without loading it (as
    ``build_model_engine`` resolves None: a checkpoint's maximum, a preset's ``PRESET_MAX_MODEL_LEN``)."""
    from tscompile.models import PRESETS, ModelConfig, Transformer
    from tscompile.models.hf_config import read_json_object
    from tscompile.runtime.build import PRESET_MAX_MODEL_LEN

    if max_model_len is not None:
        return max_model_len
    if isinstance(model, Transformer):
        model = model.config
    if isinstance(model, str) and model in PRESETS:
        model = PRESETS[model]
    if isinstance(model, ModelConfig):
        return min(PRESET_MAX_MODEL_LEN, model.max_position)
    raw = read_json_object(Path(str(model)) / "config.json")
    return int(raw.get("max_position_embeddings", PRESET_MAX_MODEL_LEN))


def build_draft_parts(spec: SpeculativeConfig, model, build_kwargs: dict):
    """The draft model's ``EngineParts`` (its own pool; compiled and graphed as the target), or None
    for a method without a model.
    ``build_kwargs``: the target's ``build_model_engine`` arguments."""
    if spec.method != "draft_model":
        return None
    from tscompile.runtime.build import build_model_engine

    length = target_max_model_len(model, build_kwargs["max_model_len"]) + spec.num_speculative_tokens
    page = build_kwargs["page_size"]
    seqs = build_kwargs["max_num_seqs"]
    length = cdiv(length, page) * page
    return build_model_engine(
        spec.model, attention_backend=build_kwargs["attention_backend"], max_num_seqs=seqs, max_model_len=length,
        page_size=page, pages_per_block=1, num_pages=seqs * (length // page) + 1,
        max_num_batched_tokens=build_kwargs["max_num_batched_tokens"], dtype=build_kwargs["dtype"],
        device=build_kwargs["device"], compile_config=build_kwargs["compile_config"], seed=build_kwargs["seed"],
        model_impl=build_kwargs["model_impl"])


def make_drafter(spec: SpeculativeConfig, draft_parts=None) -> Drafter:
    if spec.method == "ngram":
        return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "replay":
        return ReplayDrafter({})
    from tscompile.spec_decode.draft_runner import EngineDraftRunner

    return DraftModelDrafter(EngineDraftRunner(draft_parts))
