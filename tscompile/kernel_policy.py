"""``KernelPolicy``: which kernels and graph passes an engine's compiled steps use.

A leaf module (no tscompile imports): the config, the compiler passes, the attention backends and
the custom ops all read it, and the ops are the lowest layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelPolicy:
    """Kernel and pass choices of one engine (``TscompileConfig.kernels``), each default the one
    measured fastest on the H200 (or the GPU its entry names). Set per engine with ``LLM(..., compile_options={"kernels": {...}})``
    or per ``torch.compile`` call with ``options={"kernels": {...}}``; two engines in one process may
    use different policies.

    decode_gemv: the bs=1 decode graph on CUDA runs the one-row projections whose weight shape has a
        measured launch (``custom_ops/triton_gemv.py``'s ``DECODE_GEMV_CONFIGS``) through the Triton
        GEMV kernel instead of cuBLAS (``passes/decode_gemv.py``), on a GPU that table was timed on.
        On the H200, bs=1 TPOT llama-8b 4.542 -> 4.316 ms, llama-1b 1.100 -> 0.993 ms.
    batch_gemv: the engine's dynamic-batch decode graph (batch sizes 2 to 32) runs the projections the
        few-row table lists at its batch size through the Triton GEMV kernel (``passes/batch_gemv.py``),
        on a GPU that table was timed on. On the H200, llama-8b bs=32 TPOT 5.552 -> 5.469 ms, llama-1b
        bs=8 1.186 -> 1.139 ms.
    decode_pdl: the engine's decode graphs launch their kernels with programmatic dependent launch on
        Hopper and later: the Triton decode attention's split and combine kernels, the GEMV kernels and
        Inductor's kernels (``triton.enable_pdl``), so each kernel may be scheduled while the one
        before it ends. On the H200 llama-8b TPOT 4.299 -> 4.182 ms at bs=1, 5.627 -> 5.444 at bs=32.
        Off: kernel tables whose per-kernel times do not include a waiting kernel's wait.
    prefill_pdl: the same for the prefill steps (the Triton extend kernel, the prefill pieces'
        Inductor kernels). Off by default: on the H200 correct but no faster (llama-1b 1.40 ms both
        ways at 32 tokens).
    fuse_projections: every CUDA graph runs the matmuls of one input over weights stored end to end
        in one buffer as one matmul (``passes/fused_projections.py``): a transformers model's q/k/v
        and gate/up projections, which ``models/hf_packing.py`` packs so at load, become the native
        model's ``wqkv`` and ``w13`` shapes, the ones the GEMV tables list. A graph without such
        weights (the native model's) is unchanged. Off by default: its speed on a GPU is not yet
        measured against the separate projections.
    fused_verify_attention: a speculative verify window's Triton attention runs as decode's does: its
        split kernel writes the window's new K/V rows itself (each split the rows of its own KV
        range, so no program reads a row another writes) instead of a write kernel launched before
        it, and with ``decode_pdl`` its split and combine kernels launch with PDL. Off by default:
        on one H100 (llama-8b bf16 bs=1, k=3, one process) the verify step took 7.151 -> 6.716 ms,
        all of it in the step's host part (the device busy 5.964 -> 5.969 ms a step), from one run
        in which two identical plain engines differed by 0.2 ms; not yet repeated on the H200.
    chunked_gated_delta: a hybrid model's prefill steps run the Triton gated delta rule in
        its chunked form (``custom_ops/triton_gated_delta.py``: 16 rows at a time, matrix products
        inside a chunk) instead of walking each request's tokens one by one; decode and verify steps
        (whose checkpoints keep the state after every row) walk either way. Off by default: its
        speed on a GPU is not yet measured against the walk.
    state_pdl: with ``decode_pdl``, a hybrid model's state kernels (the causal convolution, the gated
        delta rule and the verify commit) launch with PDL too, in every step (the ops cannot tell a
        decode step from a prefill; there a PDL launch only lets a kernel start sooner), so the decode
        graph's chain of PDL launches is not broken twice per linear-attention layer. Off by default:
        its speed on a GPU is not yet measured.
    fused_gated_delta: a hybrid model's decode and verify steps run each linear-attention layer's
        gates, gated delta rule and gated RMSNorm as one op (``custom_ops/gated_delta_fused.py``: on
        CUDA one Triton kernel, a program per value head, for heads up to 128 x 128) instead of three
        kernels. On the H100, qwen3-next-1b bf16 bs=1 TPOT 1.456 -> 1.390 ms (251 -> 215 kernels a
        step, two processes); not yet timed on the H200. In bf16 it may round an intermediate where
        Inductor's unfused kernels keep float32 (``custom_ops/gated_delta_fused.py``).
    split_gated_delta_heads: with ``fused_gated_delta``, the fused kernel splits each value head's
        columns over 4 programs (``custom_ops/triton_gated_delta_fused.py``: the head's last program to
        finish norms its rows), so a small batch's linear-attention layer runs on about as many SMs
        as it has heads times 4 instead of one per head. Off by default: not yet timed on a GPU.
    user_graph_eager_tail: a torch.compile user's split graph, captured whole per token bucket, leaves
        its last piece out where that piece's outputs pass 64 MiB at the bucket (the logits of long
        prompts) and runs it after the replay at the live rows, so the logits are not copied out of
        graph memory (``tscompile/user_graph_tail.py``). Off by default: not yet timed on a GPU
        (``tscompile bench --hf-model ... --kernel-variants tail='{"user_graph_eager_tail": true}'``).
    graphed_refresh: the decode and verify graphs hold the decode metadata refresh
        (``tscompile::refresh_decode_metadata``, one launch over the staged tables), so a replay
        launches nothing before the graph: the staging pads its tables and lengths to the graph's
        batch size, and the refresh over those padded rows is the padding refresh. A backend whose
        refresh plans on the host (FlashInfer) or a model with recurrent-state layers refreshes
        before each replay either way. Off by default: the host time it saves a step is not yet
        measured on a GPU.
    """

    decode_gemv: bool = True
    batch_gemv: bool = True
    decode_pdl: bool = True
    prefill_pdl: bool = False
    fuse_projections: bool = False
    fused_verify_attention: bool = False
    chunked_gated_delta: bool = False
    state_pdl: bool = False
    fused_gated_delta: bool = True
    split_gated_delta_heads: bool = False
    user_graph_eager_tail: bool = False
    graphed_refresh: bool = False

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, bool):
                raise ValueError(f"tscompile: kernels.{f.name} must be True or False, got {value!r}")

    @classmethod
    def from_options(cls, options: "KernelPolicy | dict | None") -> "KernelPolicy":
        """A policy from ``compile_options["kernels"]``: a KernelPolicy, a dict of its fields or None
        (the defaults). Unknown keys are refused with the known ones."""
        if options is None:
            return cls()
        if isinstance(options, cls):
            return options
        if not isinstance(options, dict):
            raise ValueError(f"tscompile: kernels must be a dict of KernelPolicy fields or a KernelPolicy, "
                             f"got {options!r}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"tscompile: unknown kernels option(s) {unknown}; known kernels options: {known}")
        return cls(**options)

    def as_dict(self) -> dict[str, bool]:
        return dataclasses.asdict(self)
