"""``export_package``: export both steps, compile each with AOTInductor, write one ``.pt2``.

Each phase (loading the model, ``torch.export`` and the AOTInductor build of each program, writing,
the load check) is logged at INFO on the ``tscompile`` logger as it starts and with the seconds it
took when it ends; the CLI shows these lines by default.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path

import torch

from tscompile.attention import leaf_class
from tscompile.models import ModelConfig, Transformer, load_model
from tscompile.package.compiler_check import CXX_SYSTEM_RETRY, CompilerChoice, inductor_compiler
from tscompile.package.integrity import file_sha256
from tscompile.package.load_check import ensure_package_loads
from tscompile.package.programs import PROGRAMS, export_programs, program_ops
from tscompile.package.record import FORMAT_VERSION, METADATA_FILE, TOKENIZER_PREFIX, weights_path
from tscompile.runtime.scheduler import banned_width_for
from tscompile.version import __version__
from tscompile.utils import cdiv, resolve_device, resolve_dtype

logger = logging.getLogger("tscompile")


@contextlib.contextmanager
def export_phase(what: str):
    """Log ``what`` as it starts and, with its seconds, as it ends (a long export says where it is)."""
    logger.info("tscompile export: %s ...", what)
    start = time.perf_counter()
    yield
    logger.info("tscompile export: %s done in %.1f s", what, time.perf_counter() - start)


def _aoti_compile(ep, args, options: dict) -> list:
    """AOTInductor's files for one program (``aot_inductor.package``), ready for ``package_pt2``."""
    try:
        gm = ep.module(check_guards=False)
    except TypeError:  # older torch: no guards module to skip
        gm = ep.module()
    return torch._inductor.aot_compile(gm, args, {}, options={**options, "aot_inductor.package": True})


