"""``tscompile bench --prefix-workload shared|chat|distinct``: what prefix caching saves, and what it
costs where nothing hits, caching on and off in one run on one engine (its compiled graphs serve both;
switching caching off forgets the cache).

- ``shared``: ``--prefix-requests`` requests (default 32; 4 on the CPU) submitted together, each a
  ``--prefix-len``-token shared prefix (2048; 64) and ``--prefix-suffix-len`` tokens of its own (64; 8).
- ``chat``: a multi-turn chat replay: ``--prefix-requests`` chats opening with the shared prefix (a
  system prompt), ``--chat-turns`` turns (4; 2), each turn's prompt the whole history so far (the
  previous turns' prompts and the model's own replies) plus a new ``--prefix-suffix-len``-token user
  message; each turn's chats are submitted together once the previous turn finished.
- ``distinct``: no shared tokens, so no hits: ``--prefix-requests`` prompts of ``--prefix-len`` +
  ``--prefix-suffix-len`` tokens each its own, submitted one at a time (each runs to its last token
  before the next is submitted), so every prefill is a step of its own. Per request it also records
  the host's time from the submit until its prefill was launched (the admission, with the block
  hashing and lookup, runs before the launch) and until that step returned (the scheduler's update
  after the launch publishes the prompt's full blocks), and the settings alternate off, on, off, on:
  each setting's figures are over both of its passes, so a drift of the machine during the run falls
  on both alike.

Each setting runs once unmeasured (compiles and graph captures), then measured from an empty cache.
Per setting: mean and median TTFT (submit to the first token read back on the host, per request),
the total prefill time (the steps that carry prompt rows, each timed with the device synchronized
before and after, summed), the wall time, token throughput and the prefix-cache hit rate.
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch

from tscompile.utils import resolve_device, resolve_dtype

from . import environment, report
from .report import machine_line
from .workloads import Timer

PREFIX_WORKLOADS = ("shared", "chat", "distinct")
DISTINCT_ROUNDS = 2  # off, on, off, on: each setting measured twice, interleaved


def _tokens(rng: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=rng).tolist()


def shared_prefix_prompts(seed: int, vocab: int, num_requests: int, prefix_len: int, suffix_len: int) -> list[list[int]]:
    """``num_requests`` prompts: one random prefix, then each its own random suffix."""
    rng = torch.Generator().manual_seed(seed)
    prefix = _tokens(rng, prefix_len, vocab)
    return [prefix + _tokens(rng, suffix_len, vocab) for _ in range(num_requests)]


def distinct_prompts(seed: int, vocab: int, num_requests: int, length: int) -> list[list[int]]:
    """``num_requests`` random prompts of ``length`` tokens, each its own: two of them share a first
    block (``page_size`` tokens) with a chance of ``vocab ** -page_size``, never in practice."""
    rng = torch.Generator().manual_seed(seed + 2)
    return [_tokens(rng, length, vocab) for _ in range(num_requests)]


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


def _run_one_by_one(llm, prompts: list[list[int]], output_len: int, device: torch.device) -> dict:
    """Submit ``prompts`` one at a time, each run to its last token: per-request TTFT, the host's time
    until its prefill was launched (the runner's launch returned: the admission, with its block hashing
    and lookup, runs before it) and until that step returned (after the launch, the scheduler's update
    publishes the prompt's full blocks), and the prefill and wall time."""
    params = llm_params(output_len)
    ttft, until_launch, until_step, prefill_s, outputs = [], [], [], 0.0, []
    launch_returns: list[float] = []
    launch = llm.runner.launch

    def timed_launch(*args, **kwargs):
        tokens = launch(*args, **kwargs)
        launch_returns.append(time.perf_counter())
        return tokens

    with mock.patch.object(llm.runner, "launch", timed_launch):
        begin = time.perf_counter()
        for p in prompts:
            with Timer(device) as t:
                launch_returns.clear()
                start = time.perf_counter()
                req = llm.add_request(p, params)
                llm.step()  # admits it and launches its prefill (an idle engine has nothing in flight)
                until_step.append(time.perf_counter() - start)
                assert launch_returns, "the step after a submit to an idle engine launched nothing"
                until_launch.append(launch_returns[0] - start)
                while not req.output:
                    llm.step()
                ttft.append(time.perf_counter() - start)
            prefill_s += t.seconds
            while llm.has_unfinished():
                llm.step()
            outputs.append(list(req.output))
        if device.type == "cuda":
            torch.cuda.synchronize()
    return {"ttft_s": ttft, "host_until_launch_s": until_launch, "host_until_step_s": until_step,
            "prefill_s": prefill_s,
            "wall_s": time.perf_counter() - begin, "prompt_tokens": sum(map(len, prompts)),
            "output_tokens": sum(map(len, outputs)), "outputs": outputs}


def llm_params(output_len: int):
    from tscompile import SamplingParams

    return SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)


