"""The ``tscompile`` command line: ``generate`` (and the subcommands later modules add)."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

# subcommand -> module exposing add_parser(subparsers) and run(args); imported only when used
COMMANDS: dict[str, str] = {
    "generate": "tscompile.cli",
    "bench": "tscompile.bench.cli",
    "export": "tscompile.export_cli",
    "run-package": "tscompile.export_cli",
}


def parse_prompt_ids(text: str) -> list[int]:
    """One ``--prompt-ids`` value: token ids separated by commas or by whitespace (not both), each a
    non-negative decimal int. An empty item (``"1,,2"``, a trailing comma) is refused, not skipped:
    it is more likely a lost id than a wish for a shorter prompt."""
    items = [t.strip() for t in text.split(",")] if "," in text else text.split()
    if not items:
        raise ValueError(f"tscompile: --prompt-ids takes one or more token ids such as '1,2,3', got {text!r}")
    for item in items:
        if not item:
            raise ValueError(f"tscompile: --prompt-ids has an empty item in {text!r}; separate ids by one comma")
        if item.startswith("-") and item[1:].isdigit():
            raise ValueError(f"tscompile: --prompt-ids token ids must be >= 0, got {item} in {text!r}")
        if not (item.isascii() and item.isdigit()):
            raise ValueError(f"tscompile: --prompt-ids takes non-negative integers separated by commas, "
                             f"got {item!r} in {text!r}")
    return [int(t) for t in items]


DEFAULT_PROMPTS = [[1, 15, 27, 3, 99, 42], [7, 8, 9]]


def prompts_from_args(args: argparse.Namespace) -> list[list[int]]:
    """The prompts of ``--prompt-ids`` (parsed here, so a bad one is a ``tscompile:`` error that
    ``main`` prints as one line), or the built-in ones."""
    if not args.prompt_ids:
        return [list(p) for p in DEFAULT_PROMPTS]
    return [parse_prompt_ids(text) for text in args.prompt_ids]


def check_sampling_args(args: argparse.Namespace) -> None:
    """What the sampling op needs of the flags that ``SamplingParams`` passes through as they are."""
    from tscompile.validation import check_seed

    if args.sampling_seed is not None:
        check_seed("--sampling-seed", args.sampling_seed)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-tiny", help="preset name (llama-tiny, narrow-tiny, llama-1b, llama-8b)")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--seed", type=int, default=0, help="weight seed of the preset model")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(attention_backend=args.attention_backend, device=args.device, dtype=args.dtype,
                max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, page_size=args.page_size,
                enforce_eager=args.enforce_eager, seed=args.seed)


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate token ids from a preset model")
    add_engine_args(p)
    add_generation_args(p)


def add_generation_args(p: argparse.ArgumentParser) -> None:
    """Prompts, sampling and output flags shared by ``generate`` and ``run-package``."""
    p.add_argument("--prompt-ids", action="append",
                   help='token ids of one prompt, e.g. "1,2,3"; repeat for a batch (default: two built-in prompts)')
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args: argparse.Namespace) -> int:
    import tscompile

    from tscompile.validation import validate_engine_args

    prompts = prompts_from_args(args)
    check_sampling_args(args)
    kwargs = engine_kwargs(args)
    validate_engine_args(**kwargs)  # before the sampling params or the model are built
    params = tscompile.SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                      top_k=args.top_k, top_p=args.top_p, seed=args.sampling_seed)
    llm = tscompile.LLM(args.model, **kwargs)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    if llm.device.type == "cuda":
        import torch
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    compile_s = llm.compile_seconds  # first calls compile; keep that out of the rate
    run_s = max(elapsed - compile_s, 1e-9)
    new_tokens = sum(len(o) for o in outputs)
    if args.json:
        print(json.dumps({"model": args.model, "outputs": outputs, "seconds": elapsed, "compile_seconds": compile_s,
                          "tokens_per_s": new_tokens / run_s}))
        return 0
    for i, out in enumerate(outputs):
        print(f"[{i}] {' '.join(map(str, out))}")
    print(f"{new_tokens} tokens: {new_tokens / run_s:.1f} tokens/s over {run_s:.3f} s, plus {compile_s:.1f} s "
          f"compiling ({args.model}, {llm.device.type}, {str(llm.dtype).removeprefix('torch.')}, "
          f"attention={type(llm.attention.leaves[0]).__name__})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tscompile", description="tscompile: LLM execution inside torch.compile")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, path in COMMANDS.items():
        try:
            modules[name] = importlib.import_module(path)
        except ModuleNotFoundError as e:
            if e.name != path:  # a real missing dependency inside the module, not an absent command
                raise
    for mod in dict.fromkeys(modules.values()):
        mod.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        return modules[args.command].run(args)
    except Exception as e:
        refusal = tscompile_refusal(e)
        if refusal is None:
            raise
        print(str(refusal).splitlines()[0], file=sys.stderr)
        return 2


def tscompile_refusal(exc: BaseException) -> ValueError | None:
    """The ``ValueError('tscompile: ...')`` behind ``exc``: itself, its explicit cause, or the inner
    exception torch wraps a backend's error in (``BackendCompilerFailed`` raises ``from None`` and
    keeps it as ``inner_exception``), so a refusal during the first compile is still one line."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ValueError) and str(exc).startswith("tscompile:"):
            return exc
        exc = exc.__cause__ or getattr(exc, "inner_exception", None)
    return None


if __name__ == "__main__":
    sys.exit(main())
