"""The decode roofline (bytes a step must read, the copy bandwidth) and the prefill MFU (FLOPs a
prompt costs, the matmul peak).

A decode step reads every weight once (the embedding table only for its ``bs`` gathered rows, unless
it is tied to the output projection, which reads it whole) plus the K and V of every cached token
of every request in every layer. Roofline ms/step = those bytes / the measured copy bandwidth.
A hybrid model (Qwen3-Next) has K and V in its full-attention layers only; its linear-attention
layers read and write each request's float32 recurrent state (convolution window and state matrix)
once per step instead, which the roofline counts as state bytes.

A bs=1 prefill of ``L`` tokens multiplies every token through every layer's linears and the last
token through the output projection (every mode computes logits of the last row only), plus causal
attention. MFU = those FLOPs / step time / the measured matmul peak.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tscompile.models.llama import ModelConfig


@dataclass(frozen=True)
class StepBytes:
    weight_bytes: int
    kv_bytes: int
    state_bytes: int = 0  # recurrent state read + written (hybrid models)

    @property
    def total(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.state_bytes


def _hybrid(cfg: ModelConfig):
    """The layer kinds' parameter counts of a hybrid config, from its model built on ``meta``
    (no memory), or None for a plain decoder: (layer params, linear-matmul params, the model)."""
    from tscompile.models.qwen3_next import Qwen3NextConfig, Qwen3NextTransformer

    if not isinstance(cfg, Qwen3NextConfig):
        return None
    with torch.device("meta"):
        model = Qwen3NextTransformer(cfg)
    layers = sum(p.numel() for p in model.layers.parameters())
    matmuls = sum(p.numel() for n, p in model.layers.named_parameters() if p.dim() == 2)
    return layers, matmuls, model


def _attention_layers(cfg: ModelConfig) -> int:
    types = getattr(cfg, "layer_types", None)
    return cfg.n_layers if types is None else sum(t == "full_attention" for t in types)


def linear_params_per_layer(cfg: ModelConfig) -> int:
    """Weights of one layer's matmuls (wqkv, wo, w13, w2); biases and norms are not matmuls."""
    hd = cfg.head_dim
    qkv_out = (cfg.n_heads + 2 * cfg.n_kv_heads) * hd
    return cfg.dim * qkv_out + cfg.n_heads * hd * cfg.dim + cfg.dim * 2 * cfg.intermediate_size \
        + cfg.intermediate_size * cfg.dim