def run_workload(llm, workload: str, args: argparse.Namespace, vocab: int, device: torch.device) -> dict:
    """One pass of ``workload``: its batches' figures summed (TTFT per request over every batch)."""
    batches = []
    if workload == "distinct":
        prompts = distinct_prompts(args.seed, vocab, args.prefix_requests, args.prefix_len + args.prefix_suffix_len)
        batches.append(_run_one_by_one(llm, prompts, args.output_len, device))
    elif workload == "shared":
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
    until_step = [x for b in batches for x in b.get("host_until_step_s", ())]
    until_launch = [x for b in batches for x in b.get("host_until_launch_s", ())]
    return {"ttft_ms_mean": statistics.mean(ttft) * 1e3, "ttft_ms_median": statistics.median(ttft) * 1e3,
            "host_until_step_ms_median": statistics.median(until_step) * 1e3 if until_step else None,
            "host_until_step_ms": [x * 1e3 for x in until_step],
            "host_until_launch_ms_median": statistics.median(until_launch) * 1e3 if until_launch else None,
            "host_until_launch_ms": [x * 1e3 for x in until_launch], "ttft_ms": [x * 1e3 for x in ttft],
            "prefill_ms": sum(b["prefill_s"] for b in batches) * 1e3, "wall_ms": wall * 1e3,
            "tokens_per_s": tokens / wall, "output_tokens_per_s": sum(b["output_tokens"] for b in batches) / wall,
            "prompt_tokens": sum(b["prompt_tokens"] for b in batches), "requests": len(ttft),
            "outputs": [o for b in batches for o in b["outputs"]]}


def _set_caching(llm, enabled: bool) -> None:
    llm.scheduler.set_prefix_caching(False)  # forgets the cache
    if enabled and not llm.scheduler.set_prefix_caching(True):
        raise ValueError("tscompile: this model's cache cannot be prefix-cached (a narrowed cache group)")


def _measured_pass(llm, workload: str, args: argparse.Namespace, vocab: int, device: torch.device,
                   enabled: bool) -> dict:
    """One pass from an empty cache with caching ``enabled``, with its cache counters."""
    _set_caching(llm, enabled)
    before = llm.stats()
    row = run_workload(llm, workload, args, vocab, device)
    after = llm.stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    row.update(prefix_caching=enabled, hit_tokens=hits, queried_tokens=queries,
               hit_rate=hits / queries if queries else 0.0, preemptions=after.num_preemptions - before.num_preemptions)
    return row


def measure(llm, workload: str, args: argparse.Namespace, vocab: int, device: torch.device, enabled: bool) -> dict:
    """A warm-up pass, then a measured pass from an empty cache, with caching ``enabled``."""
    _set_caching(llm, enabled)
    run_workload(llm, workload, args, vocab, device)
    return _measured_pass(llm, workload, args, vocab, device, enabled)


def _merge_passes(passes: list[dict]) -> dict:
    """One setting's row from its interleaved passes: per-request figures pooled, totals summed."""
    ttft = [x for p in passes for x in p["ttft_ms"]]
    until_step = [x for p in passes for x in p["host_until_step_ms"]]
    until_launch = [x for p in passes for x in p["host_until_launch_ms"]]
    row = dict(passes[0], ttft_ms=ttft, outputs=[o for p in passes for o in p["outputs"]])
    for key in ("prefill_ms", "wall_ms", "prompt_tokens", "requests", "hit_tokens", "queried_tokens", "preemptions"):
        row[key] = sum(p[key] for p in passes)
    wall_s = row["wall_ms"] / 1e3
    tokens = sum(p["prompt_tokens"] + sum(map(len, p["outputs"])) for p in passes)
    row.update(ttft_ms_mean=statistics.mean(ttft), ttft_ms_median=statistics.median(ttft),
               host_until_step_ms=until_step, host_until_step_ms_median=statistics.median(until_step),
               host_until_launch_ms=until_launch, host_until_launch_ms_median=statistics.median(until_launch),
               tokens_per_s=tokens / wall_s,
               output_tokens_per_s=sum(sum(map(len, p["outputs"])) for p in passes) / wall_s,
               hit_rate=row["hit_tokens"] / row["queried_tokens"] if row["queried_tokens"] else 0.0, passes=len(passes))
    return row


