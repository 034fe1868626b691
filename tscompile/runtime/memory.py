"""Sizing the KV pool from device memory (``LLM(gpu_memory_utilization=...)``), as vLLM does.

The engine may use ``gpu_memory_utilization * total`` bytes of the device. From that it takes off
what is in use once the model is loaded (``total - free``: this process's weights and buffers, the
CUDA context, and any other process on the device), the activation peak of the largest step the
engine can schedule (measured by running one), and a margin for the CUDA graphs captured after the
pool exists (a constant for the decode graphs, an estimate from the model's width for the prefill
graphs, which keep their piece outputs). What is left, in whole blocks, is the KV pool, capped at what ``max_num_seqs``
requests of ``max_model_len`` tokens could ever hold.

``kv_cache_pages`` is the arithmetic alone (tested on the CPU); ``measure_*`` read the device.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from tscompile.utils import cdiv

logger = logging.getLogger(__name__)

# The decode graphs are captured after the pool is allocated, into their own memory pool: per ladder
# size the step's activations, the logits of bs rows and the sampler's temporaries (a vocabulary
# sort for the sampled variant), plus the library workspaces of the capture stream. Measured on an
# H200: llama-1b, decode ladder up to 64, 0.59 GiB; this covers it and larger ladders.
DECODE_GRAPH_MARGIN_BYTES = 2**30

# Prefill graphs keep every capture's piece outputs for good (``runtime/piece_graphs.py``): per token
# bucket and per Dynamo variant (greedy or sampled, extend or mixed: each compiles its own pieces),
# the tensors that cross piece boundaries in every layer (q, k, v, the attention output, the
# residual stream). Measured on an H200 with llama-1b in bf16: 0.73 GiB per variant at the 2048
# bucket, 5.8 x dim x 2 bytes per token and layer; 6 x dim rounds it up.
PREFILL_GRAPH_VARIANTS = 4
PREFILL_GRAPH_WIDTHS_PER_LAYER = 6


def prefill_graph_bytes(buckets: tuple[int, ...] | list[int], n_layers: int, dim: int, itemsize: int) -> int:
    """What the prefill graphs of every bucket in ``buckets`` and every variant keep once captured."""
    return PREFILL_GRAPH_VARIANTS * sum(buckets) * n_layers * PREFILL_GRAPH_WIDTHS_PER_LAYER * dim * itemsize


# Verify graphs (speculative decoding) are decode graphs of bs * N query rows, in the decode pool.
# Beyond what the decode margin covers, the largest keeps per window row its float32 logits and,
# in the sampled variant, the rejection sampler's float64 p, q and residual over the vocabulary,
# plus the step's activations (about 16 x dim per row, as a decode row's).
VERIFY_BYTES_PER_VOCAB_ENTRY = 4 + 3 * 8
VERIFY_WIDTHS_PER_ROW = 16


def verify_graph_bytes(max_bs: int, width: int, vocab: int, dim: int, itemsize: int) -> int:
    """The verify graphs' share of the graph margin: 0 without speculation (``width`` 1)."""
    if width <= 1:
        return 0
    return max_bs * width * (vocab * VERIFY_BYTES_PER_VOCAB_ENTRY + VERIFY_WIDTHS_PER_ROW * dim * itemsize)


def format_bytes(n: int | float) -> str:
    """GiB above one GiB, MiB below: a refusal must show numbers a reader can compare."""
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


def pages_for_requests(num_requests: int, tokens_per_request: int, block_size: int, pages_per_block: int) -> int:
    """Pages per cache group for ``num_requests`` requests of ``tokens_per_request`` tokens each,
    plus the reserved null block."""
    return (num_requests * cdiv(tokens_per_request, block_size) + 1) * pages_per_block


def kv_cache_pages(*, total_bytes: int, used_bytes: int, activation_peak_bytes: int, margin_bytes: int,
                   utilization: float, bytes_per_page: int, pages_per_block: int, min_pages: int,
                   max_pages: int, max_model_len: int) -> int:
    """Pages per cache group that fit in ``utilization * total_bytes`` after ``used_bytes`` (in use
    with the model loaded), ``activation_peak_bytes`` (the largest step's activations) and
    ``margin_bytes`` (graphs captured later). ``bytes_per_page`` covers one page of every cache
    group (K and V of every layer). The result is a whole number of blocks, at most ``max_pages``
    (more could never be used). Fewer than ``min_pages`` (one request of ``max_model_len`` tokens
    and the null block) is refused: such an engine could not serve the requests it admits."""
    allowed = int(utilization * total_bytes)
    budget = allowed - used_bytes - activation_peak_bytes - margin_bytes
    block_bytes = bytes_per_page * pages_per_block
    pages = max(budget, 0) // block_bytes * pages_per_block
    if pages < min_pages:
        raise ValueError(
            f"tscompile: gpu_memory_utilization {utilization} leaves {format_bytes(max(budget, 0))} for the KV cache "
            f"({utilization} x {format_bytes(total_bytes)} total = {format_bytes(allowed)}, minus "
            f"{format_bytes(used_bytes)} in use with the model loaded, {format_bytes(activation_peak_bytes)} "
            f"activation peak and {format_bytes(margin_bytes)} for CUDA graphs), but one request of max_model_len "
            f"{max_model_len} needs {format_bytes(min_pages * bytes_per_page)} ({min_pages} pages of "
            f"{format_bytes(bytes_per_page)}, the null block included); allowed: a fraction in (0, 1] that "
            f"leaves that much, or lower max_model_len / max_num_batched_tokens, or pass num_pages"
        )
    return min(pages, max_pages)


@dataclass(frozen=True)
class MemoryProfile:
    """What the KV pool of a CUDA engine was sized from (``EngineParts.memory``)."""

    total_bytes: int
    used_bytes: int  # total - free with the model loaded, after the profiling step
    activation_peak_bytes: int
    margin_bytes: int
    utilization: float

    @property
    def kv_budget_bytes(self) -> int:
        return int(self.utilization * self.total_bytes) - self.used_bytes - self.activation_peak_bytes - \
            self.margin_bytes


def measure_activation_peak(device: torch.device, run: Callable[[], object]) -> int:
    """Bytes the caching allocator held at the peak of ``run()`` above what it held before."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    return max(torch.cuda.max_memory_allocated(device) - before, 0)


def measure_device_memory(device: torch.device) -> tuple[int, int]:
    """``(total, used)`` of the device, ``used = total - free``: every process counts, and so does
    the CUDA context; the allocator's cache is emptied first so freed temporaries do not."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return total, total - free


def log_kv_cache(num_blocks: int, block_size: int, pool_bytes: int, max_model_len: int) -> None:
    """The one line an engine logs about its pool; ``num_blocks`` counts usable blocks (the null
    block apart)."""
    logger.info("KV cache: %d blocks of %d tokens, %.2f GiB, max concurrency %.1f at max_model_len %d",
                num_blocks, block_size, pool_bytes / 2**30, num_blocks * block_size / max_model_len, max_model_len)
