"""Load a local Hugging Face checkpoint directory into the native ``Transformer``.

A directory holds ``config.json``, ``model.safetensors`` (or shards named by
``model.safetensors.index.json``) and optionally ``generation_config.json``. Nothing is downloaded.

Every tensor's name and shape is checked against the native model before any weight is read, and all
mismatches are reported together. The model is built on the ``meta`` device and materialised empty on the
target device in the target dtype; each tensor is then read from its memory-mapped file and copied (cast
and moved in one ``copy_``) into its place, so q/k/v are fused into ``wqkv`` and gate/up into ``w13`` as
they load and the host never holds more than one tensor of the checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

try:
    from safetensors import SafetensorError
except ImportError:  # older safetensors do not export it: any failure to open a file is then the file's
    SafetensorError = Exception
from tqdm import tqdm

from tscompile.models.hf_config import architecture_of, check_sliding_window, checkpoint_dtype, eos_token_ids, \
    read_json_object
from tscompile.models.llama import PRESETS, ModelConfig, Transformer
from tscompile.models.parallel import ShardLayout, TensorParallel
from tscompile.models.qwen3_next_checkpoint import native_config_from_hf

_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


@dataclass(frozen=True)
class CheckpointInfo:
    """What the caller needs besides the model: tokenizer directory, stop ids, load throughput."""

    path: Path  # the checkpoint directory (the tokenizer files live here too)
    architecture: str  # e.g. "LlamaForCausalLM"
    max_position: int  # config.json's max_position_embeddings
    eos_token_ids: tuple[int, ...]  # generation_config.json's, then config.json's, duplicates dropped
    checkpoint_dtype: torch.dtype  # the dtype the weights are stored in
    bytes_read: int  # tensor bytes read from the safetensors files
    load_seconds: float  # wall time of reading and placing the tensors

    @property
    def gb_per_s(self) -> float:
        return self.bytes_read / 1e9 / self.load_seconds if self.load_seconds > 0 else float("inf")


@dataclass(frozen=True)
class _Target:
    """Rows ``[start, stop)`` of a native parameter that one checkpoint tensor fills; ``source``
    (dim, start, stop): the slice of the stored tensor read (a tensor-parallel rank's share), or None
    for the whole tensor; ``rows``: where a native layout orders the rows otherwise, the row of
    ``[start, stop)`` (counted from ``start``) that each stored row lands in."""

    param: str
    start: int
    stop: int
    source: tuple[int, int, int] | None = None
    rows: tuple[int, ...] | None = None


def is_checkpoint_dir(x) -> bool:
    """True when ``x`` (a str or path) names an existing local directory."""
    return isinstance(x, (str, os.PathLike)) and os.path.isdir(x)


def checkpoint_root(path) -> Path:
    """``path`` as a checkpoint directory holding a config.json, or a refusal that lists what a model may be."""
    if not is_checkpoint_dir(path):
        from tscompile.models.demo import NAMED_MODELS

        raise ValueError(f"tscompile: unknown model preset {str(path)!r} and no such directory; known presets: "
                         f"{', '.join(PRESETS)}; named models (trained weights, fetched once): "
                         f"{', '.join(NAMED_MODELS)}; or pass a local checkpoint directory (config.json + *.safetensors). "
                         "Hub ids are not downloaded: download the checkpoint first and pass its directory")
    root = Path(path)
    if not (root / "config.json").is_file():
        raise ValueError(f"tscompile: checkpoint directory {str(root)!r} has no config.json")
    return root


def _read_json(path: Path) -> dict | None:
    return read_json_object(path) if path.is_file() else None


@contextlib.contextmanager
def open_safetensors(file: Path):
    """``safe_open`` of one checkpoint file; a truncated or garbage file (its header or its size
    wrong) is refused naming the file."""
    try:
        handle = safe_open(file, framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"tscompile: {str(file)!r} is not a readable safetensors file ({e}); the checkpoint is "
                         "damaged (a truncated or interrupted download?): write or download that file again") from None
    with handle as f:
        yield f


def tensor_files(root: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file holding it."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"tscompile: {str(index)!r} has no \"weight_map\" of tensor names to file names; the "
                             "checkpoint is damaged: write or download that file again")
        files = {name: root / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise ValueError(f"tscompile: shard {file.name!r} named by {index.name} is missing from {str(root)!r}")
        return files
    single = root / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"tscompile: {str(root)!r} has neither model.safetensors nor model.safetensors.index.json")
    with open_safetensors(single) as f:
        return {name: single for name in f.keys()}


def stored_shapes(files: dict[str, Path]) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Shapes and safetensors dtype names of every stored tensor, read from the file headers only."""
    shapes, dtypes = {}, {}
    for file in sorted(set(files.values())):
        with open_safetensors(file) as f:
            for name in f.keys():
                if files.get(name) == file:
                    sl = f.get_slice(name)
                    shapes[name], dtypes[name] = tuple(sl.get_shape()), sl.get_dtype()
    return shapes, dtypes


def native_model(cfg: ModelConfig, tp: TensorParallel | None = None) -> Transformer:
    """The native model class of ``cfg``'s family, built (on the current default device)."""
    from tscompile.models.qwen3_next import Qwen3NextConfig, Qwen3NextTransformer

    return Qwen3NextTransformer(cfg, tp) if isinstance(cfg, Qwen3NextConfig) else Transformer(cfg, tp)


def weight_plan(cfg: ModelConfig) -> dict[str, _Target]:
    """Checkpoint tensor name -> where it lands in the native model (the weight names every supported
    architecture shares). Fused parameters get one entry per part: wqkv = [q; k; v], w13 = [gate; up]."""
    from tscompile.models.qwen3_next import Qwen3NextConfig

    if isinstance(cfg, Qwen3NextConfig):
        from tscompile.models.qwen3_next_checkpoint import qwen3_next_weight_plan

        return qwen3_next_weight_plan(cfg, _Target)
    q, kv, inter = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.intermediate_size
    plan = {
        "model.embed_tokens.weight": _Target("tok_embeddings.weight", 0, cfg.vocab_size),
        "model.norm.weight": _Target("norm.weight", 0, cfg.dim),
    }
    if not cfg.tie_embeddings:
        plan["lm_head.weight"] = _Target("output.weight", 0, cfg.vocab_size)
    qkv_rows = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
    for i in range(cfg.n_layers):
        hf, nat = f"model.layers.{i}.", f"layers.{i}."
        for proj, (start, stop) in qkv_rows.items():
            for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
                plan[f"{hf}self_attn.{proj}.{kind}"] = _Target(f"{nat}attention.wqkv.{kind}", start, stop)
        plan[f"{hf}self_attn.o_proj.weight"] = _Target(f"{nat}attention.wo.weight", 0, cfg.dim)
        if cfg.qk_norm:
            plan[f"{hf}self_attn.q_norm.weight"] = _Target(f"{nat}attention.q_norm.weight", 0, cfg.head_dim)
            plan[f"{hf}self_attn.k_norm.weight"] = _Target(f"{nat}attention.k_norm.weight", 0, cfg.head_dim)
        plan[f"{hf}mlp.gate_proj.weight"] = _Target(f"{nat}feed_forward.w13.weight", 0, inter)
        plan[f"{hf}mlp.up_proj.weight"] = _Target(f"{nat}feed_forward.w13.weight", inter, 2 * inter)
        plan[f"{hf}mlp.down_proj.weight"] = _Target(f"{nat}feed_forward.w2.weight", 0, cfg.dim)
        plan[f"{hf}input_layernorm.weight"] = _Target(f"{nat}attention_norm.weight", 0, cfg.dim)
        plan[f"{hf}post_attention_layernorm.weight"] = _Target(f"{nat}ffn_norm.weight", 0, cfg.dim)
    return plan


def sharded_weight_plan(layout: ShardLayout) -> dict[str, _Target]:
    """``weight_plan`` for one tensor-parallel rank: each sharded tensor names the slice of it the rank
    reads and where that lands in the rank's (smaller) parameter; replicated tensors (norms) read whole.
    The same split as ``ShardLayout.shard`` of the native parameters."""
    cfg, local = layout.config, layout.local_config()
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    q_local, kv_local, inter_local = len(layout.q_rows), len(layout.kv_rows), len(layout.mlp_rows)

    def rows(r: range, dim: int = 0) -> tuple[int, int, int]:
        return (dim, r.start, r.stop)

    plan = {}
    for name, t in weight_plan(cfg).items():
        param = t.param
        if param.endswith("attention.wqkv.weight") or param.endswith("attention.wqkv.bias"):
            part = {0: (0, layout.q_rows), q: (q_local, layout.kv_rows), q + kv: (q_local + kv_local, layout.kv_rows)}
            start, src = part[t.start]
            plan[name] = _Target(param, start, start + len(src), rows(src))
        elif param.endswith("attention.wo.weight"):
            plan[name] = _Target(param, 0, local.dim, rows(layout.q_rows, dim=1))
        elif param.endswith("feed_forward.w13.weight"):
            start = 0 if t.start == 0 else inter_local
            plan[name] = _Target(param, start, start + inter_local, rows(layout.mlp_rows))
        elif param.endswith("feed_forward.w2.weight"):
            plan[name] = _Target(param, 0, local.dim, rows(layout.mlp_rows, dim=1))
        elif param in ("tok_embeddings.weight", "output.weight"):  # the padding rows past the vocabulary stay zero
            plan[name] = _Target(param, 0, len(layout.vocab_rows), rows(layout.vocab_rows))
        else:
            plan[name] = t
    return plan


def _redundant(name: str, cfg: ModelConfig) -> bool:
    """Stored tensors that carry nothing the model needs: RoPE tables (recomputed from the config) and a
    tied head (transformers ties it to the embedding, so the stored copy is the embedding)."""
    # mtp.*: Qwen3-Next's multi-token-prediction head, which transformers does not load either
    return (name.endswith(".rotary_emb.inv_freq") or (cfg.tie_embeddings and name == "lm_head.weight")
            or name.startswith("mtp."))


def check_tensors(plan: dict[str, _Target], params: dict[str, torch.Tensor], found: dict[str, tuple[int, ...]],
                  cfg: ModelConfig, where: str) -> None:
    """Refuse missing, unexpected and wrongly shaped tensors, all of them in one message."""
    def expected(target: _Target) -> tuple[int, ...]:
        return (target.stop - target.start, *params[target.param].shape[1:])

    problems = []
    for name, target in plan.items():
        if name not in found:
            hint = " (a checkpoint may omit it only with tie_word_embeddings: true)" if name == "lm_head.weight" else ""
            problems.append(f"missing tensor {name}: expected shape {expected(target)}, found none{hint}")
        elif found[name] != expected(target):
            problems.append(f"tensor {name}: expected shape {expected(target)}, found {found[name]}")
    for name, shape in found.items():
        if name in plan:
            continue
        if name == "lm_head.weight" and cfg.tie_embeddings:
            want = (cfg.vocab_size, cfg.dim)
            if shape != want:
                problems.append(f"tensor {name}: expected shape {want}, found {shape}")
        elif not _redundant(name, cfg):
            problems.append(f"unexpected tensor {name}: expected none, found shape {shape}")
    if problems:
        shown = "\n  ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise ValueError(f"tscompile: checkpoint {where} does not match its config ({len(problems)} problems):\n  "
                         f"{shown}")