def prefill_flops(cfg: ModelConfig, prompt_len: int) -> int:
    """FLOPs of one request's prefill: 2 per multiply-add of the linears over ``prompt_len`` tokens and
    of the output projection over the last one, plus causal attention (query ``i`` reads ``i + 1``
    keys: ``L (L + 1) / 2`` score entries per head, 2 FLOPs each for QK^T and again for PV)."""
    L = prompt_len
    hybrid = _hybrid(cfg)  # a hybrid's linear layers' recurrence is not counted (it is not a matmul peak's work)
    layer_matmuls = cfg.n_layers * linear_params_per_layer(cfg) if hybrid is None else hybrid[1]
    matmuls = 2 * L * layer_matmuls + 2 * cfg.vocab_size * cfg.dim
    attention = _attention_layers(cfg) * 4 * (L * (L + 1) // 2) * cfg.n_heads * cfg.head_dim
    return matmuls + attention


def mfu(flops: int, seconds: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilization (a fraction), None without a peak to compare with."""
    if not peak_tflops or seconds <= 0:
        return None
    return flops / seconds / (peak_tflops * 1e12)


def weight_params_per_step(cfg: ModelConfig, batch_size: int) -> int:
    """Parameters a decode step of ``batch_size`` rows reads."""
    hd = cfg.head_dim
    qkv_out = (cfg.n_heads + 2 * cfg.n_kv_heads) * hd
    per_layer = (
        cfg.dim * qkv_out + (qkv_out if cfg.qkv_bias else 0)  # wqkv
        + cfg.n_heads * hd * cfg.dim  # wo
        + cfg.dim * 2 * cfg.intermediate_size  # w13
        + cfg.intermediate_size * cfg.dim  # w2
        + 2 * cfg.dim  # attention_norm, ffn_norm
    )
    output = cfg.vocab_size * cfg.dim
    embedding = 0 if cfg.tie_embeddings else min(batch_size, cfg.vocab_size) * cfg.dim
    hybrid = _hybrid(cfg)
    layers = cfg.n_layers * per_layer if hybrid is None else hybrid[0]
    return layers + cfg.dim + output + embedding  # + final norm


def kv_bytes_per_step(cfg: ModelConfig, batch_size: int, context_len: float, dtype_bytes: int) -> int:
    """K and V read by one decode step: every layer, every request, ``context_len`` cached tokens."""
    per_token = _attention_layers(cfg) * 2 * cfg.n_kv_heads * cfg.head_dim * dtype_bytes
    return int(round(batch_size * context_len * per_token))


def state_bytes_per_step(cfg: ModelConfig, batch_size: int) -> int:
    """Recurrent state a decode step reads and writes (float32, every live request's slot once each)."""
    hybrid = _hybrid(cfg)
    return 0 if hybrid is None else hybrid[2].state_spec().decode_step_bytes(batch_size)


def decode_step_bytes(cfg: ModelConfig, batch_size: int, context_len: float, dtype_bytes: int) -> StepBytes:
    return StepBytes(weight_params_per_step(cfg, batch_size) * dtype_bytes,
                     kv_bytes_per_step(cfg, batch_size, context_len, dtype_bytes),
                     state_bytes_per_step(cfg, batch_size))


def mean_decode_context(input_len: int, output_len: int) -> float:
    """Mean KV length over the timed decode steps: step ``j`` (1..output_len-1) attends to input_len + j."""
    if output_len <= 1:
        return float(input_len)
    return input_len + output_len / 2


def roofline_ms(step_bytes: int, bandwidth_gbps: float) -> float:
    return step_bytes / (bandwidth_gbps * 1e9) * 1e3


def roofline_applies(device: torch.device, step_bytes: int) -> tuple[bool, str]:
    """Whether "% of roofline" says how close a decode step is to the memory system's limit.

    The roofline assumes every step streams its bytes from DRAM/HBM at the probe's bandwidth, and the
    probe copies 2 x 256 MiB (1 GiB on cuda), past every cache. On the CPU that assumption fails for
    the models the CPU runs: llama-tiny's step reads about 5 MB, which stays in L2/L3 between steps,
    so the step reads at cache bandwidth and the ratio exceeds 100%; a probe sized to the step would
    fix the bandwidth, but a CPU decode step of such a model is bound by per-op dispatch rather than
    by bytes, so the ratio would still not be a bandwidth statement. Hence no percentage on the CPU
    (the bytes, roofline ms and achieved GB/s stay: they are plain facts), and none on a GPU whose
    L2 holds the whole step (llama-tiny on an H200's 60 MB L2)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, "cpu: the step's bytes stay in the CPU caches; the probe measures DRAM"
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
    if step_bytes <= l2:
        return False, f"the step's {step_bytes} bytes fit in the {l2}-byte L2"
    return True, ""


def measure_copy_bandwidth(device: torch.device, nbytes: int | None = None, iters: int = 10) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written per second)."""
    device = torch.device(device)
    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    seconds = _seconds(lambda: dst.copy_(src), iters, device)
    del src, dst
    return 2 * nbytes * iters / seconds / 1e9


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype, n: int = 8192, iters: int = 10,
                          warmup: int = 3) -> float:
    """Achieved TFLOP/s of an ``n x n x n`` matmul in ``dtype`` on random data (zeros would run
    faster than any model's operands: less switching in the multipliers)."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=g, device=device, dtype=torch.float32).to(dtype)
    b = torch.randn(n, n, generator=g, device=device, dtype=torch.float32).to(dtype)
    for _ in range(warmup):
        torch.mm(a, b)
    seconds = _seconds(lambda: torch.mm(a, b), iters, device)
    del a, b
    return 2 * n ** 3 * iters / seconds / 1e12


def _seconds(fn, iters: int, device: torch.device) -> float:
    """Wall time of ``iters`` calls of ``fn``: CUDA events on a GPU, the host clock elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return time.perf_counter() - t0