def measure_interleaved(llm, workload: str, args: argparse.Namespace, vocab: int, device: torch.device,
                        rounds: int = DISTINCT_ROUNDS) -> list[dict]:
    """Caching off and on, a warm-up pass each, then ``rounds`` measured passes of each, alternating:
    [off row, on row]."""
    for enabled in (False, True):
        _set_caching(llm, enabled)
        run_workload(llm, workload, args, vocab, device)
    passes = {False: [], True: []}
    for _ in range(rounds):
        for enabled in (False, True):
            passes[enabled].append(_measured_pass(llm, workload, args, vocab, device, enabled))
    return [_merge_passes(passes[enabled]) for enabled in (False, True)]


def markdown(result: dict) -> str:
    rows = result["rows"]
    host = all(r.get("host_until_step_ms_median") is not None for r in rows)
    lines = [f"## Prefix caching: `{result['workload']}` workload ({result['model']}, {result['device']}, "
             f"{result['dtype']}, attention={result['attention_backend']})", "",
             machine_line(result), "", f"{result['shape']}", "",
             "| prefix caching | TTFT mean ms | TTFT median ms | "
             + ("host until launch ms (median) | host until step returned ms (median) | " if host else "")
             + "prefill ms | wall ms | tokens/s | output tok/s | hit rate | preemptions |",
             "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if host else "")]
    for r in rows:
        lines.append(f"| {'on' if r['prefix_caching'] else 'off'} | {r['ttft_ms_mean']:.3f} | {r['ttft_ms_median']:.3f} | "
                     + (f"{r['host_until_launch_ms_median']:.3f} | {r['host_until_step_ms_median']:.3f} | "
                        if host else "")
                     + f"{r['prefill_ms']:.1f} | {r['wall_ms']:.1f} | {r['tokens_per_s']:.0f} | "
                     f"{r['output_tokens_per_s']:.0f} | {r['hit_rate']:.1%} | {r['preemptions']} |")
    on, off = (next(r for r in rows if r["prefix_caching"] is v) for v in (True, False))
    if host:
        until_launch = on["host_until_launch_ms_median"] / off["host_until_launch_ms_median"]
        until_step = on["host_until_step_ms_median"] / off["host_until_step_ms_median"]
        lines += ["", f"on/off: host until launch {until_launch:.3f}, host until step returned {until_step:.3f}, "
                      f"TTFT median {on['ttft_ms_median'] / off['ttft_ms_median']:.3f}, prefill time "
                      f"{on['prefill_ms'] / off['prefill_ms']:.3f} ({on.get('passes', 1)} interleaved passes of each "
                      f"setting, medians over their requests)"]
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
    if args.prefix_workload == "distinct":
        rows = measure_interleaved(llm, args.prefix_workload, args, vocab, device)
        shape = (f"{args.prefix_requests} requests one at a time, {args.prefix_len + args.prefix_suffix_len} tokens "
                 f"each with no token shared, {args.output_len} new tokens each")
    else:
        rows = [measure(llm, args.prefix_workload, args, vocab, device, enabled) for enabled in (False, True)]
        shape = (f"{args.prefix_requests} {'requests' if args.prefix_workload == 'shared' else 'chats'}, "
                 f"{args.prefix_len}-token shared prefix, {args.prefix_suffix_len} own tokens"
                 f"{f' per turn, {turns} turns' if turns > 1 else ''}, {args.output_len} new tokens each")
    outputs_equal = rows[0].pop("outputs") == rows[1].pop("outputs")
    result = {"date": report.now_iso(), "env": environment.environment(device),
              "workload": args.prefix_workload, "model": args.model, "device": str(device),
              "dtype": str(dtype).removeprefix("torch."), "attention_backend": type(llm.attention.leaves[0]).__name__,
              "shape": shape, "rows": rows, "outputs_equal": outputs_equal,
              "args": {k: v for k, v in vars(args).items() if not callable(v)}}
    md = markdown(result)
    report.write_outputs(result, md, args)
    print(md)
    return 0