def empty_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                rope_positions: int | None = None, tp: TensorParallel | None = None) -> Transformer:
    """An uninitialised model in ``dtype`` on ``device`` (``tp``: a tensor-parallel rank's shard of
    it); no host copy of the weights is ever made. ``rope_positions``: rows of its RoPE tables
    (``Transformer.reset_rope``)."""
    with torch.device("meta"):
        model = native_model(cfg, tp)
    model = model.to(dtype=dtype).to_empty(device=device)
    if cfg.tie_embeddings:  # to_empty gives each module its own tensor, which unties them
        model.output.weight = model.tok_embeddings.weight
    model.reset_rope(device, rope_positions)  # RoPE stays float32 in any dtype
    return model.eval()


def fill_weights(model: Transformer, plan: dict[str, _Target], files: dict[str, Path]) -> int:
    """Copy every planned tensor (or its planned slice) into place, file by file; returns the bytes
    read. Rows no tensor fills (a tensor-parallel rank's vocabulary padding) are zeroed."""
    params = dict(model.named_parameters())
    covered = {}
    for target in plan.values():
        covered[target.param] = covered.get(target.param, 0) + target.stop - target.start
    assert covered.keys() == params.keys() and all(covered[n] <= p.shape[0] for n, p in params.items()), \
        "the plan must fill every parameter"
    with torch.no_grad():
        for n, p in params.items():
            if covered[n] < p.shape[0]:
                p[covered[n]:].zero_()
    by_file: dict[Path, list[str]] = {}
    for name in plan:
        by_file.setdefault(files[name], []).append(name)
    read = 0
    with torch.no_grad(), tqdm(total=len(plan), desc="loading checkpoint", unit="tensor", disable=None) as bar:
        for file, names in by_file.items():
            with open_safetensors(file) as f:
                for name in names:
                    target = plan[name]
                    src = _read_slice(f, name, target.source)
                    dest = params[target.param][target.start:target.stop]
                    if target.rows is None:
                        dest.copy_(src)
                    else:
                        dest[torch.tensor(target.rows, device=dest.device)] = src.to(dest.device, dest.dtype)
                    read += src.numel() * src.element_size()
                    bar.update()
    return read


