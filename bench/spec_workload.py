"""``tscompile bench --speculative ngram replay draft_model`` (or ``all``): speculative decoding
against plain decode, every method and k in one process, over the same model and prompts.

Prompts repeat a random block (``--spec-block`` tokens, ``--spec-repeats`` times), so the n-gram
drafter finds drafts. Per batch size (``--spec-requests``, a list) plain decode runs first: its
greedy outputs are where the replay drafter's references start, and its decode step is the N = 1
baseline. The replay engine's warm-up runs then hand it its own greedy output until it gives back
what it was handed (``settle_replay``), so the measured run accepts every draft: the verify path's
ceiling. Then one engine per method and k
(``--num-speculative-tokens``, a list; ``--draft-model`` for ``draft_model``, default the target
itself). Each engine runs the batch once unmeasured (compiles, captures), then measured. Per row:
the mean time of a decode step (a verify step of N = k + 1 rows with speculation; each timed with
the device synchronized, host drafting and commit included) and its ratio to the N = 1 step at the
same batch size, output tokens per request and step, output tokens/s over the wall time and its
ratio to plain decode, the acceptance rate, and whether the greedy outputs equal plain decode's.
With ``--kernel-table``, each row also gets the kernel table of a few of its steps (one more run,
profiled from its middle): what the device runs in a verify step against a plain one.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from tscompile.utils import resolve_device, resolve_dtype

from . import environment, kernel_table, report, row_kernels, variants
from .report import machine_line
from .workloads import Timer

METHODS = ("replay", "ngram", "draft_model")


def repetitive_prompts(seed: int, vocab: int, num_requests: int, block: int, repeats: int) -> list[list[int]]:
    rng = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (block,), generator=rng).tolist() * repeats for _ in range(num_requests)]


def methods_of(names: list[str]) -> list[str]:
    """``--speculative``'s methods in bench order; ``all`` is every one."""
    chosen = set(METHODS) if "all" in names else set(names)
    return [m for m in METHODS if m in chosen]


def greedy_run(llm, prompts: list[list[int]], output_len: int, device: torch.device, window=None) -> dict:
    """One greedy run of ``prompts``; ``window``: a ``kernel_table.StepWindow`` told of every decode
    (or verify) step, which profiles the ones it was asked for."""
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
            if window is not None:
                window.before(decode_steps)
            with Timer(device) as t:
                llm.step()
            llm.sync()
            if window is not None:
                window.after(decode_steps)
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


REPLAY_SETTLE_RUNS = 4  # warm-up runs that may pass the replay engine's output back to it


def settle_replay(llm, prompts, output_len, device, references: dict, max_runs: int = REPLAY_SETTLE_RUNS) -> int:
    """Warm-up runs of a replay engine, each handed the previous run's greedy output as its
    references (the first: ``references``, plain decode's), until a run gives back what it was
    handed; returns how many ran. In a lower dtype the verify step of N rows rounds differently from
    the N = 1 step, a greedy choice between near ties can flip, and plain decode's continuation then
    misses from that token on. A run that returns its references accepted every draft, so the next
    run, handed the same, repeats it draft for draft. After ``max_runs`` the engine keeps the last
    output as references and the measured run's acceptance says how close it came."""
    for runs in range(1, max_runs + 1):
        llm.set_replay_references(references)
        outputs = greedy_run(llm, prompts, output_len, device)["outputs"]
        own = {tuple(p): o for p, o in zip(prompts, outputs)}
        if own == references:
            return runs
        references = own
    llm.set_replay_references(references)
    return max_runs


