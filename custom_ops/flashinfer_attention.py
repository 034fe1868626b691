"""The ``flashinfer/<key>`` implementations of ``tscompile::attention``: FlashInfer kernels behind
the one attention op, so Dynamo and Inductor trace through it (its fake kernel is the op's).

FlashInfer's kernels run from wrapper objects planned on the host (``plan()``), which cannot be op
arguments. Each FlashInfer attention backend registers a *runner* here (an object holding its
planned wrappers) and gets back an impl name carrying a static key, ``flashinfer/<key>``; the name
is a constant of the traced graph, and the op looks the runner up by it on every call. The
registry holds runners weakly: an engine that is gone leaves only a name that refuses to run.

A call writes this forward's K/V with the existing write path (the Triton KV-write kernel where
Triton imports, else ``index_copy_``), then asks the runner for attention over the planned pages.
Padded decode rows differ from the torch and Triton impls: FlashInfer needs one KV entry per row,
so they attend to the null page's slot 0 (which they have just written) instead of getting zeros;
nothing reads them. Rows past ``qo_indptr[-1]`` of an extend step are zeroed by the op as for
every impl.
"""

from __future__ import annotations

import itertools
import weakref
from functools import partial
from typing import Protocol

import torch

from tscompile.custom_ops.attention import register_attention_impl
from tscompile.custom_ops.attention import write_kv as torch_write_kv

try:  # the fused write kernel; the index_copy_ path is the same contract where triton is missing
    from tscompile.custom_ops.triton_attention import write_kv as triton_write_kv
except ImportError:  # pragma: no cover  (triton ships with CUDA torch)
    triton_write_kv = None

IMPL_PREFIX = "flashinfer/"


class FlashInferRunner(Protocol):
    """What a FlashInfer backend exposes to the op: attention over the pages its last plan named.
    ``out`` is written in place; ``scale`` is the model's softmax scale."""

    def run_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                   scale: float) -> None: ...

    def run_extend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                   scale: float) -> None: ...


_keys = itertools.count()


def register_flashinfer_runner(runner: FlashInferRunner) -> str:
    """Make ``runner`` reachable from the op; returns the impl name to pass as ``impl``."""
    name = f"{IMPL_PREFIX}{next(_keys)}"
    register_attention_impl(name, partial(_flashinfer_attention, weakref.ref(runner), name))
    return name


def write_kv(k, v, k_cache, v_cache, write_loc) -> None:
    if triton_write_kv is not None and k_cache.is_cuda:
        triton_write_kv(k, v, k_cache, v_cache, write_loc)
    else:
        torch_write_kv(k, v, k_cache, v_cache, write_loc)


def _flashinfer_attention(runner_ref, name, q, k, v, k_cache, v_cache, out, page_table, seq_lens, qo_indptr,
                          write_loc, scale, decode) -> None:
    runner = runner_ref()
    if runner is None:
        raise RuntimeError(f"tscompile: attention impl {name!r} belongs to a FlashInfer backend that no longer "
                           "exists (its engine was freed)")
    write_kv(k, v, k_cache, v_cache, write_loc)
    if decode:
        runner.run_decode(q, k_cache, v_cache, out, scale)
    else:
        runner.run_extend(q, k_cache, v_cache, out, scale)
