"""``tscompile generate`` (prompts in, text or token ids out) and ``tscompile chat`` (an interactive
loop over the checkpoint's chat template, replies streamed)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from tscompile.cli import (add_engine_args, add_generation_args, check_sampling_args, engine_kwargs, print_outputs,
                           prompts_from_args, resolve_model_arg, sampling_params_from_args)


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate from a local checkpoint directory or a preset model: text "
                                        "prompts (--prompt) or token ids (--prompt-ids) in, text or ids out")
    add_engine_args(p)
    add_generation_args(p)
    p.add_argument("--chat", action="store_true", help="each --prompt is a user message, rendered with the "
                                                       "checkpoint's chat template")
    p.add_argument("--stream", action="store_true", help="print the text of one prompt as it is produced (with "
                                                         "--show-ids, its token ids after it)")

    p = sub.add_parser("chat", help="an interactive chat with a local checkpoint directory that has a chat "
                                    "template: one user message per line, replies streamed, an empty line ends")
    add_engine_args(p)
    add_generation_args(p)
    p.add_argument("--system", default=None, help="a system message opening the conversation")


def _build(args: argparse.Namespace):
    import tscompile
    from tscompile.validation import validate_engine_args

    check_sampling_args(args)
    kwargs = engine_kwargs(args)
    validate_engine_args(**kwargs)  # before the sampling params or the model are built
    params = sampling_params_from_args(args)
    return tscompile.LLM(args.model, **kwargs), params


def run(args: argparse.Namespace) -> int:
    resolve_model_arg(args)
    if args.command == "chat":
        return _chat(args)
    prompts = prompts_from_args(args)
    llm, params = _build(args)
    if args.chat:
        from tscompile.text import apply_chat_template

        prompts = [{"prompt_token_ids": apply_chat_template(llm.tokenizer, [{"role": "user", "content": p}])}
                   for p in prompts]
    if args.stream:
        if len(prompts) != 1:
            raise ValueError(f"tscompile: --stream prints one prompt's text, got {len(prompts)} prompts")
        if args.show_ids:
            return _stream_with_ids(llm, prompts[0], params)
        for delta in llm.stream(prompts[0], params):
            print(delta, end="", flush=True)
        print()
        return 0
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    compile_s = llm.compile_seconds  # first calls compile; keep that out of the rate
    run_s = max(elapsed - compile_s, 1e-9)
    new_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    if args.json:
        print(json.dumps({"model": str(args.model), "seconds": elapsed, "compile_seconds": compile_s,
                          "tokens_per_s": new_tokens / run_s,
                          "outputs": [{"text": o.outputs[0].text, "token_ids": o.outputs[0].token_ids,
                                       "finish_reason": o.outputs[0].finish_reason} for o in outputs]}))
        return 0
    print_outputs(outputs, text=llm.tokenizer is not None, show_ids=args.show_ids)
    print(f"{new_tokens} tokens: {new_tokens / run_s:.1f} tokens/s over {run_s:.3f} s, plus {compile_s:.1f} s "
          f"compiling ({args.model}, {llm.device.type}, {str(llm.dtype).removeprefix('torch.')}, "
          f"attention={type(llm.attention.leaves[0]).__name__})")
    return 0


def _stream_with_ids(llm, prompt, params) -> int:
    """``--stream --show-ids``: the text as it is produced (as ``LLM.stream`` gives it), then the
    request's token ids and finish reason on a line of their own (``ids: 1 2 3 (stop)``). Without a
    tokenizer there is no text: each id is printed as it is read back."""
    req = llm.add_request(prompt, params)
    shown_text = shown_ids = 0
    try:
        while not req.completion.finished:
            llm.step()
            if llm.tokenizer is None:
                for t in req.completion.token_ids[shown_ids:]:
                    print(f"{' ' if shown_ids else ''}{t}", end="", flush=True)
                    shown_ids += 1
            text = req.completion.settled_text
            print(text[shown_text:], end="", flush=True)
            shown_text = max(shown_text, len(text))
        llm.sync()
    finally:
        if not req.completion.finished:  # interrupted: the request must not outlive the command
            try:
                llm.sync()
            finally:
                llm.abort(req.rid)
    out = req.completion.output()
    if llm.tokenizer is None:
        print("".join(f"{' ' if shown_ids + i else ''}{t}" for i, t in enumerate(out.token_ids[shown_ids:])))
    else:
        print(out.text[shown_text:])
    print(f"ids: {' '.join(map(str, out.token_ids))} ({out.finish_reason})")
    return 0


def _chat(args: argparse.Namespace) -> int:
    """Read a user line, stream the reply, keep the conversation; an empty line or EOF ends it."""
    llm, params = _build(args)
    if llm.tokenizer is None or not getattr(llm.tokenizer, "chat_template", None):
        raise ValueError(f"tscompile: chat needs a checkpoint whose tokenizer has a chat template; {args.model!r} "
                         "has none (use tscompile generate)")
    from tscompile.text import apply_chat_template

    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or not line.strip():
            return 0
        messages.append({"role": "user", "content": line.rstrip("\n")})
        prompt = {"prompt_token_ids": apply_chat_template(llm.tokenizer, messages)}
        reply = ""
        for delta in llm.stream(prompt, params):
            reply += delta
            print(delta, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": reply})
