"""The engine fuzz on the CPU: seeded random compositions (ragged prompts around page boundaries,
page sizes 1, 16 and 64, greedy and seeded sampling, stop ids, min_tokens) on eager engines under
pressure (queueing, chunked prefill, preemption), each checked against one-request-at-a-time runs
on an ample engine. Every engine is reused across compositions, so a composition also checks that
nothing an earlier one left behind changes its tokens. The generator and the checker live in
``fuzz_lib.py`` (shared with ``scripts/fuzz_gpu.py``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fuzz_lib import (PAGE_SIZES, SPECULATIVE_CONFIGS, Coverage, EngineSpec, Fuzzer, build_engine,
                      pressured_spec)
from helpers import ids
from tscompile import SamplingParams

# 75 compositions: each pressure and stop path still comes up well over MIN_TIMES (preemption, the
# rarest, 13 times); scripts/fuzz_gpu.py runs the long fuzz
LLAMA_SEEDS_PER_PAGE_SIZE = 25
NARROW_SEEDS_PER_ENGINE = 9  # per page size: one engine that never chunks, one that does
MIN_TIMES = 5  # each pressure and each stop path, at least this many compositions


@pytest.fixture(autouse=True)
def one_torch_thread():
    """These engines are tiny: a second intra-op thread buys nothing, and on a busy 2-core machine
    its OpenMP barrier spin-waits made the fuzz 5x slower (measured: 72 s against 352 s for the
    llama compositions)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_engine(spec):
    return build_engine(spec, device="cpu", dtype=torch.float32, attention_backend="torch", enforce_eager=True)


def run_fuzzers(fuzzers: list[Fuzzer], seeds: range) -> tuple[Coverage, list[str]]:
    coverage, failures = Coverage(), []
    for fuzzer in fuzzers:
        for seed in seeds:
            failure = fuzzer.check(seed)
            if failure is not None:
                # the engine is reused: the exact replay runs the seeds before it on the same engine
                failures.append(f"{failure}\nreplay (tests/test_fuzz.py): fuzzer = Fuzzer({fuzzer.spec!r}, "
                                f"make_engine); [fuzzer.check(s) for s in range({seeds.start}, {seed + 1})]")
        coverage.merge(fuzzer.coverage)
    print(f"fuzz coverage ({', '.join(f.spec.name for f in fuzzers)}): {dict(coverage.counts)}")  # shown with -s
    return coverage, failures


def fail_with(failures: list[str], total: int) -> None:
    if failures:
        seeds = [line for f in failures for line in f.splitlines() if line.startswith("composition seed=")]
        pytest.fail(f"{len(failures)} of {total} compositions failed; the first:\n{failures[0]}\n"
                    f"all failing: " + "; ".join(seeds), pytrace=False)


def assert_covered(coverage: Coverage, names: list[str]) -> None:
    counts = coverage.counts
    thin = {n: counts[n] for n in names if counts[n] < MIN_TIMES}
    assert not thin, f"the fuzz does not exercise {thin} (fewer than {MIN_TIMES} compositions); coverage: {dict(counts)}"


def test_fuzz_llama_batched_equals_one_at_a_time_under_queueing_chunking_and_preemption():
    fuzzers = [Fuzzer(pressured_spec("llama-tiny", p), make_engine) for p in PAGE_SIZES]
    seeds = range(LLAMA_SEEDS_PER_PAGE_SIZE)
    coverage, failures = run_fuzzers(fuzzers, seeds)
    fail_with(failures, len(fuzzers) * len(seeds))
    assert coverage.counts["compositions"] == len(fuzzers) * len(seeds)
    assert_covered(coverage, ["queued", "chunked", "mixed", "preempted", "stop_fired", "sampled_requests",
                              "min_tokens_requests"])
    for f in fuzzers:  # each page size on its own: requests queue, prompts chunk, stops fire
        for name in ("queued", "chunked", "stop_fired"):
            assert f.coverage.counts[name] >= MIN_TIMES, (f.spec.name, name, dict(f.coverage.counts))