def _read_slice(f, name: str, source: tuple[int, int, int] | None) -> torch.Tensor:
    """The stored tensor ``name``, or only its rows (dim 0) / columns (dim 1) ``[start, stop)``: a
    safetensors slice reads those bytes alone."""
    if source is None:
        return f.get_tensor(name)
    dim, start, stop = source
    stored = f.get_slice(name)
    return stored[start:stop] if dim == 0 else stored[:, start:stop]


def load_checkpoint(path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None, max_model_len: int | None = None,
                    tp: TensorParallel | None = None) -> tuple[Transformer, CheckpointInfo]:
    """The native model of a local checkpoint directory, and what else the engine needs from it.

    ``dtype`` defaults to the checkpoint's own on CUDA and float32 on CPU. ``max_model_len`` (default: the
    config's max_position_embeddings) is the longest sequence the caller will run: an active sliding
    window shorter than that is refused, since attention here is always full, and the RoPE tables
    hold that many positions. ``tp``: load only this tensor-parallel rank's shard, reading only its
    slices of the sharded tensors."""
    root = checkpoint_root(path)
    raw = read_json_object(root / "config.json")
    architecture, _ = architecture_of(raw)
    cfg = native_config_from_hf(raw)
    check_sliding_window(raw, cfg.max_position if max_model_len is None else max_model_len)
    files = tensor_files(root)
    found, stored_dtypes = stored_shapes(files)
    plan = weight_plan(cfg)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    stored = checkpoint_dtype(raw) or _SAFETENSORS_DTYPES.get(stored_dtypes.get("model.embed_tokens.weight"),
                                                              torch.float32)
    dtype = dtype or (stored if device.type == "cuda" else torch.float32)
    with torch.device("meta"):
        params = dict(native_model(cfg).named_parameters())
    check_tensors(plan, params, found, cfg, repr(str(root)))

    # a max_model_len above max_position is the engine's to refuse, with its own message
    rope_positions = None if max_model_len is None else min(max_model_len, cfg.max_position)
    model = empty_model(cfg, dtype, device, rope_positions=rope_positions, tp=tp)
    if tp is not None:
        plan = sharded_weight_plan(ShardLayout(cfg, tp.rank, tp.size))
    start = time.perf_counter()
    bytes_read = fill_weights(model, plan, files)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    info = CheckpointInfo(
        path=root, architecture=architecture, max_position=cfg.max_position,
        eos_token_ids=eos_token_ids(_read_json(root / "generation_config.json"), raw),
        checkpoint_dtype=stored, bytes_read=bytes_read, load_seconds=seconds,
    )
    return model, info
