"""``LLM(...)``'s arguments -> the engine's parts: every argument validated and a speculative
configuration checked before any model loads, then the parts built on one device
(``runtime/build.py``) or over tensor-parallel ranks (``tscompile/distributed``)."""

from __future__ import annotations

import torch

from tscompile.config import TscompileConfig, check_piece_compiler_importable
from tscompile.models import ModelConfig, Transformer
from tscompile.runtime.build import EngineParts, build_model_engine
from tscompile.spec_decode.config import SpeculativeConfig
from tscompile.spec_decode.engine_checks import check_built_vocab, check_engine_speculation
from tscompile.spec_decode.engine_drafters import build_draft_parts, make_drafter
from tscompile.spec_decode.verify import VerifyStep
from tscompile.utils import resolve_device
from tscompile.validation import validate_engine_args


def build_llm_parts(
    model: str | ModelConfig | Transformer, *, attention_backend: str, max_num_seqs: int,
    max_model_len: int | None, page_size: int, pages_per_block: int, num_pages: int | None,
    max_num_batched_tokens: int, dtype: torch.dtype | str | None, device: torch.device | str | None,
    enforce_eager: bool, compile_options: dict | None, seed: int, async_scheduling: bool,
    gpu_memory_utilization: float, model_impl: str, enable_prefix_caching: bool, tensor_parallel_size: int,
    speculative_config: dict | None,
) -> tuple[EngineParts, SpeculativeConfig | None, EngineParts | None]:
    """The parts of an engine of ``LLM``'s arguments, its parsed speculative configuration (None
    without one) and a draft model's own parts (None unless ``method="draft_model"``). A refused
    argument raises before anything is built."""
    validate_engine_args(
        model=model, attention_backend=attention_backend, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
        page_size=page_size, pages_per_block=pages_per_block, num_pages=num_pages,
        max_num_batched_tokens=max_num_batched_tokens, dtype=dtype, device=device, enforce_eager=enforce_eager,
        compile_options=compile_options, seed=seed, async_scheduling=async_scheduling,
        gpu_memory_utilization=gpu_memory_utilization, model_impl=model_impl,
        enable_prefix_caching=enable_prefix_caching,
        tensor_parallel_size=tensor_parallel_size, speculative_config=speculative_config)
    spec = check_engine_speculation(speculative_config, model=model, tensor_parallel_size=tensor_parallel_size)
    device = resolve_device(device)
    compile_config = None if enforce_eager else TscompileConfig.from_options(compile_options)
    if compile_config is not None:
        check_piece_compiler_importable(compile_config)  # refused here, not inside the first compile
    build_kwargs = dict(
        attention_backend=attention_backend, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
        page_size=page_size, pages_per_block=pages_per_block, num_pages=num_pages,
        max_num_batched_tokens=max_num_batched_tokens, dtype=dtype, device=device,
        compile_config=compile_config, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
        model_impl=model_impl)
    draft_parts = None
    if spec is not None:
        build_kwargs["max_verify_width"] = spec.verify_width
        # built before the target: on CUDA the target's pool is sized from the memory left after it
        draft_parts = build_draft_parts(spec, model, build_kwargs)
    if tensor_parallel_size > 1:
        from tscompile.distributed import build_tensor_parallel_engine

        parts = build_tensor_parallel_engine(model, tensor_parallel_size, build_kwargs)
    else:
        parts = build_model_engine(model, **build_kwargs)
    check_built_vocab(spec, parts.config.vocab_size)
    return parts, spec, draft_parts


def verify_step_for(spec: SpeculativeConfig, parts: EngineParts, draft_parts: EngineParts | None = None) -> VerifyStep:
    """The verify step that runs an engine's decode steps under ``spec``, its drafter made from
    ``spec`` (and ``draft_parts`` for ``method="draft_model"``); a package's runner is refused. The
    greedy verify graphs are captured here, as decode's are at start-up."""
    if parts.model is None:
        raise ValueError("tscompile: speculative_config needs the engine's own model (not a package)")
    drafter = make_drafter(spec, draft_parts)
    verify = VerifyStep(spec, drafter, parts.scheduler, parts.runner)
    parts.runner.verify.capture_ladder(spec.verify_width)
    return verify