def _measure(make_llm, prompts, output_len, device, references=None, profile=None) -> dict:
    """One engine: warm-up runs, then the measured one (acceptance from the stats between).
    ``profile``: ``(steps, top, itemsize)`` for a kernel table of the row, from one more run after
    the measured one (``--kernel-table``)."""
    llm = make_llm()
    try:
        settle_runs = 1
        if references is not None:
            settle_runs = settle_replay(llm, prompts, output_len, device, references)
        else:
            greedy_run(llm, prompts, output_len, device)  # warm-up: compiles and graph captures
        before = llm.stats()
        row = greedy_run(llm, prompts, output_len, device)
        after = llm.stats()
        if profile is not None:
            row["kernel_table"] = row_kernels.guarded_table(
                lambda: _step_kernel_table(llm, prompts, output_len, device, row["decode_steps"], *profile), False)
    finally:
        del llm
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    drafts = after.spec_draft_tokens - before.spec_draft_tokens
    row["acceptance_rate"] = (after.spec_accepted_tokens - before.spec_accepted_tokens) / drafts if drafts else 0.0
    verify_steps = after.spec_verify_steps - before.spec_verify_steps
    # the host's share of a verify step (None for plain decode): on a GPU it adds to the step's time
    row["verify_host_ms"] = ((after.spec_host_seconds - before.spec_host_seconds) / verify_steps * 1e3
                             if verify_steps else None)
    # of it, the drafter's: a draft model's k steps (the 1B -> 8B pair's draft cost per verify step)
    row["verify_draft_ms"] = ((after.spec_draft_seconds - before.spec_draft_seconds) / verify_steps * 1e3
                              if verify_steps else None)
    row["draft_tokens"] = drafts
    row["warmup_runs"] = settle_runs
    return row


