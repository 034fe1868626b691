"""The engine fuzz: seeded random compositions and the batched-vs-one-at-a-time oracle.

Shared by ``tests/test_fuzz.py`` (eager CPU engines) and ``scripts/fuzz_gpu.py`` (compiled CUDA
engines). A *composition* is a few prompts with their sampling parameters, drawn from one seed; it
runs batched (all prompts in one ``generate``) on an engine reused across compositions and built to
be under pressure (few sequences, a small token budget, a pool that barely fits one request), and
each prompt runs alone on an engine with an ample pool. The two must agree token for token,
finish reasons included: the scheduler may queue, chunk and preempt, but a request's tokens depend
only on its prompt and its parameters (a sampled request's draws on its seed and position).

With speculative decoding (an ``EngineSpec`` with a ``speculative_config``) no request has
min_tokens (which speculation refuses). Against the one-at-a-time engine, which runs without
speculation, every request is greedy: a request's greedy tokens must not depend on
whether its steps ran as verify windows, as plain decode steps (a step with a prefill chunk in it, a
window the pool cannot hold) or both. Sampled requests are left out there: a verify step draws a
sampled request's tokens by rejection sampling, from other random numbers than a plain step's, so
the same seed gives a token sequence of the same distribution, not the same tokens. Sampled
requests are checked instead by the "fresh" oracle: the reused engine (its prefix cache emptied
first, so both schedule alike) must give what a new engine of the same configuration gives, which
nothing a drafter kept from an earlier composition may change.

The narrowing model is the one exception: its tail cache keeps rows by chunk boundary, and a
request's chunk boundaries depend on what shares its steps. Its compositions run either on an
engine whose token budget never chunks (batched vs one at a time still holds exactly), or on a
chunking engine checked against a fresh engine of the same configuration running the same
composition: the same schedule and the same chunk boundaries, a different block history.
"""

from __future__ import annotations

import collections
import random
import traceback
from dataclasses import dataclass, field, replace
from typing import Callable

import tscompile
from tscompile import SamplingParams
from tscompile.counters import counters
from tscompile.forward_context import ForwardMode
from tscompile.utils import cdiv

PAGE_SIZES = (1, 16, 64)
MAX_PROMPTS = 6
MAX_NEW_TOKENS = 12
MAX_LONG_PAGES, MAX_LONG_EXTRA = 4, 5  # a "long" prompt: 2-4 pages and 1-5 tokens more
# the drafters of the speculative fuzz, each proposing often: a 1-token n-gram, the requests' own
# greedy tokens, the target drafting for itself
SPECULATIVE_CONFIGS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2},
    "replay": {"method": "replay", "num_speculative_tokens": 3},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 2, "model": "llama-tiny"},
}


# -- engines -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineSpec:
    """One engine configuration; ``kwargs()`` are ``tscompile.LLM``'s arguments. ``oracle`` names how
    its batched runs are checked: "single" (each prompt alone on ``reference_spec``), "fresh" (the
    same composition on a new engine of this very spec) or "none" (only the caller's extra check:
    bfloat16, where another batch shape rounds differently)."""

    name: str
    model: str
    page_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_pages: int | None
    async_scheduling: bool = True
    oracle: str = "single"
    speculative_config: dict | None = None  # no min_tokens; greedy unless the oracle is "fresh" (module docstring)

    def kwargs(self) -> dict:
        kw = dict(page_size=self.page_size, max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                  max_num_batched_tokens=self.max_num_batched_tokens, num_pages=self.num_pages,
                  async_scheduling=self.async_scheduling)
        if self.speculative_config is not None:
            kw["speculative_config"] = dict(self.speculative_config)
        return kw

    @property
    def method(self) -> str | None:
        return self.speculative_config["method"] if self.speculative_config is not None else None


