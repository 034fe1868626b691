"""``tscompile bench --prefix-workload shared|chat``: what prefix caching saves, caching on and off in
one run on one engine (its compiled graphs serve both; switching caching off forgets the cache).

- ``shared``: ``--prefix-requests`` requests (default 32; 4 on the CPU) submitted together, each a
  ``--prefix-len``-token shared prefix (2048; 64) and ``--prefix-suffix-len`` tokens of its own (64; 8).
- ``chat``: a multi-turn chat replay: ``--prefix-requests`` chats opening with the shared prefix (a
  system prompt), ``--chat-turns`` turns (4; 2), each turn's prompt the whole history so far (the
  previous turns' prompts and the model's own replies) plus a new ``--prefix-suffix-len``-token user
  message; each turn's chats are submitted together once the previous turn finished.

Each setting runs once unmeasured (compiles and graph captures), then measured from an empty cache.
Per setting: mean and median TTFT (submit to the first token read back on the host, per request),
the total prefill time (the steps that carry prompt rows, each timed with the device synchronized
before and after, summed), the wall time, token throughput and the prefix-cache hit rate.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tscompile.utils import resolve_device, resolve_dtype

from . import environment, report
from .report import machine_line
from .workloads import Timer

PREFIX_WORKLOADS = ("shared", "chat")


def _tokens(rng: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=rng).tolist()


def shared_prefix_prompts(seed: int, vocab: int, num_requests: int, prefix_len: int, suffix_len: int) -> list[list[int]]:
    """``num_requests`` prompts: one random prefix, then each its own random suffix."""
    rng = torch.Generator().manual_seed(seed)
    prefix = _tokens(rng, prefix_len, vocab)
    return [prefix + _tokens(rng, suffix_len, vocab) for _ in range(num_requests)]


def chat_user_turns(seed: int, vocab: int, num_chats: int, turns: int, system_len: int,
                    user_len: int) -> tuple[list[int], list[list[list[int]]]]:
    """The shared system prompt and, per chat, its users' messages (one per turn)."""
    rng = torch.Generator().manual_seed(seed + 1)
    system = _tokens(rng, system_len, vocab)
    return system, [[_tokens(rng, user_len, vocab) for _ in range(turns)] for _ in range(num_chats)]


def _fill_defaults(args: argparse.Namespace, gpu: bool) -> None:
    defaults = {"prefix_requests": (32, 4), "prefix_len": (2048, 64), "prefix_suffix_len": (64, 8),
                "chat_turns": (4, 2), "output_len": (64, 4)}
    for name, (on_gpu, on_cpu) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, on_gpu if gpu else on_cpu)
        if getattr(args, name) < 1:
            raise ValueError(f"tscompile: --{name.replace('_', '-')} {getattr(args, name)} must be >= 1")


def _run_batch(llm, prompts: list[list[int]], output_len: int, device: torch.device) -> dict:
    """Submit ``prompts`` together and step until done: per-request TTFT, prefill and wall time."""
    params = llm_params(output_len)
    sched = llm.scheduler
    start = time.perf_counter()
    reqs = [llm.add_request(p, params) for p in prompts]
    ttft: dict[int, float] = {}
    prefill_s = 0.0
    while llm.has_unfinished():
        carries_prompt = bool(sched.waiting) or any(not r.prefill_done for r in sched.running)
        if carries_prompt:
            with Timer(device) as t:
                llm.step()
            prefill_s += t.seconds
        else:
            llm.step()
        now = time.perf_counter()
        for r in reqs:
            if r.rid not in ttft and r.output:
                ttft[r.rid] = now - start
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return {"ttft_s": [ttft[r.rid] for r in reqs], "prefill_s": prefill_s, "wall_s": wall,
            "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(len(r.output) for r in reqs),
            "outputs": [list(r.output) for r in reqs]}


def llm_params(output_len: int):
    from tscompile import SamplingParams

    return SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)


def run_workload(llm, workload: str, args: argparse.Namespace, vocab: int, device: torch.device) -> dict:
    """One pass of ``workload``: its batches' figures summed (TTFT per request over every batch)."""
    batches = []
    if workload == "shared":
        prompts = shared_prefix_prompts(args.seed, vocab, args.prefix_requests, args.prefix_len, args.prefix_suffix_len)
        batches.append(_run_batch(llm, prompts, args.output_len, device))
    else:
        system, users = chat_user_turns(args.seed, vocab, args.prefix_requests, args.chat_turns, args.prefix_len,
                                        args.prefix_suffix_len)
        history = [list(system) for _ in users]
        for turn in range(args.chat_turns):
            prompts = [h + u[turn] for h, u in zip(history, users)]
            batch = _run_batch(llm, prompts, args.output_len, device)
            history = [p + out for p, out in zip(prompts, batch["outputs"])]  # the model's replies, resent
            batches.append(batch)
    ttft = [x for b in batches for x in b["ttft_s"]]
    wall = sum(b["wall_s"] for b in batches)
    tokens = sum(b["prompt_tokens"] + b["output_tokens"] for b in batches)
    return {"ttft_ms_mean": statistics.mean(ttft) * 1e3, "ttft_ms_median": statistics.median(ttft) * 1e3,
            "prefill_ms": sum(b["prefill_s"] for b in batches) * 1e3, "wall_ms": wall * 1e3,
            "tokens_per_s": tokens / wall, "output_tokens_per_s": sum(b["output_tokens"] for b in batches) / wall,
            "prompt_tokens": sum(b["prompt_tokens"] for b in batches), "requests": len(ttft),
            "outputs": [o for b in batches for o in b["outputs"]]}


