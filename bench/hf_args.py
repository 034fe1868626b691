"""The ``--hf-*`` arguments of ``tscompile bench --hf-model`` (bench/hf_model.py): the modes and parts
it knows, the model it is given (a checkpoint directory or a preset), and the defaults that depend on
the device; every refusal before a model loads."""

from __future__ import annotations

import argparse
import os

import torch

from .hf_presets import hf_presets

HF_MODES = ("eager", "compile-default", "compile-reduce-overhead", "tscompile", "tscompile-split")  # in run order
HF_PARTS = ("forward", "generate", "stream")
DEFAULT_PARTS = ("forward", "generate")  # the stream is asked for: it takes minutes per mode
# Inductor's CUDA-graph trees run a new size once without a graph and record it on the next call:
# two warm-ups per length, so the timed calls replay
MIN_WARMUPS = 2


def check_model_spec(spec: str) -> str:
    """``"preset"`` or ``"checkpoint"``; refuses a directory without config.json and an unknown name."""
    if os.path.isdir(spec):
        if not os.path.isfile(os.path.join(spec, "config.json")):
            raise ValueError(f"tscompile: --hf-model {spec!r} is a directory without config.json; give a "
                             f"transformers checkpoint directory or a preset ({', '.join(hf_presets())})")
        return "checkpoint"
    if spec not in hf_presets():
        raise ValueError(f"tscompile: --hf-model {spec!r} is neither a checkpoint directory nor a preset; "
                         f"presets: {', '.join(hf_presets())}")
    return "preset"


def resolve_modes(requested: list[str] | None) -> list[str]:
    """The modes to run, in ``HF_MODES`` order; eager always runs first (the tokens and logits
    columns compare every mode with it)."""
    if not requested:
        return list(HF_MODES)
    unknown = [m for m in requested if m not in HF_MODES]
    if unknown:
        raise ValueError(f"tscompile: unknown --hf-modes {unknown}; allowed: {', '.join(HF_MODES)}")
    return [m for m in HF_MODES if m in requested or m == "eager"]


def resolve_parts(requested: list[str] | None) -> list[str]:
    if not requested:
        return list(DEFAULT_PARTS)
    unknown = [p for p in requested if p not in HF_PARTS]
    if unknown:
        raise ValueError(f"tscompile: unknown --hf-parts {unknown}; allowed: {', '.join(HF_PARTS)}")
    return [p for p in HF_PARTS if p in requested]


def fill_defaults(args: argparse.Namespace) -> torch.device:
    """Checks the ``--hf-*`` arguments and fills their device-dependent defaults; returns the device."""
    from tscompile.utils import resolve_device, resolve_dtype

    if getattr(args, "modes", None):
        raise ValueError(f"tscompile: --modes {args.modes} picks the engine bench's modes; with --hf-model use "
                         f"--hf-modes ({', '.join(HF_MODES)})")
    args.hf_model_kind = check_model_spec(args.hf_model)
    device = resolve_device(args.device)
    args.device = str(device)
    gpu = device.type == "cuda"
    args.dtype = str(resolve_dtype(args.dtype, device)).removeprefix("torch.")
    args.hf_requested = list(args.hf_modes or HF_MODES)  # eager runs unasked; the exit status ignores it then
    args.hf_modes = resolve_modes(args.hf_modes)
    args.hf_parts = resolve_parts(getattr(args, "hf_parts", None))
    args.hf_lens = args.hf_lens or ([32, 512, 2048] if gpu else [16, 40])
    bad = [n for n in args.hf_lens if n < 1]
    if bad:
        raise ValueError(f"tscompile: --hf-lens {args.hf_lens} has lengths < 1 ({bad}); give prompt lengths >= 1")
    args.hf_generate_tokens = args.hf_generate_tokens if args.hf_generate_tokens is not None else (64 if gpu else 16)
    if args.hf_generate_tokens < 1:
        raise ValueError(f"tscompile: --hf-generate-tokens {args.hf_generate_tokens} must be >= 1")
    args.hf_stream_prompts = args.hf_stream_prompts if args.hf_stream_prompts is not None else (200 if gpu else 6)
    lo, hi = args.hf_stream_lens = args.hf_stream_lens or ([17, 2048] if gpu else [17, 64])
    if not 1 <= lo <= hi or hi - lo + 1 < args.hf_stream_prompts or args.hf_stream_prompts < 1:
        raise ValueError(f"tscompile: --hf-stream-prompts {args.hf_stream_prompts} distinct lengths do not fit "
                         f"--hf-stream-lens {lo} {hi}; give 1 <= LO <= HI with at least that many lengths between")
    args.use_cache = bool(getattr(args, "hf_use_cache", False))
    args.num_iters = args.num_iters if args.num_iters is not None else (5 if gpu else 2)
    if args.num_iters < 1:
        raise ValueError(f"tscompile: --num-iters {args.num_iters} must be >= 1")
    args.hf_warmups = max(args.num_iters_warmup, MIN_WARMUPS)
    return device


def check_hf_flags_unused(args: argparse.Namespace) -> None:
    """The engine bench refuses ``--hf-*`` flags given without ``--hf-model`` (they would do nothing)."""
    given = [f"--{k.replace('_', '-')}" for k in ("hf_lens", "hf_generate_tokens", "hf_modes", "hf_parts",
                                                  "hf_stream_prompts", "hf_stream_lens")
             if getattr(args, k, None) is not None]
    if getattr(args, "hf_use_cache", False):
        given.append("--hf-use-cache")
    if given:
        raise ValueError(f"tscompile: {', '.join(given)} need --hf-model (a checkpoint directory or a preset)")