def test_fuzz_narrowing_model_against_same_chunking():
    """The narrowing model's tokens depend on chunk boundaries. With a budget no step exceeds, every
    prompt is one chunk whatever shares its steps, so batched equals one at a time; with a chunking
    budget, a fresh engine of the same configuration runs the same schedule (the same boundaries),
    so the reused engine must give its tokens exactly."""
    fuzzers = []
    for p in PAGE_SIZES:
        unchunked = Fuzzer(pressured_spec("narrow-tiny", p, chunked=False), make_engine)
        fuzzers += [unchunked, Fuzzer(pressured_spec("narrow-tiny", p), make_engine, reference=unchunked.reference)]
    seeds = range(1000, 1000 + NARROW_SEEDS_PER_ENGINE)
    coverage, failures = run_fuzzers(fuzzers, seeds)
    fail_with(failures, len(fuzzers) * len(seeds))
    assert coverage.counts["compositions"] == len(fuzzers) * len(seeds)
    assert_covered(coverage, ["queued", "chunked", "stop_fired", "sampled_requests"])
    assert coverage.counts["preemptions"] == 0  # it reserves at admission: pool pressure makes it wait
    for f in fuzzers:
        assert (f.coverage.counts["chunked"] > 0) == (f.spec.oracle == "fresh"), (f.spec.name, dict(f.coverage.counts))


SPEC_SEEDS = 25  # per drafter and page size


def speculative_fuzzers(method: str, model: str = "llama-tiny", page_sizes=PAGE_SIZES,
                        oracle: str = "single") -> list[Fuzzer]:
    fuzzers = []
    for p in page_sizes:
        spec = pressured_spec(model, p)
        name = f"{spec.name}/{method}" + ("/sampled" if oracle == "fresh" else "")
        fuzzers.append(Fuzzer(replace(spec, name=name, oracle=oracle, speculative_config=SPECULATIVE_CONFIGS[method]),
                              make_engine))
    return fuzzers


def run_speculative(fuzzers: list[Fuzzer], seeds: range) -> Coverage:
    """Every composition passes its oracle, drafts were accepted, and no request had min_tokens."""
    coverage, failures = run_fuzzers(fuzzers, seeds)
    fail_with(failures, len(fuzzers) * len(seeds))
    counts = coverage.counts
    assert counts["compositions"] == len(fuzzers) * len(seeds) and counts["accepted_drafts"] > 0, dict(counts)
    assert counts["min_tokens_requests"] == 0
    return coverage


@pytest.mark.parametrize("method", sorted(SPECULATIVE_CONFIGS))
def test_fuzz_speculative_greedy_batched_equals_plain_one_at_a_time(method):
    """With speculation, under queueing, chunked prefill (steps with a chunk run plain decode),
    preemption (the target's and, for a draft model, its own cache) and prefix-cache hits (prompts
    sharing a prefix), every greedy request gets the tokens it gets alone without speculation, stops
    and length limits cutting accepted runs."""
    coverage = run_speculative(speculative_fuzzers(method), range(2000, 2000 + SPEC_SEEDS))
    assert coverage.counts["sampled_requests"] == 0
    assert_covered(coverage, ["verified", "queued", "chunked", "mixed", "stop_fired", "verified_and_preempted",
                              "verified_with_shared_prefix_hits"])
    if method == "ngram":  # replay and a self-drafting model propose the target's own tokens: only
        assert coverage.counts["rejected_drafts"] > 0, dict(coverage.counts)  # n-gram drafts get rejected


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_fuzz_speculative_sampled_reused_engine_equals_a_fresh_one(method):
    """Seeded sampled requests with speculation: the engine reused across compositions gives what a
    new engine of the same configuration gives, so no drafter state (a draft model's cache rows, the
    n-gram histories) outlives its requests; drafts shape a sampled request's tokens, so a leak would
    show here, where greedy tokens hide it."""
    coverage = run_speculative(speculative_fuzzers(method, page_sizes=(1, 16), oracle="fresh"), range(4000, 4012))
    assert_covered(coverage, ["verified", "sampled_requests", "queued", "chunked", "stop_fired"])


