"""Build the parts of an engine from a model: model, attention router, KV pool, scheduler, runner.

``tscompile.LLM(model, ...)`` calls ``build_model_engine``; a loaded package assembles the same
``EngineParts`` around its own runner (``tscompile/package/runtime.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tscompile.attention import create_attention_router, resolve_cuda_graph_support
from tscompile.attention.router import AttentionRouter
from tscompile.config import TscompileConfig
from tscompile.kv_cache.pool import KVCachePool
from tscompile.kv_cache.spec import CacheGroupSpec
from tscompile.models import PRESETS, CheckpointInfo, ModelConfig, Transformer, build_model, load_model
from tscompile.runtime.model_runner import ModelRunner
from tscompile.runtime.readback import PendingTokens
from tscompile.runtime.scheduler import Scheduler
from tscompile.step_plan import StepPlan
from tscompile.text import load_tokenizer, stop_ids_of
from tscompile.utils import cdiv, resolve_dtype


class StepRunner(Protocol):
    """What the engine needs of a runner (``ModelRunner``, a package's ``PackageRunner``)."""

    launches: int  # steps launched so far: a step chains only onto the one launched right before it
    compile_seconds: float
    capture_seconds: float

    def launch(self, plan: StepPlan, prev_rows: list[int] | None = None) -> PendingTokens: ...

    def can_chain(self, plan: StepPlan) -> bool: ...


@dataclass
class EngineParts:
    """Everything an engine steps: ``model`` is None for a package (its programs are the model);
    ``tokenizer`` is None for a model without one (token ids in and out only)."""

    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    attention: AttentionRouter
    pool: KVCachePool
    scheduler: Scheduler
    runner: StepRunner
    model: Transformer | None = None
    tokenizer: object | None = None
    checkpoint: CheckpointInfo | None = None


PRESET_MAX_MODEL_LEN = 512  # a random-weight preset's default context (a checkpoint's is its own)
DEFAULT_POOL_TOKENS_PER_SEQ = 4096  # until the pool is sized from free memory: no 128k-per-sequence pool


def default_num_pages(max_num_seqs: int, max_model_len: int, page_size: int, pages_per_block: int) -> int:
    """Pages per cache group: ``max_num_seqs`` requests of ``max_model_len`` tokens (at most
    ``DEFAULT_POOL_TOKENS_PER_SEQ`` each, but always one request of ``max_model_len``), plus the null
    block. A request that can never fit is refused at admission, naming ``num_pages``."""
    block = page_size * pages_per_block
    per_seq = cdiv(min(max_model_len, DEFAULT_POOL_TOKENS_PER_SEQ), block)
    blocks = max(max_num_seqs * per_seq, cdiv(max_model_len, block))
    return (blocks + 1) * pages_per_block


def build_pool_and_scheduler(specs: list[CacheGroupSpec], attention: AttentionRouter, *, num_pages: int | None,
                             page_size: int, pages_per_block: int, dtype: torch.dtype, device: torch.device,
                             max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int, vocab_size: int,
                             eos_token_ids: tuple[int, ...] = (), max_blocks: int | None = None,
                             limit_note: str = "") -> tuple[KVCachePool, Scheduler]:
    """The KV pool (bound to ``attention``) and a scheduler over its blocks."""
    if num_pages is None:
        num_pages = default_num_pages(max_num_seqs, max_model_len, page_size, pages_per_block)
    pool = KVCachePool.allocate(specs, [num_pages] * len(specs), page_size=page_size,
                                pages_per_block=pages_per_block, dtype=dtype, device=device)
    attention.set_cache_pool(pool)
    scheduler = Scheduler(specs, [pool.num_blocks(g) for g in range(len(specs))], block_size=page_size * pages_per_block,
                          max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                          max_num_batched_tokens=max_num_batched_tokens, vocab_size=vocab_size, max_blocks=max_blocks,
                          eos_token_ids=eos_token_ids, limit_note=limit_note)
    return pool, scheduler


def build_model_engine(model: str | ModelConfig | Transformer, *, attention_backend: str, max_num_seqs: int,
                       max_model_len: int | None, page_size: int, pages_per_block: int, num_pages: int | None,
                       max_num_batched_tokens: int, dtype: torch.dtype | None, device: torch.device,
                       compile_config: TscompileConfig | None, seed: int) -> EngineParts:
    """``model``: a preset name, a ``ModelConfig``, a built ``Transformer`` or a local checkpoint
    directory. ``dtype`` None: bf16 on CUDA and float32 on the CPU for a preset, the checkpoint's own
    on CUDA for a checkpoint. ``max_model_len`` None: the checkpoint's maximum, 512 for a preset."""
    checkpoint = None
    if isinstance(model, Transformer):
        built = model
    elif isinstance(model, ModelConfig) or model in PRESETS:
        built = build_model(model, dtype=resolve_dtype(dtype, device), device=device, seed=seed)
    else:
        built, checkpoint = load_model(model, dtype=dtype if dtype is None else resolve_dtype(dtype, device),
                                       device=device, max_model_len=max_model_len)
    cfg = built.config
    if max_model_len is None:
        max_model_len = cfg.max_position if checkpoint is not None else min(PRESET_MAX_MODEL_LEN, cfg.max_position)
    tokenizer, eos_token_ids = None, ()
    if checkpoint is not None:
        tokenizer = load_tokenizer(checkpoint.path)
        eos_token_ids = stop_ids_of(checkpoint.eos_token_ids, tokenizer)
    dtype = built.tok_embeddings.weight.dtype
    if max_model_len > cfg.max_position:
        raise ValueError(f"tscompile: max_model_len {max_model_len} exceeds the model's max_position "
                         f"{cfg.max_position}")
    specs = built.cache_groups()
    attention = create_attention_router(attention_backend, specs, max_model_len=max_model_len, page_size=page_size,
                                        pages_per_block=pages_per_block, device=device)
    graph_support = resolve_cuda_graph_support(attention)
    pool, scheduler = build_pool_and_scheduler(
        specs, attention, num_pages=num_pages, page_size=page_size, pages_per_block=pages_per_block, dtype=dtype,
        device=device, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens, vocab_size=cfg.vocab_size, eos_token_ids=eos_token_ids)
    built.bind_kv_cache(pool)
    runner = ModelRunner(built, attention, max_num_seqs=max_num_seqs, max_blocks=scheduler.max_blocks,
                         banned_width=scheduler.banned_width, device=device, compile_config=compile_config,
                         graph_support=graph_support)
    runner.capture_decode_graphs()
    return EngineParts(cfg, device, dtype, attention, pool, scheduler, runner, built, tokenizer, checkpoint)
