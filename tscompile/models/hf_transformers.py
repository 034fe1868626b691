"""Any transformers causal LM on the engine: the checkpoint's own modeling code, attention replaced.

``load_transformers_checkpoint`` builds the model transformers' ``AutoModelForCausalLM`` maps the
checkpoint's config to, with ``attn_implementation`` set to the paged attention function of
``hf_attention.py``, and wraps it in ``TransformersModel``, which presents the runner the
interface of the native ``Transformer``: ``forward(input_ids [T] int64, positions [T] int64) ->
logits [B, vocab] float32`` of each request's sampled row (``ctx.logits_rows``), ``cache_groups()``,
``bind_kv_cache(pool)`` and a ``config`` with the fields the runtime reads. The runner's decode
graphs, prefill graphs and the split at the attention op apply unchanged: every layer reaches the
same ``tscompile::attention`` path through the forward context.

Before any weight is read, the model is built on the ``meta`` device and probed (one forward whose
attention calls are recorded, ``hf_attention.probe_attention_calls``): a feature the engine cannot
honour (soft-capping, a sliding window shorter than ``max_model_len``, sinks, a model-built mask,
layers without attention, data-dependent RoPE) is refused there, naming the model and the feature.
The same forward finds the projections that read one input (q/k/v, gate/up); after loading, each
group's weights share one buffer (``hf_packing.py``), which the compiled graphs run as one matmul.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from tscompile.forward_context import get_forward_context
from tscompile.kv_cache.pool import KVCachePool
from tscompile.kv_cache.spec import CacheGroupSpec
from tscompile.models.checkpoint import CheckpointInfo, checkpoint_root
from tscompile.models.hf_attention import (ATTENTION_NAME, check_attention_calls, probe_attention_calls,
                                           reads_position_ids, register_attention, transformers_version)
from tscompile.models.hf_config import ARCHITECTURES, checkpoint_dtype, eos_token_ids, read_json_object
from tscompile.models.hf_packing import pack_projections, shared_input_projections

log = logging.getLogger(__name__)

MODEL_IMPLS = ("auto", "native", "transformers")  # tscompile.LLM's model_impl

PROBE_ROWS = 3
# RoPE types whose frequencies depend on the longest position in the call: on packed rows one
# request's length would change another's rotation
_DATA_DEPENDENT_ROPE = ("dynamic", "longrope")


@dataclass(frozen=True)
class TransformersModelConfig:
    """The fields of ``ModelConfig`` the runtime reads, for a transformers model."""

    architecture: str
    vocab_size: int  # the LM head's rows (the width of the logits)
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    max_position: int
    narrow_layer: None = None  # no row narrowing

    def to_dict(self) -> dict:
        return asdict(self)


class TransformersModel(nn.Module):
    """A transformers ``*ForCausalLM`` (attention: ``ATTENTION_NAME``) behind the native model's interface."""

    def __init__(self, hf_model: nn.Module, config: TransformersModelConfig, attention_modules: list[nn.Module]):
        super().__init__()
        self.hf_model = hf_model
        self.config = config
        # the layers' attention modules by layer index (a plain list: they are hf_model's submodules)
        self._attention_modules = list(attention_modules)
        for module in self._attention_modules:  # bound by bind_kv_cache: [num_pages, page_size, n_kv_heads, head_dim]
            module.register_buffer("tscompile_k_cache", torch.empty(0), persistent=False)
            module.register_buffer("tscompile_v_cache", torch.empty(0), persistent=False)

    @property
    def tok_embeddings(self) -> nn.Module:
        """The token embedding (its weight's dtype is the model's)."""
        return self.hf_model.get_input_embeddings()

    @property
    def num_encoder_layers(self) -> int:
        return self.config.n_layers

    def reset_rope(self, device: torch.device | str, positions: int | None = None) -> None:
        """Nothing to do: the modeling code computes RoPE from ``position_ids`` in each forward."""
        del device, positions

    def cache_groups(self) -> list[CacheGroupSpec]:
        cfg = self.config
        return [CacheGroupSpec("full", tuple(range(cfg.n_layers)), cfg.n_kv_heads, cfg.head_dim)]

    def bind_kv_cache(self, pool: KVCachePool) -> None:
        for layer_id, module in enumerate(self._attention_modules):
            module.tscompile_k_cache, module.tscompile_v_cache = pool.layer_cache(layer_id)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: ``[T]`` int64 packed rows -> ``[B, vocab]`` float32 logits of
        ``ctx.logits_rows`` (the head runs on those rows only, through ``logits_to_keep``)."""
        out = self.hf_model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                            logits_to_keep=get_forward_context().logits_rows, return_dict=True)
        return out.logits[0].float()


def native_architecture(path: str | os.PathLike) -> str | None:
    """The checkpoint's architecture when the native model implements it, else None."""
    raw = read_json_object(Path(path) / "config.json")
    names = raw.get("architectures") or []
    return names[0] if len(names) == 1 and names[0] in ARCHITECTURES else None


