"""``tscompile bench --speculative ngram``: speculative decoding against plain decode, one engine per
k (``--num-speculative-tokens``, a list) over the same model and prompts.

Prompts repeat a random block (``--spec-block`` tokens, ``--spec-repeats`` times), so the n-gram
drafter finds drafts. Each engine runs the batch once unmeasured (compiles, captures), then
measured. Per row (k = 0 is plain decode, N = k + 1): the mean time of a decode step (a verify step
with speculation; each timed with the device synchronized), output tokens per request and decode step, output
tokens/s over the wall time and its ratio to plain decode, the acceptance rate, and whether the
greedy outputs equal plain decode's.
"""

from __future__ import annotations

import argparse
import time

import torch

from tscompile.utils import resolve_device, resolve_dtype

from . import report
from .workloads import Timer


def repetitive_prompts(seed: int, vocab: int, num_requests: int, block: int, repeats: int) -> list[list[int]]:
    rng = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (block,), generator=rng).tolist() * repeats for _ in range(num_requests)]


def _run(llm, prompts: list[list[int]], output_len: int, device: torch.device) -> dict:
    from tscompile import SamplingParams

    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    reqs = [llm.add_request(p, params) for p in prompts]
    sched = llm.scheduler
    decode_s, decode_steps, decode_tokens = 0.0, 0, 0
    start = time.perf_counter()
    while llm.has_unfinished():
        decoding = not sched.waiting and all(r.prefill_done for r in sched.running)
        if decoding:
            before = sum(len(r.output) for r in reqs)
            with Timer(device) as t:
                llm.step()
            llm.sync()
            decode_s += t.seconds
            decode_steps += 1
            decode_tokens += sum(len(r.output) for r in reqs) - before
        else:
            llm.step()
    llm.sync()
    wall = time.perf_counter() - start
    return {"wall_s": wall, "decode_step_ms": decode_s / max(decode_steps, 1) * 1e3, "decode_steps": decode_steps,
            "tokens_per_step": decode_tokens / max(decode_steps, 1) / len(reqs),
            "output_tokens_per_s": sum(len(r.output) for r in reqs) / wall, "outputs": [list(r.output) for r in reqs]}


def markdown(result: dict) -> str:
    lines = [f"## Speculative decoding ({result['method']}): {result['model']}, {result['device']}, {result['dtype']}",
             "", result["shape"], "",
             "| k | N | decode step ms | tokens/step/request | output tok/s | vs plain | acceptance | outputs equal |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['k']} | {r['k'] + 1} | {r['decode_step_ms']:.2f} | {r['tokens_per_step']:.2f} | "
                     f"{r['output_tokens_per_s']:.0f} | {r['ratio_to_plain']:.2f}x | {r['acceptance_rate']:.1%} | "
                     f"{r['outputs_equal']} |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    import tscompile
    from tscompile.models import build_model

    device = resolve_device(args.device)
    gpu = device.type == "cuda"
    dtype = resolve_dtype(args.dtype, device)
    ks = [int(k) for k in str(args.num_speculative_tokens).split(",")]
    requests = args.spec_requests or (8 if gpu else 2)
    output_len = args.output_len or (128 if gpu else 16)
    model = build_model(args.model, dtype=dtype, device=device, seed=args.seed)
    prompts = repetitive_prompts(args.seed, model.config.vocab_size, requests, args.spec_block, args.spec_repeats)
    page = args.page_size
    longest = args.spec_block * args.spec_repeats + output_len
    rows, plain = [], None
    for k in [0, *ks]:
        spec = None if k == 0 else {"method": args.speculative, "num_speculative_tokens": k}
        llm = tscompile.LLM(model, attention_backend=(args.attention_backends or ["auto"])[0], device=device,
                            dtype=dtype, max_num_seqs=requests, max_model_len=-(-longest // page) * page,
                            page_size=page, seed=args.seed, compile_options=args.tscompile_options,
                            speculative_config=spec)
        _run(llm, prompts, output_len, device)  # warm-up: compiles and graph captures
        before = llm.stats()
        row = _run(llm, prompts, output_len, device)
        after = llm.stats()
        drafts = after.spec_draft_tokens - before.spec_draft_tokens
        row.update(k=k, acceptance_rate=(after.spec_accepted_tokens - before.spec_accepted_tokens) / drafts
                   if drafts else 0.0)
        outputs = row.pop("outputs")
        if plain is None:
            plain = (outputs, row["output_tokens_per_s"])
        row.update(outputs_equal=outputs == plain[0], ratio_to_plain=row["output_tokens_per_s"] / plain[1])
        rows.append(row)
        del llm
    shape = (f"{requests} requests, a {args.spec_block}-token block repeated {args.spec_repeats} times, "
             f"{output_len} greedy tokens each")
    result = {"method": args.speculative, "model": args.model, "device": str(device),
              "dtype": str(dtype).removeprefix("torch."), "shape": shape, "rows": rows,
              "args": {k: v for k, v in vars(args).items() if not callable(v)}}
    md = markdown(result)
    report.write_outputs(result, md, args)
    print(md)
    return 0