def test_fuzz_hybrid_speculative_greedy_batched_equals_plain_one_at_a_time():
    """The same for a hybrid model (Gated DeltaNet layers beside attention): each verify step keeps
    a state checkpoint per window row and commits the one at the accepted length, and a preempted
    request recomputes its state; every greedy request still gets its tokens alone without
    speculation."""
    fuzzers = [f for method in ("ngram", "replay")
               for f in speculative_fuzzers(method, "qwen3-next-tiny", page_sizes=(1, 16))]
    coverage = run_speculative(fuzzers, range(3000, 3012))
    assert_covered(coverage, ["verified", "queued", "chunked", "stop_fired", "verified_and_preempted"])


def test_the_speculative_fuzz_catches_a_wrong_emitted_token():
    """Not vacuous with speculation either: a verify step that emits one wrong token is reported."""
    fuzzer = speculative_fuzzers("replay")[1]
    launch_verify = fuzzer.llm.runner.launch_verify
    corrupted = []

    def corrupt(plan):
        both = launch_verify(plan)
        if not corrupted:
            corrupted.append(plan.request_ids)
            both = both.clone()
            both[0, 0] = (both[0, 0] + 1) % fuzzer.llm.config.vocab_size
        return both

    fuzzer.llm.runner.launch_verify = corrupt
    messages = [m for m in (fuzzer.check(seed) for seed in range(2000, 2010)) if m is not None]
    assert corrupted and messages, "no verify step to corrupt, or the corruption went unnoticed"
    assert "batched and one-at-a-time outputs differ" in messages[0]


def test_the_fuzz_oracle_catches_a_wrong_token():
    """The checker is not vacuous: a runner that corrupts one sampled token of a batched step is
    reported as a mismatch naming the composition's seed."""
    fuzzer = Fuzzer(pressured_spec("llama-tiny", 16), make_engine)
    launch = fuzzer.llm.runner.launch
    corrupted = []

    def corrupt(plan, prev_rows=None):
        pending = launch(plan, prev_rows)
        if plan.num_requests > 1 and plan.emits[0] and not corrupted:  # a sample that becomes a token
            corrupted.append(plan.request_ids)
            fuzzer.llm.runner.sampling.tokens[0] = (fuzzer.llm.runner.sampling.tokens[0] + 1) % 512
            pending = fuzzer.llm.runner.readback.start(fuzzer.llm.runner.sampling.tokens[: plan.num_requests])
        return pending

    fuzzer.llm.runner.launch = corrupt
    messages = [m for m in (fuzzer.check(seed) for seed in range(10)) if m is not None]
    assert corrupted and messages, "no batched step to corrupt, or the corruption went unnoticed"
    assert "batched and one-at-a-time outputs differ" in messages[0] and "composition seed=" in messages[0]


def test_generate_returns_with_nothing_in_flight_after_a_stop_token():
    llm = make_engine(EngineSpec("async", "llama-tiny", page_size=16, max_model_len=64, max_num_seqs=2,
                                 max_num_batched_tokens=64, num_pages=None, async_scheduling=True))
    prompt = [5, 17, 3]
    free = ids(llm.generate([prompt], SamplingParams(max_new_tokens=4)))[0]
    out = llm.generate([prompt], SamplingParams(max_new_tokens=4, stop_token_ids=[free[0]]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == [free[0]]
    assert not llm.has_unfinished()
    # the same through stream: exhausting the iterator leaves nothing in flight either
    for _ in llm.stream(prompt, SamplingParams(max_new_tokens=4, stop_token_ids=[free[0]])):
        pass
    assert not llm.has_unfinished()