def choose_model_impl(path: str | os.PathLike, model_impl: str) -> str:
    """``"native"`` or ``"transformers"`` for a checkpoint directory; ``"auto"`` picks native where
    it exists. The choice is logged: at INFO when a checkpoint falls back to its transformers code,
    at DEBUG when it runs natively (the expected case, kept out of the CLI's output)."""
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"tscompile: model_impl {model_impl!r} is not one of {', '.join(MODEL_IMPLS)}")
    if model_impl != "auto":
        return model_impl
    native = native_architecture(path)
    chosen = "native" if native is not None else "transformers"
    say = log.debug if chosen == "native" else log.info
    say("tscompile: %s runs on the %s implementation (model_impl='auto')",
        native or _architecture_name(read_json_object(Path(path) / "config.json")), chosen)
    return chosen


def _architecture_name(raw: dict) -> str:
    names = raw.get("architectures") or []
    return names[0] if len(names) == 1 else str(names or raw.get("model_type", "the checkpoint"))


def _rope_types(text_config) -> set[str]:
    params = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    nested = [p for p in params.values() if isinstance(p, dict)] if isinstance(params, dict) else []
    return {str(p.get("rope_type", p.get("type", "default"))) for p in (nested or [params]) if isinstance(p, dict)}


def check_config(raw: dict, text_config, model: str) -> None:
    """Refusals readable from the config alone (before anything is built)."""
    def refuse(feature: str, fix: str) -> None:
        raise ValueError(f"tscompile: {model} cannot run on the transformers backend: {feature}; {fix}")

    if raw.get("auto_map"):
        refuse("its modeling code lives in the checkpoint (auto_map, trust_remote_code)",
               "only architectures that ship with transformers are loaded")
    if raw.get("quantization_config"):
        refuse(f"it is quantized ({raw['quantization_config'].get('quant_method', '?')})",
               "pass a float32/bfloat16/float16 checkpoint")
    rope = _rope_types(text_config) & set(_DATA_DEPENDENT_ROPE)
    if rope:
        refuse(f"RoPE type {sorted(rope)[0]!r} rescales by the longest position of the call, which on packed "
               "rows mixes requests", "use a checkpoint with a static RoPE type")
    for kind in set(getattr(text_config, "layer_types", None) or ()):
        if kind not in ("full_attention", "sliding_attention"):
            refuse(f"it has {kind!r} layers", "only attention layers are supported")


def _build(hf_config, root: Path | None = None, dtype: torch.dtype | None = None) -> nn.Module:
    """The model on the ``meta`` device (``root`` None: nothing is read) or with the weights of the
    checkpoint at ``root`` in ``dtype``, on the CPU."""
    import transformers

    auto = transformers.AutoModelForCausalLM
    if root is None:
        with torch.device("meta"):
            return auto.from_config(hf_config, attn_implementation=ATTENTION_NAME).eval()
    dtype_kwarg = {"dtype": dtype} if transformers_version() >= (4, 56) else {"torch_dtype": dtype}  # renamed in 4.56
    return auto.from_pretrained(root, config=hf_config, attn_implementation=ATTENTION_NAME, local_files_only=True,
                                **dtype_kwarg).eval()


