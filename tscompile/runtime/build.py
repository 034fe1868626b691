"""Build the parts of an engine from a model: model, attention router, KV pool, scheduler, runner.

``tscompile.LLM(model, ...)`` calls ``build_model_engine``; a loaded package assembles the same
``EngineParts`` around its own runner (``tscompile/package/runtime.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
from dataclasses import dataclass
from typing import Protocol

import torch

from tscompile.attention import create_attention_router, resolve_cuda_graph_support
from tscompile.attention.router import AttentionRouter
from tscompile.attention.state_backend import StateBackend
from tscompile.attention.support import ResolvedGraphSupport
from tscompile.config import TscompileConfig
from tscompile.counters import counters
from tscompile.kv_cache.pool import KVCachePool
from tscompile.kv_cache.spec import CacheGroupSpec
from tscompile.kv_cache.state_pool import StatePool
from tscompile.models import PRESETS, CheckpointInfo, ModelConfig, Transformer, load_model
from tscompile.models.parallel import TensorParallel, min_over_ranks
from tscompile.piece_compiler import graph_pdl_on
from tscompile.runtime.memory import (DECODE_GRAPH_MARGIN_BYTES, MemoryProfile, kv_cache_pages, log_kv_cache,
                                      measure_activation_peak, measure_device_memory, pages_for_requests,
                                      prefill_graph_bytes, verify_graph_bytes)
from tscompile.runtime.model_runner import ModelRunner
from tscompile.runtime.prefill_capture import placeholder_like, startup_plans
from tscompile.runtime.readback import PendingTokens
from tscompile.runtime.scheduler import Request, Scheduler
from tscompile.runtime.state_slots import StateSlots
from tscompile.sampling import SamplingParams
from tscompile.step_plan import StepPlan
from tscompile.text import load_tokenizer, stop_ids_of
from tscompile.utils import bucket, cdiv, resolve_dtype


class StepRunner(Protocol):
    """What the engine needs of a runner (``ModelRunner``, a package's ``PackageRunner``)."""

    launches: int  # steps launched so far: a step chains only onto the one launched right before it
    returns_logprobs: bool  # a step whose plan asks (``SamplingRows.logprobs``) reads them back
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
    memory: MemoryProfile | None = None  # what the pool was sized from (CUDA, num_pages not given)


PRESET_MAX_MODEL_LEN = 512  # a random-weight preset's default context (a checkpoint's is its own)
DEFAULT_POOL_TOKENS_PER_SEQ = 4096  # the CPU has no device memory to size from: no 128k-per-sequence pool


def default_num_pages(max_num_seqs: int, max_model_len: int, page_size: int, pages_per_block: int) -> int:
    """Pages per cache group: ``max_num_seqs`` requests of ``max_model_len`` tokens (at most
    ``DEFAULT_POOL_TOKENS_PER_SEQ`` each, but always one request of ``max_model_len``), plus the null
    block. A request that can never fit is refused at admission, naming ``num_pages``."""
    block = page_size * pages_per_block
    per_seq = cdiv(min(max_model_len, DEFAULT_POOL_TOKENS_PER_SEQ), block)
    blocks = max(max_num_seqs * per_seq, cdiv(max_model_len, block))
    return (blocks + 1) * pages_per_block


def _pool_and_scheduler(specs: list[CacheGroupSpec], attention: AttentionRouter, *, num_pages: int,
                        page_size: int, pages_per_block: int, dtype: torch.dtype, device: torch.device,
                        max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int, vocab_size: int,
                        eos_token_ids: tuple[int, ...] = (), max_blocks: int | None = None,
                        limit_note: str = "") -> tuple[KVCachePool, Scheduler]:
    pool = KVCachePool.allocate(specs, [num_pages] * len(specs), page_size=page_size,
                                pages_per_block=pages_per_block, dtype=dtype, device=device)
    attention.set_cache_pool(pool)
    state_slots = StateSlots(max_num_seqs) if attention.state is not None else None
    scheduler = Scheduler(specs, [pool.num_blocks(g) for g in range(len(specs))], block_size=page_size * pages_per_block,
                          max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                          max_num_batched_tokens=max_num_batched_tokens, vocab_size=vocab_size, max_blocks=max_blocks,
                          eos_token_ids=eos_token_ids, limit_note=limit_note, state_slots=state_slots)
    return pool, scheduler


def build_pool_and_scheduler(specs: list[CacheGroupSpec], attention: AttentionRouter, *, num_pages: int | None,
                             page_size: int, pages_per_block: int, dtype: torch.dtype, device: torch.device,
                             max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int, vocab_size: int,
                             eos_token_ids: tuple[int, ...] = (), max_blocks: int | None = None,
                             limit_note: str = "") -> tuple[KVCachePool, Scheduler]:
    """The KV pool (bound to ``attention``) and a scheduler over its blocks; logs the pool's size.
    ``num_pages`` None: ``default_num_pages`` (a model on CUDA is sized from memory before this)."""
    if num_pages is None:
        num_pages = default_num_pages(max_num_seqs, max_model_len, page_size, pages_per_block)
    pool, scheduler = _pool_and_scheduler(
        specs, attention, num_pages=num_pages, page_size=page_size, pages_per_block=pages_per_block, dtype=dtype,
        device=device, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens, vocab_size=vocab_size, eos_token_ids=eos_token_ids,
        max_blocks=max_blocks, limit_note=limit_note)
    log_kv_cache(pool.num_blocks(0) - 1, page_size * pages_per_block, pool.nbytes, max_model_len)
    return pool, scheduler


def profile_prompt_lengths(max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int) -> list[int]:
    """Prompts of the profiling step: the largest step the scheduler can plan (``max_num_batched_tokens``
    tokens, each prompt leaving room for one new token), spread over as many requests as may run, so
    the sampler sees its largest batch too. Empty when no request can ever run."""
    per_request = max_model_len - 1
    tokens = min(max_num_batched_tokens, max_num_seqs * per_request)
    if tokens <= 0:
        return []
    n = min(max_num_seqs, tokens)
    return [tokens // n + (i < tokens % n) for i in range(n)]


def prefill_graph_buckets(compile_config: TscompileConfig | None, graph_support: ResolvedGraphSupport,
                          step_tokens: int) -> list[int]:
    """The token buckets an engine may capture prefill graphs for: the ladder up to
    ``prefill_graph_max_tokens``, and no bucket above the one a full step (``step_tokens``) pads to."""
    if compile_config is None or not compile_config.cudagraphs or not graph_support.support.prefill_graph:
        return []
    ladder = tuple(b for b in compile_config.token_ladder if b <= compile_config.prefill_graph_max_tokens)
    top = bucket(ladder, step_tokens) if ladder else None
    return [b for b in ladder if top is None or b <= top]


def graph_margin_bytes(cfg, dtype: torch.dtype, compile_config: TscompileConfig | None,
                       graph_support: ResolvedGraphSupport, *, max_num_seqs: int, max_model_len: int,
                       max_num_batched_tokens: int, max_verify_width: int) -> int:
    """What the CUDA graphs captured after the KV pool exists may take (``runtime/memory.py``). A
    prefill step holds at most ``max_num_batched_tokens`` tokens, and never more than ``max_num_seqs``
    whole prompts of ``max_model_len``: no bucket above that is ever captured."""
    step_tokens = min(max_num_batched_tokens, max_num_seqs * max_model_len)
    prefill = prefill_graph_bytes(prefill_graph_buckets(compile_config, graph_support, step_tokens), cfg.n_layers,
                                  cfg.dim, dtype.itemsize)
    verify = verify_graph_bytes(max_num_seqs, max_verify_width, cfg.vocab_size, cfg.dim, dtype.itemsize)
    return DECODE_GRAPH_MARGIN_BYTES + prefill + verify


def pages_from_device_memory(built: Transformer, attention: AttentionRouter, specs: list[CacheGroupSpec],
                             graph_support: ResolvedGraphSupport, compile_config: TscompileConfig | None, *,
                             gpu_memory_utilization: float,
                             page_size: int, pages_per_block: int, dtype: torch.dtype, device: torch.device,
                             max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
                             eos_token_ids: tuple[int, ...], max_verify_width: int = 1) -> tuple[int, MemoryProfile]:
    """Pages per cache group for a CUDA engine whose model is loaded (see ``runtime/memory.py``).

    The activation peak is measured by one eager step of the real runner code over a temporary pool
    just large enough for it: ``profile_prompt_lengths`` prompts, sampled (not greedy: the sampler
    then sorts the vocabulary, its larger path). The eager step is the upper bound of the compiled
    one (Inductor fuses and frees intermediates earlier), and compiling here would only move the
    compile time. ``used`` is read after that step with the temporary pool freed and the temporary
    runner alive: the runner's persistent buffers (decode staging, sampling, readback, attention
    decode buffers) are those the real runner allocates again, and the kernels and library
    workspaces the step loaded stay. The graph margin: ``DECODE_GRAPH_MARGIN_BYTES``, plus
    ``prefill_graph_bytes`` over ``prefill_graph_buckets`` when prefill graphs are on, plus
    ``verify_graph_bytes`` for speculative verify windows of ``max_verify_width`` rows. Counters are
    left as they were."""
    block = page_size * pages_per_block
    lengths = profile_prompt_lengths(max_num_seqs, max_model_len, max_num_batched_tokens)
    profile_pages = (sum(cdiv(n + 1, block) for n in lengths) + 1) * pages_per_block
    cfg = built.config
    vocab = cfg.vocab_size
    pool, scheduler = _pool_and_scheduler(
        specs, attention, num_pages=profile_pages, page_size=page_size, pages_per_block=pages_per_block, dtype=dtype,
        device=device, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens, vocab_size=vocab, eos_token_ids=eos_token_ids)
    built.bind_kv_cache(pool)
    runner = ModelRunner(built, attention, max_num_seqs=max_num_seqs, max_blocks=scheduler.max_blocks,
                         banned_width=scheduler.banned_width, device=device, compile_config=None,
                         graph_support=graph_support)
    params = SamplingParams(max_new_tokens=1, temperature=1.0, top_p=0.9)
    for rid, n in enumerate(lengths):
        scheduler.add(Request(rid, [(rid + j) % vocab for j in range(n)], params, seed=rid))
    saved = counters.copy()
    try:
        plan = scheduler.schedule()
        peak = measure_activation_peak(device, lambda: runner.execute(plan)) if plan is not None else 0
    finally:
        counters.clear()
        counters.update(saved)
        pool.release()
    total, used = measure_device_memory(device)
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    margin = graph_margin_bytes(cfg, dtype, compile_config, graph_support, max_num_seqs=max_num_seqs,
                                max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                                max_verify_width=max_verify_width)
    profile = MemoryProfile(total, used, peak, margin, gpu_memory_utilization)
    pages = kv_cache_pages(
        total_bytes=total, used_bytes=used, activation_peak_bytes=peak, margin_bytes=margin,
        utilization=gpu_memory_utilization, bytes_per_page=KVCachePool.page_bytes(specs, page_size, dtype),
        pages_per_block=pages_per_block, min_pages=pages_for_requests(1, max_model_len, block, pages_per_block),
        max_pages=pages_for_requests(max_num_seqs, max_model_len, block, pages_per_block), max_model_len=max_model_len)
    return pages, profile


def attach_state_layers(model: Transformer, attention: AttentionRouter, max_num_seqs: int,
                        device: torch.device, chunked_gated_delta: bool = False, max_verify_width: int = 1,
                        pdl: bool = False, fused_gated_delta: bool = False,
                        split_gated_delta_heads: bool = False) -> None:
    """A model with recurrent-state layers (``state_spec``): its state pool (a slot per running request
    plus the null slot, float32; with speculative decoding, ``max_verify_width - 1`` checkpoints per
    running request), bound to the model and served by a ``StateBackend`` under the router. The state
    kernels: Triton on CUDA (the chunked gated delta kernel for multi-row steps with
    ``chunked_gated_delta``; launched with PDL with ``pdl``: ``KernelPolicy.state_pdl``), the torch
    reference on the CPU; decode steps through the fused op with ``fused_gated_delta``, its heads split
    over ``SPLIT_HEAD_BLOCKS`` programs each with ``split_gated_delta_heads``."""
    if not hasattr(model, "state_spec"):
        return
    from tscompile.models.qwen3_next_linear import SPLIT_HEAD_BLOCKS, TRITON_CHUNK_SIZE

    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    pool = StatePool.allocate(model.state_spec(), max_num_seqs + 1, device, checkpoint_requests=max_num_seqs,
                              checkpoint_rows=max_verify_width - 1, free_bytes=free)
    impl = state_kernel_impl(device, pdl)
    model.bind_state_pool(pool, impl, TRITON_CHUNK_SIZE if chunked_gated_delta else 0, fused_gated_delta,
                          SPLIT_HEAD_BLOCKS if split_gated_delta_heads else 1)
    attention.attach_state_backend(StateBackend(pool, device, impl))


def state_kernel_impl(device: torch.device, pdl: bool) -> str:
    """The state ops' ``impl`` (``custom_ops/gated_delta.py``): Triton on CUDA, with PDL launches
    where ``pdl``; the torch reference elsewhere."""
    if device.type != "cuda":
        return "torch"
    return "triton/pdl" if pdl else "triton"


def without_combo_kernels(config: TscompileConfig) -> TscompileConfig:
    """``config`` with Inductor's combo kernels off, unless its ``inductor_options`` set them.

    For models with recurrent-state layers: on the GPU, with combo kernels on, their compiled graphs
    of static shapes (the batch-1 decode step, a one-token prefill) gave tokens that drift from
    transformers' in float32, whatever the PDL and GEMV choices, while the dynamic-shape graphs and
    the eager engine gave transformers' tokens; combo kernels are what tscompile adds to static graphs
    only (``piece_compiler.CUDA_INDUCTOR_DEFAULTS``). Without them the GPU test of the compiled hybrid
    (tests/test_qwen3_next.py, ``-m gpu``) passes."""
    options = dict(config.inductor_options)
    if "combo_kernels" in options:
        return config
    return dataclasses.replace(config, inductor_options={**options, "combo_kernels": False})


def build_model_engine(model: str | ModelConfig | Transformer, *, attention_backend: str, max_num_seqs: int,
                       max_model_len: int | None, page_size: int, pages_per_block: int, num_pages: int | None,
                       max_num_batched_tokens: int, dtype: torch.dtype | None, device: torch.device,
                       compile_config: TscompileConfig | None, seed: int,
                       gpu_memory_utilization: float = 0.9, model_impl: str = "auto",
                       tensor_parallel: TensorParallel | None = None, max_verify_width: int = 1) -> EngineParts:
    """``model``: a preset name, a ``ModelConfig``, a built ``Transformer`` or a local checkpoint
    directory. ``dtype`` None: bf16 on CUDA and float32 on the CPU for a preset, the checkpoint's own
    on CUDA for a checkpoint. ``max_model_len`` None: the checkpoint's maximum, 512 for a preset.
    ``num_pages`` None: on CUDA sized from ``gpu_memory_utilization`` (``pages_from_device_memory``),
    on the CPU ``default_num_pages``. ``model_impl``: ``load_model``'s, for a checkpoint directory.
    ``tensor_parallel``: this process's rank; every rank of the group builds its shard with the same
    arguments, in step (``tscompile/distributed/``). ``max_verify_width``: ``ModelRunner``'s."""
    checkpoint = None
    if isinstance(model, Transformer):
        built = model
    elif isinstance(model, ModelConfig) or model in PRESETS:
        # load_model refuses model_impl="transformers" here: a preset has no transformers code
        built, _ = load_model(model, dtype=resolve_dtype(dtype, device), device=device, seed=seed,
                              model_impl=model_impl, tp=tensor_parallel)
    else:
        built, checkpoint = load_model(model, dtype=dtype if dtype is None else resolve_dtype(dtype, device),
                                       device=device, max_model_len=max_model_len, model_impl=model_impl,
                                       tp=tensor_parallel)
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
    if built is not model:  # our own model: RoPE tables for the positions this engine can run, no more
        built.reset_rope(device, max_model_len)
    elif built.rope_cos.shape[0] < max_model_len:  # a caller's model, its tables sized by reset_rope
        raise ValueError(f"tscompile: the model's RoPE tables hold {built.rope_cos.shape[0]} positions, fewer than "
                         f"max_model_len {max_model_len}; call model.reset_rope(device, {max_model_len}) or pass "
                         "a smaller max_model_len")
    specs = built.cache_groups()
    attention = create_attention_router(attention_backend, specs, max_model_len=max_model_len, page_size=page_size,
                                        pages_per_block=pages_per_block, device=device,
                                        kernels=compile_config.kernels if compile_config is not None else None)
    attach_state_layers(built, attention, max_num_seqs, device,
                        chunked_gated_delta=compile_config is not None and compile_config.kernels.chunked_gated_delta,
                        max_verify_width=max_verify_width,
                        pdl=compile_config is not None and compile_config.kernels.state_pdl
                        and graph_pdl_on(compile_config.kernels, False, False),
                        fused_gated_delta=compile_config is not None and compile_config.kernels.fused_gated_delta,
                        split_gated_delta_heads=compile_config is not None
                        and compile_config.kernels.split_gated_delta_heads)
    if hasattr(built, "state_spec") and compile_config is not None:
        compile_config = without_combo_kernels(compile_config)
    graph_support = resolve_cuda_graph_support(attention)
    memory = None
    if num_pages is None and device.type == "cuda":
        num_pages, memory = pages_from_device_memory(
            built, attention, specs, graph_support, compile_config, gpu_memory_utilization=gpu_memory_utilization,
            page_size=page_size, pages_per_block=pages_per_block, dtype=dtype, device=device,
            max_num_seqs=max_num_seqs, max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
            eos_token_ids=eos_token_ids, max_verify_width=max_verify_width)
        num_pages = min_over_ranks(num_pages, tensor_parallel, device)  # one pool size the rank-0 scheduler plans
    pool, scheduler = build_pool_and_scheduler(
        specs, attention, num_pages=num_pages, page_size=page_size, pages_per_block=pages_per_block, dtype=dtype,
        device=device, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens, vocab_size=cfg.vocab_size, eos_token_ids=eos_token_ids)
    built.bind_kv_cache(pool)
    runner = ModelRunner(built, attention, max_num_seqs=max_num_seqs, max_blocks=scheduler.max_blocks,
                         banned_width=scheduler.banned_width, device=device, compile_config=compile_config,
                         graph_support=graph_support, max_verify_width=max_verify_width)
    if scheduler.state_slots is not None:  # recurrent state: whole-step prefill graphs capture on placeholders
        runner.prefill.capture_placeholder = functools.partial(placeholder_like, scheduler=scheduler)
    runner.capture_decode_graphs()
    runner.capture_prefill_graphs(startup_plans(runner, scheduler))  # none under prefill_capture="lazy"
    return EngineParts(cfg, device, dtype, attention, pool, scheduler, runner, built, tokenizer, checkpoint, memory)
