"""The ``tscompile`` command line: the subcommands (each in its module) and the flags they share."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand -> module exposing add_parser(subparsers) and run(args); imported only when used
COMMANDS: dict[str, str] = {
    "generate": "tscompile.generate_cli",
    "chat": "tscompile.generate_cli",
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


def prompts_from_args(args: argparse.Namespace) -> list:
    """The prompts of ``--prompt`` (text) and ``--prompt-ids`` (parsed here, so a bad one is a
    ``tscompile:`` error that ``main`` prints as one line), or the built-in id prompts."""
    texts = list(getattr(args, "prompt", None) or [])
    ids = [parse_prompt_ids(text) for text in args.prompt_ids or []]
    if not texts and not ids:
        return [list(p) for p in DEFAULT_PROMPTS]
    return texts + ids


def check_sampling_args(args: argparse.Namespace) -> None:
    """What the sampling op needs of the flags that ``SamplingParams`` passes through as they are."""
    from tscompile.validation import check_seed

    if args.sampling_seed is not None:
        check_seed("--sampling-seed", args.sampling_seed)


DEFAULT_MODEL = "llama-tiny"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                   help="the model, as --model takes it (give it here or as --model)")
    p.add_argument("--model", default=None,
                   help="a local Hugging Face checkpoint directory, a named model (smollm2-135m-instruct), or a "
                        f"preset name (llama-tiny, narrow-tiny, llama-1b, llama-8b: random weights); default "
                        f"{DEFAULT_MODEL}")
    p.add_argument("--attention-backend", default="auto",
                   help="auto (triton on CUDA, torch on the CPU), torch, triton or flashinfer")
    p.add_argument("--model-impl", choices=("auto", "native", "transformers"), default="auto",
                   help="a checkpoint's code: the engine's own model (native: Llama, Mistral, Qwen2, Qwen3), its "
                        "transformers modeling code with the paged attention (transformers: any decoder), or native "
                        "where it exists (auto)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--max-num-seqs", type=int, default=8, help="requests run at once")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt plus new tokens (default: the checkpoint's maximum; 512 for a preset)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV-cache page")
    p.add_argument("--enforce-eager", action="store_true", help="run the model without compiling (no graphs)")
    p.add_argument("--seed", type=int, default=0, help="weight seed of a preset model")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="compute every prompt whole (default: reuse the cached KV of a prompt's shared prefix)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="processes the model is split over (one GPU each on cuda; gloo on cpu)")
    p.add_argument("--speculative-method", choices=("ngram", "draft_model", "replay"), default=None,
                   help="speculative decoding (speculative_config's method; replay has no references "
                        "here, so it drafts nothing); default off")
    p.add_argument("--num-speculative-tokens", type=int, default=3, help="drafts per request per step (k)")
    p.add_argument("--draft-model", default=None, help="the draft checkpoint of --speculative-method draft_model")
    p.add_argument("--prompt-lookup-min", type=int, default=None, help="shortest n-gram the ngram method matches")
    p.add_argument("--prompt-lookup-max", type=int, default=None, help="longest n-gram the ngram method matches")


def resolve_model_arg(args: argparse.Namespace) -> None:
    """``args.model`` from the positional MODEL or ``--model`` (the default when neither is given)."""
    positional = getattr(args, "model_arg", None)
    if positional is not None and args.model is not None and positional != args.model:
        raise ValueError(f"tscompile: two models given, {positional!r} and --model {args.model!r}; give one of them")
    args.model = positional or args.model or DEFAULT_MODEL


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(attention_backend=args.attention_backend, device=args.device, dtype=args.dtype,
                max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, page_size=args.page_size,
                enforce_eager=args.enforce_eager, seed=args.seed, model_impl=args.model_impl,
                enable_prefix_caching=not args.no_prefix_caching,
                tensor_parallel_size=args.tensor_parallel_size, speculative_config=speculative_config_of(args))


def speculative_config_of(args: argparse.Namespace) -> dict | None:
    """``speculative_config`` from the speculative flags (None without ``--speculative-method``);
    the engine checks it."""
    if args.speculative_method is None:
        return None
    config = {"method": args.speculative_method, "num_speculative_tokens": args.num_speculative_tokens}
    optional = {"model": args.draft_model, "prompt_lookup_min": args.prompt_lookup_min,
                "prompt_lookup_max": args.prompt_lookup_max}
    config.update({k: v for k, v in optional.items() if v is not None})
    return config


def add_generation_args(p: argparse.ArgumentParser) -> None:
    """Prompts, sampling and output flags shared by ``generate``, ``chat`` and ``run-package``."""
    p.add_argument("--prompt", action="append", help="the text of one prompt (needs a model with a tokenizer); "
                                                       "repeat for a batch")
    p.add_argument("--prompt-ids", action="append",
                   help='token ids of one prompt, e.g. "1,2,3"; repeat for a batch (default: two built-in prompts)')
    p.add_argument("--max-new-tokens", "--max-tokens", dest="max_new_tokens", type=int, default=16,
                   help="tokens to generate at most per prompt (--max-tokens: vLLM's name)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="0: the whole vocabulary")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sampling-seed", type=int, default=None, help="seed of each request's random draws")
    p.add_argument("--min-tokens", type=int, default=0, help="no stop before this many new tokens")
    p.add_argument("--stop", action="append", default=[], help="a stop string; repeat for several")
    p.add_argument("--stop-token-ids", default=None, help='e.g. "128001,128009"')
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's end-of-sequence ids")
    p.add_argument("--show-ids", action="store_true", help="print each output's token ids and finish reason too")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def sampling_params_from_args(args: argparse.Namespace):
    import tscompile

    stop_ids = parse_prompt_ids(args.stop_token_ids) if args.stop_token_ids else ()
    return tscompile.SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                    top_k=args.top_k, top_p=args.top_p, seed=args.sampling_seed,
                                    min_tokens=args.min_tokens, stop=tuple(args.stop), stop_token_ids=stop_ids,
                                    ignore_eos=args.ignore_eos)


def print_outputs(outputs, *, text: bool, show_ids: bool) -> None:
    """One line per request: its text (``text``: the model has a tokenizer) or else its token ids;
    with ``show_ids`` and text, the ids on a second line."""
    for i, out in enumerate(outputs):
        c = out.outputs[0]
        ids = " ".join(map(str, c.token_ids))
        print(f"[{i}] {c.text if text else ids}")
        if text and show_ids:
            print(f"[{i}] ids: {ids} ({c.finish_reason})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tscompile", description="tscompile: LLM execution inside torch.compile. "
                                     "Each command takes a local Hugging Face checkpoint directory or a preset "
                                     "model name (--model), except run-package, which takes a .pt2 package.")
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
    show_tscompile_logs()
    try:
        return modules[args.command].run(args)
    except Exception as e:
        refusal = tscompile_refusal(e)
        if refusal is None:
            raise
        print(str(refusal).splitlines()[0], file=sys.stderr)
        return 2


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a line is logged (not the one at creation)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def show_tscompile_logs(level: int = logging.INFO) -> None:
    """The CLI prints tscompile's INFO lines (graph capture, ...) to stderr; the library itself
    leaves handlers to its user (``logging.getLogger("tscompile")``)."""
    log = logging.getLogger("tscompile")
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    log.setLevel(level)


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