def _unique_weights(model: Transformer) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The model's parameters and buffers (KV cache buffers excepted), one entry per storage; tied
    tensors become aliases of the first name, since safetensors refuses shared storage."""
    tensors, aliases, seen = {}, {}, {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if name.endswith(("k_cache", "v_cache")):
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            tensors[name] = t.detach().contiguous()
    return tensors, aliases


def check_exportable_backend(attention_backend: str) -> None:
    """Refuse a backend whose metadata a package cannot prepare. FlashInfer plans each decode batch
    on the host (``plan()``), and a package's decode program refreshes its metadata inside the
    AOTInductor program, where no host code runs."""
    if attention_backend == "flashinfer":
        raise ValueError("tscompile: attention_backend='flashinfer' cannot be exported: a package's decode program "
                         "refreshes its metadata inside the AOTInductor program, where FlashInfer's host-side plan() "
                         "cannot run; export with attention_backend='triton', 'torch' or 'auto'")


def check_exportable_model(model) -> None:
    """A package's programs carry KV pages only: a model with recurrent-state layers (hybrid
    Qwen3-Next) has per-request state the package runtime does not allocate or schedule."""
    from tscompile.models import model_config
    from tscompile.models.qwen3_next import Qwen3NextConfig

    if isinstance(model_config(model), Qwen3NextConfig):
        raise ValueError(f"tscompile: {os.fspath(model) if isinstance(model, (str, os.PathLike)) else 'the model'} has "
                         "recurrent-state (linear-attention) layers, which packages do not carry; run it through "
                         "tscompile.LLM instead of exporting it")


def export_package(
    model: str | ModelConfig = "llama-tiny",
    out: str | os.PathLike = "model.pt2",
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    max_num_seqs: int = 8,
    max_model_len: int = 512,
    page_size: int = 16,
    pages_per_block: int = 1,
    max_num_batched_tokens: int | None = None,
    attention_backend: str = "auto",
    weights: str = "inside",
    seed: int = 0,
    inductor_configs: dict | None = None,
    verify: bool = True,
) -> dict:
    """Export the prefill and decode steps of a preset (or config) and package both into ``out``.

    ``verify`` (the default) then loads the package once in a fresh process and runs one prompt
    through it (``load_check``): a package that does not load is refused with the C++ compiler that
    built it, or rebuilt once with the system ``g++`` when the ``CXX`` environment variable chose a
    compiler whose package does not load. Returns the metadata record written into the package."""
    from tscompile.attention import default_backend_name

    if weights not in ("inside", "external"):
        raise ValueError(f"tscompile: --weights must be 'inside' or 'external', got {weights!r}")
    if not os.fspath(out).endswith(".pt2"):
        raise ValueError(f"tscompile: a package path must end in .pt2, got {os.fspath(out)!r}")
    if max_num_seqs < 1 or max_model_len < 1 or page_size < 1:  # before the load, which sizes RoPE by it
        raise ValueError(f"tscompile: bounds must be positive, got max_num_seqs {max_num_seqs}, "
                         f"max_model_len {max_model_len}, page_size {page_size}")
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    backend = default_backend_name(device) if attention_backend == "auto" else attention_backend
    check_exportable_backend(backend)
    leaf_class(backend)  # unknown or unimportable backends refuse here, before any work (the load included)
    check_exportable_model(model)
    with export_phase(f"loading {os.fspath(model) if isinstance(model, (str, os.PathLike)) else 'the model'} "
                      f"({device.type}, {str(dtype).removeprefix('torch.')})"):
        built, checkpoint = load_model(model, dtype=dtype, device=device, seed=seed, max_model_len=max_model_len)
    cfg = built.config
    tokenizer_files, eos = _tokenizer_files(checkpoint)
    if max_model_len > cfg.max_position:
        raise ValueError(f"tscompile: max_model_len {max_model_len} exceeds the model's max_position {cfg.max_position}")
    built.reset_rope(device, max_model_len)  # the package runs no position past its bound
    if max_num_batched_tokens is None:
        max_num_batched_tokens = min(2048, max_num_seqs * max_model_len)
    if max_num_batched_tokens < 4:
        raise ValueError(f"tscompile: max_num_batched_tokens must be at least 4, got {max_num_batched_tokens}")
    block_size = page_size * pages_per_block
    record = {
        "format": FORMAT_VERSION, "tscompile_version": __version__, "torch_version": torch.__version__,
        "device": device.type, "dtype": str(dtype).removeprefix("torch."),
        "model": os.fspath(model) if isinstance(model, (str, os.PathLike)) else None, "config": cfg.to_dict(),
        "cache_groups": [dict(name=s.name, layer_ids=list(s.layer_ids), num_kv_heads=s.num_kv_heads,
                              head_dim=s.head_dim, window=s.window) for s in built.cache_groups()],
        "page_size": page_size, "pages_per_block": pages_per_block,
        "max_pages": cdiv(max_model_len, page_size), "max_blocks": cdiv(max_model_len, block_size),
        "bounds": {"max_num_seqs": max_num_seqs, "max_model_len": max_model_len,
                   "max_num_batched_tokens": max_num_batched_tokens},
        "attention_backend": backend, "weights": weights, "programs": list(PROGRAMS), "seed": seed,
        "eos_token_ids": list(eos), "banned_width": banned_width_for(eos),
        "tokenizer_files": sorted(tokenizer_files),
    }
    tensors, aliases = _unique_weights(built)
    record["weight_aliases"] = aliases
    options = dict(inductor_configs or {})
    options["aot_inductor.package_constants_in_so"] = False
    if weights == "inside":
        options["aot_inductor.package_constants_on_disk_format"] = "pickle_weights"
    else:
        record["weights_file"] = weights_path(out).name
    compiler = inductor_compiler(options)
    record["compiler"] = compiler.as_record()
    start = time.perf_counter()
    programs = export_programs(built, record, device, dtype)
    record["ops"] = {name: program_ops(ep) for name, (ep, _) in programs.items()}
    files = _aoti_compile_all(programs, options)
    record["build_seconds"] = round(time.perf_counter() - start, 1)

    Path(out).parent.mkdir(parents=True, exist_ok=True)
    if weights == "external":  # written first: the record carries its size and hash for the loader's checks
        from safetensors.torch import save_file

        wpath = weights_path(out)
        save_file({k: v.cpu() for k, v in tensors.items()}, os.fspath(wpath),
                  metadata={"tscompile_package": Path(out).name})
        record["weights_bytes"] = os.path.getsize(wpath)
        record["weights_sha256"] = file_sha256(wpath)
    with export_phase(f"writing {os.fspath(out)}"):
        _write_package(out, files, record, tokenizer_files)
    if verify:
        def rebuild(cxx: str) -> CompilerChoice:
            # cpp.cxx, not CXX: Inductor read CXX once, when it was imported
            again = {**options, "cpp.cxx": (cxx,)}
            choice = inductor_compiler(again, source=CXX_SYSTEM_RETRY)
            record["compiler"] = choice.as_record()
            begin = time.perf_counter()
            logger.info("tscompile export: the package did not load; rebuilding with %s", cxx)
            rebuilt = _aoti_compile_all(programs, again)
            record["build_seconds"] = round(record["build_seconds"] + time.perf_counter() - begin, 1)
            with export_phase(f"writing {os.fspath(out)}"):
                _write_package(out, rebuilt, record, tokenizer_files)
            return choice

        with export_phase("checking that the package loads (a fresh process runs one prompt)"):
            ensure_package_loads(out, str(device), compiler, rebuild)
    return record


def _aoti_compile_all(programs: dict, options: dict) -> dict:
    """``_aoti_compile`` of every program, each one a logged phase."""
    files = {}
    for name, (ep, args) in programs.items():
        with export_phase(f"compiling the {name} program with AOTInductor"):
            files[name] = _aoti_compile(ep, args, options)
    return files


def _write_package(out, files: dict, record: dict, tokenizer_files: dict[str, str]) -> None:
    from torch.export.pt2_archive._package import package_pt2

    extra = {METADATA_FILE: json.dumps(record, indent=1)}
    extra.update({f"{TOKENIZER_PREFIX}{name}": data for name, data in tokenizer_files.items()})
    package_pt2(os.fspath(out), aoti_files=files, extra_files=extra)


def _tokenizer_files(checkpoint) -> tuple[dict[str, str], tuple[int, ...]]:
    """A checkpoint's tokenizer files (name -> text) and its end-of-sequence ids, which a package
    carries so that ``run-package --prompt`` reads and writes text; nothing for a preset."""
    if checkpoint is None:
        return {}, ()
    from tscompile.text import TOKENIZER_FILES, load_tokenizer, stop_ids_of

    names = [*TOKENIZER_FILES, "special_tokens_map.json", "added_tokens.json", "merges.txt", "chat_template.jinja"]
    files = {}
    for n in names:  # text files only: the archive's extra files are strings (tokenizer.json suffices)
        f = checkpoint.path / n
        if f.is_file():
            try:
                files[n] = f.read_text()
            except UnicodeDecodeError:
                pass
    tokenizer = load_tokenizer(checkpoint.path) if files else None
    return files, stop_ids_of(checkpoint.eos_token_ids, tokenizer)

