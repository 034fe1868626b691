"""The decode roofline: bytes a decode step must read, and the copy bandwidth it is read at.

A decode step reads every weight once (the embedding table only for its ``bs`` gathered rows, unless
it is tied to the output projection, which reads it whole) plus the K and V of every cached token
of every request in every layer. Roofline ms/step = those bytes / the measured copy bandwidth.
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

    @property
    def total(self) -> int:
        return self.weight_bytes + self.kv_bytes


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
    return cfg.n_layers * per_layer + cfg.dim + output + embedding  # + final norm


def kv_bytes_per_step(cfg: ModelConfig, batch_size: int, context_len: float, dtype_bytes: int) -> int:
    """K and V read by one decode step: every layer, every request, ``context_len`` cached tokens."""
    per_token = cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * dtype_bytes
    return int(round(batch_size * context_len * per_token))


def decode_step_bytes(cfg: ModelConfig, batch_size: int, context_len: float, dtype_bytes: int) -> StepBytes:
    return StepBytes(weight_params_per_step(cfg, batch_size) * dtype_bytes,
                     kv_bytes_per_step(cfg, batch_size, context_len, dtype_bytes))


def mean_decode_context(input_len: int, output_len: int) -> float:
    """Mean KV length over the timed decode steps: step ``j`` (1..output_len-1) attends to input_len + j."""
    if output_len <= 1:
        return float(input_len)
    return input_len + output_len / 2


def roofline_ms(step_bytes: int, bandwidth_gbps: float) -> float:
    return step_bytes / (bandwidth_gbps * 1e9) * 1e3


def measure_copy_bandwidth(device: torch.device, nbytes: int | None = None, iters: int = 10) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written per second)."""
    device = torch.device(device)
    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dst.copy_(src)
        end.record()
        torch.cuda.synchronize(device)
        seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        seconds = time.perf_counter() - t0
    del src, dst
    return 2 * nbytes * iters / seconds / 1e9
