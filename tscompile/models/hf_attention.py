"""The attention function a transformers model runs on the engine, and the load-time probe of what
its layers ask of attention.

transformers (4.51 and later) looks a layer's attention function up by the config's
``attn_implementation`` name in ``transformers.AttentionInterface``; ``ATTENTION_NAME`` is registered
there as ``paged_attention_forward``. The model is called on packed rows (one "batch" of every
request's tokens, ``input_ids[None]``) without a transformers cache, so the function ignores the
mask transformers would build (none is built for a name without a mask function) and calls the
engine's attention through the forward context: the K/V write at this step's ``write_locations``
and the paged kernels, exactly what the native model's layers call.

What a layer passes besides q/k/v (``scaling``, ``sliding_window``, ``softcap``, sinks, a mask of
its own) is found once at load time by ``probe_attention_calls``: one forward on the ``meta``
device, every layer's call recorded instead of run. ``check_attention_calls`` then refuses what the
engine cannot honour, naming the model and the feature.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from tscompile.forward_context import get_forward_context

ATTENTION_NAME = "tscompile_paged"
MIN_TRANSFORMERS = (4, 51)  # AttentionInterface.register

# Per-layer keywords a layer may pass that carry nothing the paged kernel must apply: positions
# (the forward context holds each row's), and caching switches (no transformers cache is used).
_IGNORED_KWARGS = frozenset({"position_ids", "cache_position", "use_cache", "past_key_values", "past_key_value",
                             "output_attentions", "layer_idx"})


@dataclass(frozen=True)
class AttentionCall:
    """What one layer passed to its attention function during the probe forward.

    Shapes follow transformers' convention: query ``[batch, n_heads, q_len, head_dim]``, key and value
    ``[batch, n_kv_heads, kv_len, head_dim]``."""

    module: nn.Module
    layer_idx: int | None
    batch: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    value_head_dim: int
    q_len: int
    kv_len: int
    scaling: float | None
    dropout: float
    has_mask: bool
    is_causal: bool
    sliding_window: int | None
    softcap: float | None
    other: dict = field(default_factory=dict)  # further keywords that were not None


_recorded: list[AttentionCall] | None = None  # set only while probe_attention_calls runs


def paged_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract on the engine's paged cache.

    query ``[1, n_heads, T, head_dim]``, key/value ``[1, n_kv_heads, T, head_dim]`` in the model's
    dtype (T: the step's packed rows, RoPE applied). Returns ``([1, T, n_heads, head_dim], None)``.
    ``module.tscompile_k_cache``/``tscompile_v_cache`` are the layer's pages, bound by
    ``TransformersModel.bind_kv_cache``. ``attention_mask`` and the keywords are ignored here: the
    paged metadata is the mask, and ``check_attention_calls`` refused at load time every keyword
    the kernel would have to apply."""
    if _recorded is not None:
        _recorded.append(_record(module, query, key, value, attention_mask, scaling, dropout, kwargs))
        return _causal_attention(query, key, value, scaling), None
    ctx = get_forward_context()
    q = query[0].transpose(0, 1).contiguous()  # [T, n_heads, head_dim]
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    out = torch.empty_like(q)
    ctx.attention.forward(module.layer_idx, ctx.attention_mode, q, k, v, module.tscompile_k_cache,
                          module.tscompile_v_cache, out, scale)
    return out[None], None