def _step_kernel_table(llm, prompts, output_len, device, steps: int, count: int, top: int, itemsize: int) -> dict:
    """The kernel table of ``count`` decode (or verify) steps from the middle of one more run."""
    if steps < 1:
        return {"error": "no decode step to profile"}
    count = min(count, steps)
    window = kernel_table.StepWindow(device.type, (steps - count) // 2, count)
    try:
        greedy_run(llm, prompts, output_len, device, window)
    finally:
        window.finish()
    if window.steps < 1:
        return {"error": "the profiled run had no decode step in its window"}
    stats = kernel_table.stats_of(window.prof, device.type, itemsize)
    return kernel_table.table(stats, window.steps, device.type, top, timeline=kernel_table.timeline_of(window.prof,
                                                                                                        device.type))


def markdown(result: dict) -> str:
    # a variant column only where --kernel-variants ran (a run without it reads as it always did)
    variant_rows = any(r.get("variant") for r in result["rows"])
    lines = [f"## Speculative decoding: {result['model']}, {result['device']}, {result['dtype']}", "",
             machine_line(result), "", result["shape"], "",
             ("| kernels " if variant_rows else "")
             + "| bs | method | k | N | step ms | host ms of a verify step | of it drafting | vs N=1 step | "
             "tokens/step/request | output tok/s | vs plain | acceptance | outputs equal |",
             ("|---" if variant_rows else "") + "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    given = variants.parse((result.get("args") or {}).get("kernel_variants"))
    for r in result["rows"]:
        host, draft = r.get("verify_host_ms"), r.get("verify_draft_ms")
        cells = (f"| {r['batch_size']} | {r['method']} | {r['k']} | {r['k'] + 1} | {r['decode_step_ms']:.3f} | "
                 f"{'-' if host is None else f'{host:.3f}'} | {'-' if draft is None else f'{draft:.3f}'} | "
                 f"{r['step_ratio']:.2f}x | {r['tokens_per_step']:.2f} | {r['output_tokens_per_s']:.0f} | "
                 f"{r['ratio_to_plain']:.2f}x | {r['acceptance_rate']:.1%} | {r['outputs_equal']} |")
        if variant_rows:
            name = r.get("variant")
            kernels = "the run's" if name is None else f"{name} `{json.dumps(given.get(name, {}), sort_keys=True)}`"
            cells = f"| {kernels} {cells}"
        lines.append(cells)
    tables = [report.kernel_section(f"bs={r['batch_size']} {r['method']} N={r['k'] + 1}"
                                    + (f" ({r['variant']})" if r.get("variant") else ""), r["kernel_table"])
              for r in result["rows"] if r.get("kernel_table")]
    if tables:
        lines += ["", "### Kernels", "",
                  "Per row: the decode (or verify) steps profiled with torch.profiler from the middle of one more "
                  "run of the row's batch, after its measured run. On CUDA the device activities, graph replays' "
                  "kernels included; the device busy time per step against the row's step ms is the host's share "
                  "(each step is timed with the device synchronized).", "", *[t + "\n" for t in tables]]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    import tscompile
    from tscompile.models import build_model

    device = resolve_device(args.device)
    gpu = device.type == "cuda"
    dtype = resolve_dtype(args.dtype, device)
    methods = methods_of(args.speculative)
    ks = [int(k) for k in str(args.num_speculative_tokens).split(",")]
    sizes = [int(b) for b in str(args.spec_requests or ("1,32" if gpu else "2")).split(",")]
    output_len = args.output_len or (128 if gpu else 16)
    draft = args.draft_model or args.model
    model = build_model(args.model, dtype=dtype, device=device, seed=args.seed)
    page = args.page_size
    longest = args.spec_block * args.spec_repeats + output_len
    max_len = -(-(longest + max(ks) + 1) // page) * page
    profile = ((args.kernel_table_steps, args.kernel_table_top, dtype.itemsize)
               if getattr(args, "kernel_table", False) else None)
    rows = []
    # --kernel-variants: after the run's own kernels, each variant's plain and speculative rows again,
    # in this process, each against its own plain decode
    runs = [(None, args.tscompile_options)] + [
        (name, variants.compile_options(args.tscompile_options, kernels))
        for name, kernels in variants.parse(getattr(args, "kernel_variants", None)).items()]
    for bs in sizes:
        prompts = repetitive_prompts(args.seed + bs, model.config.vocab_size, bs, args.spec_block, args.spec_repeats)
        for variant, options in runs:
            def make(spec=None, bs=bs, options=options):
                return tscompile.LLM(model, attention_backend=(args.attention_backends or ["auto"])[0], device=device,
                                     dtype=dtype, max_num_seqs=bs, max_model_len=max_len, page_size=page,
                                     seed=args.seed, compile_options=options, speculative_config=spec)

            plain = _measure(make, prompts, output_len, device, profile=profile)
            outputs = plain.pop("outputs")
            references = {tuple(p): o for p, o in zip(prompts, outputs)}
            plain.update(batch_size=bs, method="plain", k=0, outputs_equal=True, ratio_to_plain=1.0, step_ratio=1.0,
                         variant=variant)
            rows.append(plain)
            for method in methods:
                for k in ks:
                    spec = {"method": method, "num_speculative_tokens": k}
                    if method == "draft_model":
                        spec["model"] = draft
                    row = _measure(lambda: make(spec), prompts, output_len, device,
                                   references if method == "replay" else None, profile)
                    row.update(batch_size=bs, method=method, k=k, outputs_equal=row.pop("outputs") == outputs,
                               ratio_to_plain=row["output_tokens_per_s"] / plain["output_tokens_per_s"],
                               step_ratio=row["decode_step_ms"] / plain["decode_step_ms"], variant=variant)
                    rows.append(row)
    shape = (f"batch sizes {sizes}, prompts of a {args.spec_block}-token block repeated {args.spec_repeats} times, "
             f"{output_len} greedy tokens each; draft model {draft}")
    result = {"date": report.now_iso(), "env": environment.environment(device),
              "methods": methods, "model": args.model, "draft_model": draft, "device": str(device),
              "dtype": str(dtype).removeprefix("torch."), "shape": shape, "rows": rows,
              "args": {k: v for k, v in vars(args).items() if not callable(v)}}
    md = markdown(result)
    report.write_outputs(result, md, args)
    print(md)
    return 0