def measure(llm, workload: str, args: argparse.Namespace, vocab: int, device: torch.device, enabled: bool) -> dict:
    """A warm-up pass, then a measured pass from an empty cache, with caching ``enabled``."""
    llm.scheduler.set_prefix_caching(False)  # forgets the cache
    if enabled and not llm.scheduler.set_prefix_caching(True):
        raise ValueError("tscompile: this model's cache cannot be prefix-cached (a narrowed cache group)")
    run_workload(llm, workload, args, vocab, device)
    llm.scheduler.set_prefix_caching(False)
    llm.scheduler.set_prefix_caching(enabled)
    before = llm.stats()
    row = run_workload(llm, workload, args, vocab, device)
    after = llm.stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    row.update(prefix_caching=enabled, hit_tokens=hits, queried_tokens=queries,
               hit_rate=hits / queries if queries else 0.0, preemptions=after.num_preemptions - before.num_preemptions)
    return row


def markdown(result: dict) -> str:
    rows = result["rows"]
    lines = [f"## Prefix caching: `{result['workload']}` workload ({result['model']}, {result['device']}, "
             f"{result['dtype']}, attention={result['attention_backend']})", "",
             machine_line(result), "", f"{result['shape']}", "",
             "| prefix caching | TTFT mean ms | TTFT median ms | prefill ms | wall ms | tokens/s | output tok/s | "
             "hit rate | preemptions |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {'on' if r['prefix_caching'] else 'off'} | {r['ttft_ms_mean']:.1f} | {r['ttft_ms_median']:.1f} | "
                     f"{r['prefill_ms']:.1f} | {r['wall_ms']:.1f} | {r['tokens_per_s']:.0f} | "
                     f"{r['output_tokens_per_s']:.0f} | {r['hit_rate']:.1%} | {r['preemptions']} |")
    on, off = (next(r for r in rows if r["prefix_caching"] is v) for v in (True, False))
    if on["prefill_ms"] > 0:
        lines += ["", f"prefill time off/on: {off['prefill_ms'] / on['prefill_ms']:.2f}x; TTFT mean off/on: "
                      f"{off['ttft_ms_mean'] / on['ttft_ms_mean']:.2f}x; greedy outputs equal: {result['outputs_equal']}"]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    import tscompile
    from tscompile.models import build_model

    device = resolve_device(args.device)
    gpu = device.type == "cuda"
    dtype = resolve_dtype(args.dtype, device)
    _fill_defaults(args, gpu)
    model = build_model(args.model, dtype=dtype, device=device, seed=args.seed)
    vocab = model.config.vocab_size
    turns = args.chat_turns if args.prefix_workload == "chat" else 1
    longest = args.prefix_len + turns * (args.prefix_suffix_len + args.output_len)
    page = args.page_size
    backend = (args.attention_backends or ["auto"])[0]
    llm = tscompile.LLM(model, attention_backend=backend, device=device, dtype=dtype,
                        max_num_seqs=args.prefix_requests, max_model_len=-(-longest // page) * page, page_size=page,
                        max_num_batched_tokens=args.max_num_batched_tokens or (8192 if gpu else 256), seed=args.seed,
                        compile_options=args.tscompile_options)
    rows = [measure(llm, args.prefix_workload, args, vocab, device, enabled) for enabled in (False, True)]
    outputs_equal = rows[0].pop("outputs") == rows[1].pop("outputs")
    shape = (f"{args.prefix_requests} {'requests' if args.prefix_workload == 'shared' else 'chats'}, "
             f"{args.prefix_len}-token shared prefix, {args.prefix_suffix_len} own tokens"
             f"{f' per turn, {turns} turns' if turns > 1 else ''}, {args.output_len} new tokens each")
    result = {"date": report.now_iso(), "env": environment.environment(device),
              "workload": args.prefix_workload, "model": args.model, "device": str(device),
              "dtype": str(dtype).removeprefix("torch."), "attention_backend": type(llm.attention.leaves[0]).__name__,
              "shape": shape, "rows": rows, "outputs_equal": outputs_equal,
              "args": {k: v for k, v in vars(args).items() if not callable(v)}}
    md = markdown(result)
    report.write_outputs(result, md, args)
    print(md)
    return 0
