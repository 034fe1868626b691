"""``tscompile export`` (build a ``.pt2`` package) and ``tscompile run-package`` (generate from one)."""

from __future__ import annotations

import argparse
import json
import os
import time

from tscompile.cli import add_generation_args, check_sampling_args, prompts_from_args, print_outputs, sampling_params_from_args


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="export a model (a local checkpoint directory or a preset name) into one "
                                      ".pt2 package holding its prefill and decode programs",
                       description="Export a model into one .pt2 package (AOTInductor programs for prefill and "
                                   "decode, the weights, the tokenizer of a checkpoint) that tscompile run-package "
                                   "and tscompile.load_package run without compiling.")
    p.add_argument("--model", default="llama-tiny",
                   help="a local Hugging Face checkpoint directory, or a preset name (llama-tiny, narrow-tiny, "
                        "llama-1b, llama-8b: random weights)")
    p.add_argument("--out", required=True, help="package path, ending in .pt2")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--attention-backend", default="auto", help="auto, torch or triton (a package cannot use flashinfer)")
    p.add_argument("--max-num-seqs", type=int, default=8, help="bound of the batch dimension")
    p.add_argument("--max-model-len", type=int, default=512, help="bound of prompt plus new tokens")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="bound of the token dimension of one step (default: min(2048, seqs * len))")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV-cache page")
    p.add_argument("--weights", choices=["inside", "external"], default="inside",
                   help="inside the package, or beside it as <out>.safetensors (borrowed at load)")
    p.add_argument("--seed", type=int, default=0, help="weight seed of the preset model")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip loading the written package once in a fresh process (and the rebuild with the "
                        "system g++ when a CXX compiler's package does not load)")

    p = sub.add_parser("run-package", help="generate from a .pt2 package written by tscompile export (text "
                                           "prompts when it carries a tokenizer, token ids always)")
    p.add_argument("package", help="path of a package written by `tscompile export`")
    p.add_argument("--device", default=None, help="default: the package's device")
    add_generation_args(p)
    p.add_argument("--max-num-seqs", type=int, default=None, help="at most the packaged bound (default: it)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="at most the packaged bound")
    p.add_argument("--verbose", "-v", action="store_true", help="also print the package record, size and load time")


def run(args: argparse.Namespace) -> int:
    if args.command == "export":
        return _export(args)
    if args.command == "run-package":
        return _run_package(args)
    raise ValueError(f"tscompile: export_cli has no command {args.command!r}")


def _export(args: argparse.Namespace) -> int:
    from tscompile.export import export_package

    from tscompile.validation import validate_engine_args

    # the bounds as the engine would see them; export_package adds its own (max_position, >= 4 tokens)
    validate_engine_args(device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                         max_model_len=args.max_model_len, page_size=args.page_size, seed=args.seed)
    if args.max_num_batched_tokens is not None:
        validate_engine_args(max_num_batched_tokens=args.max_num_batched_tokens)
    start = time.perf_counter()
    record = export_package(
        args.model, args.out, device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, page_size=args.page_size,
        max_num_batched_tokens=args.max_num_batched_tokens, attention_backend=args.attention_backend,
        weights=args.weights, seed=args.seed, verify=args.verify,
    )
    size = os.path.getsize(args.out)
    extra = ""
    if record["weights"] == "external":
        wpath = os.path.join(os.path.dirname(os.path.abspath(args.out)), record["weights_file"])
        extra = f" + {wpath} ({os.path.getsize(wpath) / 2**20:.1f} MiB)"
    b = record["bounds"]
    print(f"wrote {args.out} ({size / 2**20:.1f} MiB){extra} in {time.perf_counter() - start:.1f} s: "
          f"{args.model}, {record['device']}, {record['dtype']}, attention={record['attention_backend']}, "
          f"max_num_seqs={b['max_num_seqs']}, max_model_len={b['max_model_len']}, "
          f"max_num_batched_tokens={b['max_num_batched_tokens']}, page_size={record['page_size']}; "
          f"C++ compiler {record['compiler']['path'] or record['compiler']['command']}"
          f"{'; loads (checked in a fresh process)' if args.verify else '; load not checked (--no-verify)'}")
    return 0


def _run_package(args: argparse.Namespace) -> int:
    import torch

    import tscompile

    from tscompile.validation import validate_package_args

    prompts = prompts_from_args(args)
    check_sampling_args(args)
    validate_package_args(device=args.device, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens)
    llm = tscompile.load_package(args.package, device=args.device, max_num_seqs=args.max_num_seqs,
                                 max_num_batched_tokens=args.max_num_batched_tokens)
    params = sampling_params_from_args(args)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    if llm.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    new_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    pkg = llm.package
    rec = pkg.record
    if args.json:
        out = {"package": args.package, "outputs": [o.outputs[0].token_ids for o in outputs], "seconds": elapsed,
               "tokens_per_s": new_tokens / elapsed}
        if args.verbose:
            out.update(package_bytes=pkg.package_bytes, load_seconds=pkg.load_seconds, record=rec)
        print(json.dumps(out))
        return 0
    print_outputs(outputs, text=llm.tokenizer is not None, show_ids=args.show_ids)
    if args.verbose:
        b = rec["bounds"]
        print(f"package {args.package}: {pkg.package_bytes / 2**20:.2f} MiB (weights {rec['weights']}), "
              f"loaded in {pkg.load_seconds:.3f} s")
        print(f"built with tscompile {rec['tscompile_version']}, torch {rec['torch_version']} for {rec['device']} "
              f"({rec['dtype']}); model {rec['model'] or 'custom config'}; attention={rec['attention_backend']}; "
              f"page_size={rec['page_size']}; bounds: max_num_seqs={b['max_num_seqs']}, "
              f"max_model_len={b['max_model_len']}, max_num_batched_tokens={b['max_num_batched_tokens']}")
    print(f"{new_tokens} tokens in {elapsed:.3f} s: {new_tokens / elapsed:.1f} tokens/s")
    return 0