def load_transformers_checkpoint(path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                                 device: torch.device | str | None = None,
                                 max_model_len: int | None = None) -> tuple[TransformersModel, CheckpointInfo]:
    """A local checkpoint directory as a ``TransformersModel`` and its ``CheckpointInfo``.

    ``dtype`` defaults to the checkpoint's own on CUDA and float32 on the CPU (as for the native
    model). ``max_model_len`` (default: max_position_embeddings) is checked against every layer's
    sliding window."""
    import transformers

    register_attention()
    root = checkpoint_root(path)
    raw = json.loads((root / "config.json").read_text())
    name = _architecture_name(raw)
    if raw.get("auto_map"):  # refused before transformers would ask for trust_remote_code
        check_config(raw, None, name)
    try:
        hf_config = transformers.AutoConfig.from_pretrained(root, local_files_only=True)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"tscompile: {name}: transformers {transformers.__version__} cannot read "
                         f"{str(root)!r}'s config ({exc}); upgrade transformers or check the checkpoint") from exc
    if type(hf_config) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"tscompile: {name} ({hf_config.model_type}) is not a causal language model transformers "
                         "can build (AutoModelForCausalLM); only decoder LMs are supported")
    text = hf_config.get_text_config()
    check_config(raw, text, name)
    max_position = int(getattr(text, "max_position_embeddings", 0) or 0)
    if max_position <= 0:
        raise ValueError(f"tscompile: {name}'s config has no max_position_embeddings; the engine needs the "
                         "longest position the model supports")
    limit = max_position if max_model_len is None else max_model_len

    probe_model = _build(hf_config)
    calls = []
    # one probe forward: the attention calls for the checks, the projections that share an input for packing
    projection_groups = shared_input_projections(
        probe_model, lambda: calls.extend(probe_attention_calls(probe_model, PROBE_ROWS)))
    shape = check_attention_calls(calls, model=name, n_layers=int(text.num_hidden_layers), rows=PROBE_ROWS,
                                  max_model_len=limit)
    module_names = {id(m): n for n, m in probe_model.named_modules()}
    attention_names = [module_names[id(c.module)] for c in sorted(calls, key=lambda c: c.layer_idx)]
    if "logits_to_keep" not in inspect.signature(probe_model.forward).parameters:
        raise ValueError(f"tscompile: {name}'s forward takes no logits_to_keep; the engine computes logits of the "
                         "sampled rows only, so upgrade transformers")
    del probe_model

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    stored = checkpoint_dtype(raw) or checkpoint_dtype(raw.get("text_config") or {}) or torch.float32
    dtype = dtype or (stored if device.type == "cuda" else torch.float32)
    start = time.perf_counter()
    hf_model = _build(hf_config, root, dtype).to(device)
    pack_projections(hf_model, projection_groups)  # after .to(): it copies parameters one by one
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    if not reads_position_ids(hf_model):
        raise ValueError(f"tscompile: {name} cannot run on the transformers backend: its output does not depend on "
                         "position_ids (it numbers tokens itself, or has no position encoding), so packed rows of "
                         "several requests would be numbered as one sequence; use model_impl='native' where it "
                         "exists")
    # the modules that called attention in the probe, by layer index (the loaded model's names are the same)
    attention_modules = [hf_model.get_submodule(n) for n in attention_names]
    head = hf_model.get_output_embeddings()
    cfg = TransformersModelConfig(
        architecture=name, vocab_size=int(head.weight.shape[0]), dim=int(text.hidden_size), n_layers=shape.n_layers,
        n_heads=shape.n_heads, n_kv_heads=shape.n_kv_heads, head_dim=shape.head_dim, max_position=max_position)
    gen = root / "generation_config.json"
    info = CheckpointInfo(
        path=root, architecture=name, max_position=max_position,
        eos_token_ids=eos_token_ids(json.loads(gen.read_text()) if gen.is_file() else None, raw),
        checkpoint_dtype=stored, bytes_read=sum(p.numel() * p.element_size() for p in hf_model.parameters()),
        load_seconds=seconds)
    log.info("tscompile: %s loaded with transformers' modeling code (%d layers, %d/%d heads, head_dim %d)", name,
             cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
    return TransformersModel(hf_model, cfg, attention_modules), info

