"""Attention backends: a registry with lazy imports, so a missing optional kernel package only
matters when its backend is asked for."""

from __future__ import annotations

import importlib
import logging

import torch

from tscompile.attention.base import AttentionBackend, AttentionMetadata, PagedAttentionBackend
from tscompile.attention.flashinfer_host import FLASHINFER_NEEDS
from tscompile.attention.router import AttentionRouter, DecodeInputs
from tscompile.attention.support import CudaGraphSupport, resolve_cuda_graph_support
from tscompile.kernel_policy import KernelPolicy
from tscompile.kv_cache.spec import CacheGroupSpec
from tscompile.utils import cdiv

logger = logging.getLogger("tscompile")

# name -> (module, class) of the kernel-facing paged leaf
BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("tscompile.attention.torch_backend", "TorchAttentionBackend"),
    "triton": ("tscompile.attention.triton_backend", "TritonAttentionBackend"),
    "flashinfer": ("tscompile.attention.flashinfer_backend", "FlashInferAttentionBackend"),
}


def leaf_class(name: str) -> type[PagedAttentionBackend]:
    if name not in BACKENDS:
        raise ValueError(f"tscompile: unknown attention backend {name!r}; known: {sorted(BACKENDS)}")
    module, cls = BACKENDS[name]
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        if name == "flashinfer":  # an optional extra: say how to get it, not just what failed
            raise ValueError(f"{FLASHINFER_NEEDS}; flashinfer does not import here ({e})") from e
        raise


def default_backend_name(device: torch.device | str) -> str:
    """``auto``: Triton kernels on CUDA when triton imports, the torch oracle elsewhere (on CUDA
    with a warning: the oracle is slow). Never FlashInfer: on an H200 the Triton backend was faster in
    every decode (bs 1-64) and prefill row of llama-1b and llama-8b (docs/performance.md), and
    FlashInfer also builds its kernels on first use (about 100 s) and cannot be exported."""
    if torch.device(device).type == "cuda":
        try:
            leaf_class("triton")
            return "triton"
        except ImportError as e:
            logger.warning("tscompile: attention_backend='auto' falls back to the slow torch backend on CUDA: "
                           "triton does not import (%s)", e)
    return "torch"


def create_attention_router(name: str, specs: list[CacheGroupSpec], *, max_model_len: int, page_size: int,
                            pages_per_block: int, device: torch.device | str,
                            kernels: KernelPolicy | None = None) -> AttentionRouter:
    """One leaf of backend ``name`` per cache group under a router; ``auto`` picks per device.
    ``kernels``: the engine's kernel choices (default ``KernelPolicy()``), handed to every leaf."""
    if name == "auto":
        name = default_backend_name(device)
    cls = leaf_class(name)
    max_pages = cdiv(max_model_len, page_size)
    leaves = [cls(gid, max_pages=max_pages, device=torch.device(device)) for gid in range(len(specs))]
    for leaf in leaves:
        leaf.use_kernel_policy(kernels or KernelPolicy())
    return AttentionRouter(specs, leaves, max_blocks=cdiv(max_model_len, page_size * pages_per_block), device=device)


__all__ = [
    "AttentionBackend", "AttentionMetadata", "AttentionRouter", "BACKENDS", "CudaGraphSupport", "DecodeInputs",
    "PagedAttentionBackend", "create_attention_router", "leaf_class", "resolve_cuda_graph_support",
]