def max_model_len_for(page_size: int) -> int:
    """Room for the longest prompt the generator draws plus ``MAX_NEW_TOKENS``, in whole pages."""
    longest = MAX_LONG_PAGES * page_size + MAX_LONG_EXTRA + MAX_NEW_TOKENS
    return cdiv(longest, page_size) * page_size


def pressured_spec(model: str, page_size: int, *, chunked: bool = True, max_num_seqs: int = 3) -> EngineSpec:
    """Few sequences (requests queue), a budget of about 1.5 pages (long prompts chunk; with
    page_size 1, 4 tokens) and a pool that holds one request of ``max_model_len`` and no more (a
    growing request preempts another; the narrowing model, which reserves at admission, waits
    instead). ``chunked=False`` gives a budget no step can exceed: every prompt is one chunk."""
    max_len = max_model_len_for(page_size)
    budget = max(4, page_size * 3 // 2) if chunked else max_num_seqs * max_len
    return EngineSpec(f"{model}/p{page_size}/{'chunked' if chunked else 'unchunked'}", model, page_size, max_len,
                      max_num_seqs, budget, num_pages=max_len // page_size + 1,
                      oracle="fresh" if chunked and model == "narrow-tiny" else "single")


def reference_spec(model: str, page_size: int) -> EngineSpec:
    """One request at a time: an ample pool, no chunking, synchronous steps."""
    max_len = max_model_len_for(page_size)
    return EngineSpec(f"{model}/p{page_size}/reference", model, page_size, max_len, 1, max_len, None,
                      async_scheduling=False)


def build_engine(spec: EngineSpec, **engine_kw) -> tscompile.LLM:
    """``engine_kw``: device, dtype, attention_backend, enforce_eager, compile_options."""
    return tscompile.LLM(spec.model, **spec.kwargs(), **engine_kw)


# -- compositions ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Composition:
    seed: int
    page_size: int
    prompts: tuple[tuple[int, ...], ...]
    params: tuple[SamplingParams, ...]
    shared_prefix_len: int = 0  # tokens every prompt starts with (speculative compositions only)

    def describe(self) -> str:
        """Everything needed to replay it by hand."""
        lines = [f"composition seed={self.seed} page_size={self.page_size}:"]
        for i, (p, sp) in enumerate(zip(self.prompts, self.params)):
            lines.append(f"  [{i}] prompt (len {len(p)}) = {list(p)}")
            lines.append(f"      {sp}")
        return "\n".join(lines)


def prompt_length(rng: random.Random, page_size: int) -> int:
    """1, page-1, page, page+1 or long; page-1 of a one-token page is 0, drawn again."""
    while True:
        kind = rng.choice(("one", "page-1", "page", "page+1", "long"))
        n = {"one": 1, "page-1": page_size - 1, "page": page_size, "page+1": page_size + 1,
             "long": rng.randint(2, MAX_LONG_PAGES) * page_size + rng.randint(1, MAX_LONG_EXTRA)}[kind]
        if n > 0:
            return n


# preview(prompt, params) -> the tokens that prompt generates alone with those params (no stops)
Preview = Callable[[tuple[int, ...], SamplingParams], list[int]]


def draw_params(rng: random.Random, prompt: tuple[int, ...], vocab_size: int, preview: Preview,
                speculative: bool = False, sampled: bool = True) -> SamplingParams:
    """Greedy or seeded sampling (a sampled request always has a seed: without one the engine draws
    it from its own generator in queue order, and batched would differ from one at a time by design),
    1-12 new tokens, sometimes min_tokens, sometimes stop ids taken from the tokens the request
    generates without them, so that the stops do trigger. ``speculative``: for an engine with
    speculation, no min_tokens (which speculation refuses); ``sampled=False``: greedy only."""
    sp = SamplingParams(max_new_tokens=rng.randint(1, MAX_NEW_TOKENS))
    if rng.random() < 0.5 and sampled:
        sp = replace(sp, temperature=round(rng.uniform(0.7, 1.0), 3), seed=rng.randrange(2**31),
                     top_k=rng.choice((0, 0, 5, 40)), top_p=rng.choice((1.0, 1.0, 0.8, 0.95)))
    if rng.random() < 0.25 and not speculative:
        sp = replace(sp, min_tokens=rng.randint(0, sp.max_new_tokens))
    if rng.random() < 0.4:
        stops = []
        if rng.random() < 0.85:
            generated = preview(prompt, sp)
            stops.append(generated[rng.randrange(len(generated))])
        if rng.random() < 0.3:
            stops.append(rng.randrange(vocab_size))  # likely never sampled: a stop that does not fire
        sp = replace(sp, stop_token_ids=tuple(stops))
    return sp


def draw_composition(seed: int, page_size: int, vocab_size: int, preview: Preview,
                     speculative: bool = False, sampled: bool = True) -> Composition:
    rng = random.Random(f"fuzz-{seed}")
    prompts, params = [], []
    # with speculation, half the compositions share a prefix (whole pages, or a page and a token
    # either side), so verify windows run over cached blocks that other requests hold
    shared = ()
    if speculative and rng.random() < 0.5:
        pages = rng.randint(1, 2) * page_size
        shared = tuple(rng.randrange(vocab_size) for _ in range(max(1, pages + rng.choice((-1, 0, 1)))))
    for _ in range(rng.randint(1, MAX_PROMPTS)):
        own = prompt_length(rng, page_size)
        if shared:  # no longer than the longest prompt the engines are sized for
            own = max(1, min(own, MAX_LONG_PAGES * page_size + MAX_LONG_EXTRA - len(shared)))
        prompt = shared + tuple(rng.randrange(vocab_size) for _ in range(own))
        prompts.append(prompt)
        params.append(draw_params(rng, prompt, vocab_size, preview, speculative, sampled))
    return Composition(seed, page_size, tuple(prompts), tuple(params), len(shared))


# -- observing an engine -----------------------------------------------------------------------------
class StepLog:
    """What the steps of one batched ``generate`` did, recorded by wrapping the runner's ``launch``
    (``reset`` before the call, ``finish`` after it)."""

    def __init__(self, llm: tscompile.LLM):
        self.llm, self.scheduler = llm, llm.scheduler
        self.reset()
        graphs = llm.runner.graphs
        if graphs is not None:  # verify windows replay graphs keyed (bs, N > 1)
            replay_graph = graphs.replay_graph

            def counted(key):
                self.verify_replays += key.width > 1
                return replay_graph(key)

            graphs.replay_graph = counted
        launch = llm.runner.launch

        def observed(plan, prev_rows=None):
            self.steps += 1
            self.queued |= bool(self.scheduler.waiting)  # a request waited (max_num_seqs or the pool)
            self.chunked |= not bool(plan.completes[: plan.num_extends].all())  # an open chunk
            self.mixed |= plan.mode is ForwardMode.MIXED
            return launch(plan, prev_rows)

        llm.runner.launch = observed

    def reset(self) -> None:
        self.steps, self.queued, self.chunked, self.mixed = 0, False, False, False
        self.preemptions, self._preemptions_before = 0, self.scheduler.num_preemptions
        self.verify_steps, self.verify_replays, self.proposed, self.accepted, self.prefix_hits = 0, 0, 0, 0, 0
        self._stats_before = self.llm.stats()

    def finish(self) -> None:
        self.preemptions = self.scheduler.num_preemptions - self._preemptions_before
        after = self.llm.stats()
        # verify steps are launched apart (``launch_verify``): counted from the engine's statistics
        self.verify_steps = after.spec_verify_steps - self._stats_before.spec_verify_steps
        self.proposed = after.spec_draft_tokens - self._stats_before.spec_draft_tokens
        self.accepted = after.spec_accepted_tokens - self._stats_before.spec_accepted_tokens
        self.prefix_hits = after.prefix_cache_hits - self._stats_before.prefix_cache_hits


def assert_idle(llm: tscompile.LLM, where: str) -> None:
    """Nothing of a finished ``generate`` is left: no request, every slot and block free (each once)."""
    sched = llm.scheduler
    problems = []
    if llm.has_unfinished() or sched.running or sched.waiting:
        problems.append(f"unfinished: waiting={len(sched.waiting)} running={len(sched.running)} "
                        f"in flight={llm._inflight is not None}")
    if llm._requests:  # the engine's live-request map: a finished request left in it is a leak
        problems.append(f"requests still tracked: {sorted(llm._requests)}")
    if sorted(sched.free_slots) != list(range(sched.max_num_seqs)):
        problems.append(f"free slots {sorted(sched.free_slots)} of {sched.max_num_seqs}")
    for alloc, table in zip(sched.allocators, sched.block_tables):
        alloc.check()  # every block held, free or cached-free exactly once
        free = alloc.free_block_ids()  # sorted ids (free or cached), not a count: a double free must not hide a leak
        if free != list(range(1, alloc.num_blocks)):
            problems.append(f"group {alloc.group_name!r}: free blocks {free} of 1..{alloc.num_blocks - 1}")
        if table.any():
            problems.append(f"group {alloc.group_name!r}: block table rows not cleared")
    if problems:
        raise AssertionError(f"{where}: the engine is not idle after generate: " + "; ".join(problems))


# -- running and checking ----------------------------------------------------------------------------
Result = tuple[tuple[int, ...], str]  # (token ids, finish reason) of one request


def results(outputs) -> list[Result]:
    return [(tuple(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outputs]


def run_batched(llm: tscompile.LLM, comp: Composition, where: str, log: StepLog | None = None) -> list[Result]:
    if log is not None:
        log.reset()
    got = results(llm.generate([list(p) for p in comp.prompts], list(comp.params)))
    if log is not None:
        log.finish()
    assert_idle(llm, where)
    return got


def run_one_at_a_time(llm: tscompile.LLM, comp: Composition, where: str) -> list[Result]:
    out = []
    for p, sp in zip(comp.prompts, comp.params):
        out += results(llm.generate([list(p)], sp))
        assert_idle(llm, where)
    return out


def preview_on(llm: tscompile.LLM) -> Preview:
    def preview(prompt, params):
        out = llm.generate([list(prompt)], replace(params, stop_token_ids=()))
        assert_idle(llm, "preview")
        return list(out[0].outputs[0].token_ids)
    return preview


def mismatch(comp: Composition, spec: EngineSpec, what: str, want: list[Result], got: list[Result]) -> str | None:
    """None when equal, else a message with the composition, so the failure can be replayed."""
    if want == got:
        return None
    lines = [f"{what} differ on engine {spec.name} ({spec})", comp.describe()]
    for i, (w, g) in enumerate(zip(want, got)):
        if w != g:
            lines.append(f"  request {i}: expected {list(w[0])} ({w[1]}), got {list(g[0])} ({g[1]})")
    return "\n".join(lines)


@dataclass
class Coverage:
    """How many compositions exercised each feature: a harness that silently stops covering one
    fails its coverage assertion instead."""

    counts: collections.Counter = field(default_factory=collections.Counter)

    def record(self, log: StepLog, comp: Composition, got: list[Result]) -> None:
        c = self.counts
        c["compositions"] += 1
        c["requests"] += len(comp.prompts)
        c["queued"] += log.queued
        c["chunked"] += log.chunked
        c["mixed"] += log.mixed
        c["preempted"] += log.preemptions > 0
        c["preemptions"] += log.preemptions
        c["stop_fired"] += any(reason == "stop" for _, reason in got)
        c["stop_requests"] += sum(bool(sp.stop_token_ids) for sp in comp.params)
        c["sampled_requests"] += sum(not sp.greedy for sp in comp.params)
        c["min_tokens_requests"] += sum(sp.min_tokens > 0 for sp in comp.params)
        c["tokens"] += sum(len(t) for t, _ in got)
        c["verified"] += log.verify_steps > 0
        c["verify_steps"] += log.verify_steps
        c["accepted_drafts"] += log.accepted
        c["rejected_drafts"] += log.proposed - log.accepted
        c["verify_replays"] += log.verify_replays
        c["verified_and_preempted"] += log.verify_steps > 0 and log.preemptions > 0
        # hits on a prefix the prompts share (a preempted request re-admitting its own blocks hits too)
        c["verified_with_shared_prefix_hits"] += (log.verify_steps > 0 and log.prefix_hits > 0
                                                  and comp.shared_prefix_len >= comp.page_size)

    def merge(self, other: "Coverage") -> None:
        self.counts.update(other.counts)


# an extra check of a batched run: (engine, composition, its results, the graph counters the run
# moved, its step log) -> None or a failure message
ExtraCheck = Callable[[tscompile.LLM, Composition, list[Result], dict, StepLog], "str | None"]
GRAPH_COUNTERS = ("decode_replays", "decode_captures", "prefill_replays", "prefill_captures", "decode_eager",
                  "prefill_graphed")


def graph_counters_since(before: dict) -> dict:
    return {k: counters[k] - before.get(k, 0) for k in GRAPH_COUNTERS}


def graph_runners(llm: tscompile.LLM) -> list:
    """Every ``GraphRunner`` a step of ``llm`` may replay: the engine's, and a draft model's (its own
    engine parts, graphed as the target); their replays share the global counters."""
    runners = [llm.runner.graphs]
    drafter = getattr(getattr(llm, "_verify", None), "drafter", None)
    parts = getattr(getattr(drafter, "runner", None), "parts", None)
    if parts is not None:
        runners.append(parts.runner.graphs)
    return [g for g in runners if g is not None]


class GraphCheck:
    """Reruns a composition on the same engine with its graph replay off (``runner.graphs.replay =
    False``, the one switch: the same ladder padding, the same persistent buffers and metadata
    refresh, the same compiled steps, launched without their graphs) and compares the tokens.

    It refuses to pass vacuously: an engine without a graph runner, a batched run that replayed no
    graph, or a graphs-off run in which any graph replayed or captured is a failure."""

    def __init__(self):
        self.compositions = 0
        self.graphs_on = collections.Counter()  # what the batched runs (graphs on) replayed and captured
        self.graphs_off = collections.Counter()  # what the reruns moved: only steps, never a replay

    def __call__(self, llm, comp, got, ran: dict, log: StepLog | None = None):
        runners = graph_runners(llm)
        if llm.runner.graphs is None:
            return f"{llm.fuzz_name} has no graph runner: the graph check cannot run\n{comp.describe()}"
        if ran["decode_replays"] + ran["prefill_replays"] == 0:
            return f"the batched run replayed no graph ({ran}): nothing to compare\n{comp.describe()}"
        if log is not None and log.verify_steps and not log.verify_replays:
            return f"the batched run's {log.verify_steps} verify steps replayed no (bs, N) graph\n{comp.describe()}"
        before = dict(counters)
        for graphs in runners:
            graphs.replay = False
        # the batched run cached these prompts' blocks: a rerun that hits them computes only the
        # suffixes, other shapes that round differently in bfloat16, so it starts from the same
        # empty cache (the Fuzzer empties it before the batched run too)
        llm.scheduler.reset_prefix_cache()
        try:
            plain = run_batched(llm, comp, "graphs off")
        finally:
            for graphs in runners:
                graphs.replay = True
        delta = graph_counters_since(before)
        self.compositions += 1
        self.graphs_on.update(ran)
        self.graphs_off.update(delta)
        if delta["decode_replays"] or delta["prefill_replays"] or delta["decode_captures"] or delta["prefill_captures"]:
            return f"graphs off, yet {delta} happened: the switch did not hold\n{comp.describe()}"
        if plain != got:
            lines = [f"graph replay and the run without graphs at the same padded size differ on {llm.fuzz_name}",
                     comp.describe()]
            for i, (g, p) in enumerate(zip(got, plain)):
                if g != p:
                    lines.append(f"  request {i}: graphs {list(g[0])} ({g[1]}), without {list(p[0])} ({p[1]})")
            return "\n".join(lines)
        return None


class Fuzzer:
    """One pressured engine, its oracle, and the loop over seeds.

    ``make_engine(spec)`` builds an engine (device, dtype, backend and compile settings are the
    caller's). The reference engine of a "single" oracle is built once (or passed in, to share it)
    and reused, as is the pressured one; a "fresh" oracle builds a new engine per composition.
    Stop ids are previewed on the reference engine, or on the pressured one when there is none.
    ``extra`` runs after the oracle agreed (the GPU script's graph check)."""

    def __init__(self, spec: EngineSpec, make_engine: Callable[[EngineSpec], tscompile.LLM],
                 reference: tscompile.LLM | None = None, extra: ExtraCheck | None = None):
        self.spec, self.make_engine, self.extra = spec, make_engine, extra
        self.llm = make_engine(spec)
        self.log = StepLog(self.llm)
        if reference is None and spec.oracle == "single":
            reference = make_engine(reference_spec(spec.model, spec.page_size))
        self.reference = reference
        self.coverage = Coverage()

    def draw(self, seed: int) -> Composition:
        speculative = self.spec.speculative_config is not None
        # with speculation, sampled requests only where the oracle is the same engine afresh
        return draw_composition(seed, self.spec.page_size, self.llm.config.vocab_size,
                                preview_on(self.reference or self.llm), speculative,
                                sampled=not speculative or self.spec.oracle == "fresh")

    def check(self, seed: int) -> str | None:
        """Run composition ``seed``; returns None or a failure message (never raises for a mismatch,
        so a run can report every failing seed)."""
        comp = None
        try:
            comp = self.draw(seed)
            if self.extra is not None or (self.spec.oracle == "fresh" and self.spec.method is not None):
                # the extra check reruns the composition on an empty prefix cache too; with speculation a
                # fresh engine is the oracle of sampled requests, whose tokens depend on which steps
                # verified, so the reused engine schedules from the same empty cache
                self.llm.scheduler.reset_prefix_cache()
            want = None
            if self.spec.method == "replay":  # the drafts replay each prompt's greedy tokens alone
                want = run_one_at_a_time(self.reference, comp, "reference")
                self.llm.set_replay_references({p: list(w[0]) for p, w in zip(comp.prompts, want)})
            before = dict(counters)
            got = run_batched(self.llm, comp, f"{self.spec.name} batched", self.log)
            ran = graph_counters_since(before)
            self.coverage.record(self.log, comp, got)
            failure = None
            if self.spec.oracle == "single":
                if want is None:
                    want = run_one_at_a_time(self.reference, comp, "reference")
                failure = mismatch(comp, self.spec, "batched and one-at-a-time outputs", want, got)
            elif self.spec.oracle == "fresh":
                want = run_batched(self.make_engine(self.spec), comp, f"{self.spec.name} fresh")
                failure = mismatch(comp, self.spec, "outputs of the reused engine and a fresh one", want, got)
            if failure is None and self.extra is not None:
                failure = self.extra(self.llm, comp, got, ran, self.log)
            return failure
        except Exception as e:  # an engine error is a finding too: keep the composition with it
            where = comp.describe() if comp is not None else f"composition seed={seed} (not drawn)"
            return f"{type(e).__name__} on engine {self.spec.name}: {e}\n{where}\n{traceback.format_exc()}"