def _causal_attention(query, key, value, scaling) -> torch.Tensor:
    """Plain causal attention of one sequence, ``[1, T, n_heads, head_dim]``: what a probe forward
    computes (nothing on the ``meta`` device)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2)


def _record(module, query, key, value, attention_mask, scaling, dropout, kwargs) -> AttentionCall:
    kwargs = dict(kwargs)
    window, softcap = kwargs.pop("sliding_window", None), kwargs.pop("softcap", None)
    causal = kwargs.pop("is_causal", None)
    causal = getattr(module, "is_causal", True) if causal is None else causal
    other = {k: v for k, v in kwargs.items() if v is not None and k not in _IGNORED_KWARGS}
    return AttentionCall(
        module=module, layer_idx=getattr(module, "layer_idx", None), batch=query.shape[0], n_heads=query.shape[1],
        n_kv_heads=key.shape[1], head_dim=query.shape[-1], value_head_dim=value.shape[-1], q_len=query.shape[2],
        kv_len=key.shape[2], scaling=None if scaling is None else float(scaling), dropout=float(dropout or 0.0),
        has_mask=attention_mask is not None, is_causal=bool(causal), sliding_window=window, softcap=softcap,
        other=other)


def transformers_version() -> tuple[int, int]:
    import transformers

    major, minor = (int("".join(c for c in part if c.isdigit()) or 0) for part in
                    transformers.__version__.split(".")[:2])
    return major, minor


def register_attention() -> None:
    """Register ``paged_attention_forward`` as ``ATTENTION_NAME``; refuses transformers older than 4.51."""
    import transformers

    if transformers_version() < MIN_TRANSFORMERS:
        raise ValueError(f"tscompile: model_impl='transformers' needs transformers >= "
                         f"{'.'.join(map(str, MIN_TRANSFORMERS))} (AttentionInterface), found "
                         f"{transformers.__version__}; upgrade transformers or use model_impl='native'")
    transformers.AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


@contextlib.contextmanager
def recording() -> Iterator[list[AttentionCall]]:
    global _recorded
    prev, _recorded = _recorded, []
    try:
        yield _recorded
    finally:
        _recorded = prev


def probe_attention_calls(hf_model: nn.Module, rows: int = 3) -> list[AttentionCall]:
    """Every attention call of one forward of ``rows`` packed tokens (on the model's device, the
    ``meta`` device for a model built there: nothing is computed)."""
    device = next(hf_model.parameters()).device
    ids = torch.arange(rows, device=device)[None]
    with recording() as calls, torch.no_grad():
        hf_model(input_ids=ids, position_ids=ids.clone(), use_cache=False)
    return list(calls)


def reads_position_ids(hf_model: nn.Module, rows: int = 4) -> bool:
    """Whether the model's output depends on ``position_ids``: the same tokens at positions
    ``0..rows-1`` and all at position 0, with plain causal attention. A model that numbers its
    tokens itself (from the mask or the sequence) would number packed rows of several requests as
    one sequence."""
    device = next(hf_model.parameters()).device
    ids = (torch.arange(rows, device=device)[None] * 7 + 3) % hf_model.get_input_embeddings().weight.shape[0]
    with recording(), torch.no_grad():
        counted = hf_model(input_ids=ids, position_ids=torch.arange(rows, device=device)[None], use_cache=False)
        same = hf_model(input_ids=ids, position_ids=torch.zeros_like(ids), use_cache=False)
    return not torch.equal(counted.logits, same.logits)


@dataclass(frozen=True)
class AttentionShape:
    """What the KV cache and the runner need: one geometry for every layer."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int


def check_attention_calls(calls: list[AttentionCall], *, model: str, n_layers: int, rows: int,
                          max_model_len: int) -> AttentionShape:
    """Refuse, naming ``model`` and the feature, any layer whose attention the engine cannot run
    exactly; otherwise the shared geometry. ``rows``: the probe's packed tokens."""
    def refuse(feature: str, fix: str) -> None:
        raise ValueError(f"tscompile: {model} cannot run on the transformers backend: {feature}; {fix}")

    if len(calls) != n_layers or sorted(c.layer_idx for c in calls if c.layer_idx is not None) != list(range(n_layers)):
        refuse(f"its {n_layers} layers made {len(calls)} attention calls with layer indices "
               f"{[c.layer_idx for c in calls]} (layers without attention, such as state-space or recurrent "
               "layers, or shared attention modules)", "only decoders with one attention call per layer are supported")
    first = calls[0]
    for c in calls:
        where = f"layer {c.layer_idx}"
        if c.batch != 1 or c.q_len != rows or c.kv_len != rows:
            refuse(f"{where} attends over {c.kv_len} keys for {c.q_len} queries (cross-attention or a cache of "
                   "its own)", "only self-attention over the step's own tokens is supported")
        if (c.n_heads, c.n_kv_heads, c.head_dim) != (first.n_heads, first.n_kv_heads, first.head_dim):
            refuse(f"{where} has {c.n_heads} heads / {c.n_kv_heads} kv heads / head_dim {c.head_dim}, layer "
                   f"{first.layer_idx} {first.n_heads} / {first.n_kv_heads} / {first.head_dim}",
                   "per-layer attention shapes are not supported")
        if c.value_head_dim != c.head_dim:
            refuse(f"{where} has value head_dim {c.value_head_dim} != key head_dim {c.head_dim}",
                   "only equal key and value head sizes are supported")
        if c.n_heads % c.n_kv_heads:
            refuse(f"{where} has {c.n_heads} heads, not a multiple of {c.n_kv_heads} kv heads",
                   "grouped-query attention needs whole groups")
        if not c.is_causal:
            refuse(f"{where} is not causal (bidirectional attention)", "only causal decoders are supported")
        if c.softcap is not None:
            refuse(f"{where} uses attention logit soft-capping (softcap={c.softcap})",
                   "the paged kernels do not soft-cap; no setting changes this")
        if c.sliding_window is not None and c.sliding_window < max_model_len:
            refuse(f"{where} uses sliding-window attention (window {c.sliding_window}), shorter than "
                   f"max_model_len {max_model_len}",
                   f"pass max_model_len <= {c.sliding_window} (a window that long masks nothing)")
        if c.dropout:
            refuse(f"{where} applies attention dropout {c.dropout} in eval mode", "set attention_dropout to 0")
        if c.has_mask:
            refuse(f"{where} receives an attention mask or bias built by the model (ALiBi or a custom mask)",
                   "the paged kernels apply the causal mask only")
        if c.other:
            refuse(f"{where} passes attention arguments the paged kernels cannot honour: {sorted(c.other)}",
                   "only scaling, a long-enough sliding_window and position arguments are supported")
    return AttentionShape(n_layers, first.n_heads, first.n_kv_heads, first.head_dim)
