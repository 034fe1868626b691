"""The eager engine end to end on the CPU: correctness against a dense reference, batching,
chunking, mixed steps and refusals."""

import pytest
import torch

from tscompile import SamplingParams
from tscompile.forward_context import ForwardMode

from helpers import PROMPTS, record_modes, small_llm, ids
from reference import dense_greedy

def make_llm(model="llama-tiny", **kw):
    kw.setdefault("dtype", torch.float64)
    kw.setdefault("enforce_eager", True)  # compiled paths: tests/test_compile.py
    return small_llm(model, **kw)


@pytest.mark.parametrize("model", ["llama-tiny", "narrow-tiny"])
def test_greedy_matches_dense_reference(model):
    llm = make_llm(model)
    out = ids(llm.generate(PROMPTS, SamplingParams(max_new_tokens=6)))
    for prompt, got in zip(PROMPTS, out):
        assert got == dense_greedy(llm.model, prompt, 6)


def test_rope_tables_hold_max_model_len_positions_and_a_request_filling_it_matches_full_tables():
    """The engine sizes its own model's RoPE tables to max_model_len (the rest of a 131072-position
    table would be dead memory); a request that fills max_model_len must still match a reference
    model that keeps the full tables, and a caller's model with shorter tables is refused."""
    import tscompile.models

    llm = make_llm(max_model_len=40)
    full = tscompile.models.build_model("llama-tiny", dtype=torch.float64)
    assert full.rope_cos.shape[0] == full.config.max_position > 40
    assert llm.model.rope_cos.shape == llm.model.rope_sin.shape == (40, full.config.head_dim // 2)
    assert torch.equal(llm.model.rope_cos, full.rope_cos[:40]) and torch.equal(llm.model.rope_sin, full.rope_sin[:40])
    prompt = [(7 * i) % 200 + 1 for i in range(30)]
    got = ids(llm.generate([prompt], SamplingParams(max_new_tokens=10, ignore_eos=True)))[0]
    assert got == dense_greedy(full, prompt, 10)  # positions 0..38: the table's last row is never needed
    with pytest.raises(ValueError, match=r"^tscompile: RoPE tables of 0 positions"):
        full.reset_rope("cpu", 0)
    with pytest.raises(ValueError, match=r"^tscompile: RoPE tables of .* expected 1 to the model's max_position"):
        full.reset_rope("cpu", full.config.max_position + 1)
    full.reset_rope("cpu", 32)
    with pytest.raises(ValueError, match=r"^tscompile: the model's RoPE tables hold 32 positions, fewer than "
                                         r"max_model_len 40; call model.reset_rope"):
        make_llm(full, max_model_len=40)
    assert make_llm(full, max_model_len=32).model.rope_cos.shape[0] == 32  # a caller's model is never resized


@pytest.mark.parametrize("model", ["llama-tiny", "narrow-tiny"])
@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=7),
                                    SamplingParams(max_new_tokens=7, temperature=0.9, top_k=20, top_p=0.9, seed=3)])
def test_batched_equals_one_request_at_a_time(model, params):
    llm = make_llm(model, dtype=torch.float32)
    batched = ids(llm.generate(PROMPTS, params))
    single = [ids(llm.generate([p], params))[0] for p in PROMPTS]
    assert batched == single
    assert all(len(o) == 7 for o in batched)


@pytest.mark.parametrize("page_size,pages_per_block", [(1, 1), (4, 2), (16, 1), (64, 1)])
def test_page_geometry_does_not_change_tokens(page_size, pages_per_block):
    ref = ids(make_llm(page_size=8).generate(PROMPTS, SamplingParams(max_new_tokens=5)))
    got = ids(make_llm(page_size=page_size, pages_per_block=pages_per_block).generate(PROMPTS, SamplingParams(max_new_tokens=5)))
    assert got == ref


def test_chunked_prefill_equals_unchunked_and_mixes_steps():
    unchunked = ids(make_llm().generate(PROMPTS, SamplingParams(max_new_tokens=6)))
    llm = make_llm(max_num_batched_tokens=5)
    modes = record_modes(llm)
    chunked = ids(llm.generate(PROMPTS, SamplingParams(max_new_tokens=6)))
    assert chunked == unchunked
    assert ForwardMode.MIXED in modes and ForwardMode.DECODE in modes and ForwardMode.EXTEND in modes


def test_narrowing_model_chunked_prefill_matches_dense_with_open_chunk_rows():
    """An open chunk keeps its last row in the tail group; the dense reference is told so."""
    from reference import dense_last_logits
    llm = make_llm("narrow-tiny", max_num_batched_tokens=4, max_num_seqs=1)
    prompt = PROMPTS[2]  # 19 tokens -> chunks of 4: open chunks end at 3, 7, 11, 15; the last keeps W=4 rows
    out = ids(llm.generate([prompt], SamplingParams(max_new_tokens=4)))
    kept = [3, 7, 11, 15, 15, 16, 17, 18]
    kept = sorted(set(kept))  # the last chunk (16..18) completes: keeps min(4, 3) rows
    tokens, expect = list(prompt), []
    for _ in range(4):
        nxt = int(dense_last_logits(llm.model, tokens, kept).argmax())
        expect.append(nxt)
        kept.append(len(tokens))
        tokens.append(nxt)
    assert out[0] == expect


REFUSALS = [
    ([], SamplingParams(max_new_tokens=2), r"tscompile: (prompts=\[\] holds no prompt|prompt 1 is empty)"),
    ([1, 2, 512], SamplingParams(max_new_tokens=2), r"tscompile: token id 512 outside the vocabulary \[0, 512\)"),
    ([1, -1], SamplingParams(max_new_tokens=2), r"tscompile: token id -1 outside"),
    ([1] * 60, SamplingParams(max_new_tokens=8), r"tscompile: prompt \(60\) \+ max_new_tokens \(8\) = 68 exceeds max_model_len 64"),
]


@pytest.mark.parametrize("prompt,params,msg", REFUSALS)
def test_refusal_leaves_a_concurrent_request_unchanged(prompt, params, msg):
    alone = ids(make_llm().generate([PROMPTS[0]], SamplingParams(max_new_tokens=6)))[0]
    llm = make_llm()
    req = llm.add_request(PROMPTS[0], SamplingParams(max_new_tokens=6))
    llm.step()
    llm.step()
    with pytest.raises(ValueError, match=msg):
        llm.add_request(prompt, params)
    with pytest.raises(ValueError, match=msg):
        ids(llm.generate([PROMPTS[1], prompt], [SamplingParams(max_new_tokens=2), params]))
    # right after the refusal: nothing of the refused call is queued or running
    assert not llm.scheduler.waiting and llm.scheduler.running == [req]
    while llm.has_unfinished():
        llm.step()
    assert req.output == alone


def test_pool_too_small_is_refused_and_exhaustion_waits():
    llm = make_llm(num_pages=9, page_size=4)  # 8 usable pages = 32 tokens per request at most
    with pytest.raises(ValueError, match=r"tscompile: page pool too small: the request needs 10 blocks .* has 8"):
        llm.add_request([1] * 30, SamplingParams(max_new_tokens=8))
    # two requests that each fit alone but not together run one after the other, unchanged
    a, b = [3] * 20, [4] * 18
    expect = [ids(make_llm().generate([p], SamplingParams(max_new_tokens=6)))[0] for p in (a, b)]
    assert ids(llm.generate([a, b], SamplingParams(max_new_tokens=6))) == expect


def test_bad_sampling_params_are_refused():
    with pytest.raises(ValueError, match=r"tscompile: top_p=0.0 must be a finite real number in \(0, 1\]"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="tscompile: max_new_tokens=0 must be an int >= 1"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="tscompile: unknown attention backend 'nope'; known"):
        make_llm(attention_backend="nope")
    with pytest.raises(ValueError, match="tscompile: unknown model preset"):
        make_llm("gpt-17")


@pytest.mark.parametrize("model, enforce_eager", [("llama-tiny", True), ("narrow-tiny", True), ("narrow-tiny", False)])
def test_async_scheduling_gives_the_tokens_of_synchronous_steps(model, enforce_eager):
    """Ragged prompts and lengths, greedy and sampled rows, a request arriving mid-decode and chunked
    prompts: launching each decode before reading the previous step's tokens changes no token.
    Compiled, only narrow-tiny runs: its first layers are llama-tiny's, so it covers the compiled
    llama step's chained decode as well (llama-tiny's own async path runs here eagerly)."""
    from tscompile.counters import counters

    params = [SamplingParams(max_new_tokens=n, temperature=t, top_k=20, seed=i)
              for i, (n, t) in enumerate([(7, 0.0), (3, 0.8), (9, 0.0), (5, 1.1)])]

    def run(async_scheduling):
        llm = make_llm(model, dtype=torch.float32, enforce_eager=enforce_eager, max_num_batched_tokens=12,
                       async_scheduling=async_scheduling)
        reqs = [llm.add_request(p, sp) for p, sp in zip(PROMPTS[:3], params)]
        for _ in range(4):
            llm.step()
        reqs.append(llm.add_request(PROMPTS[3], params[3]))
        while llm.has_unfinished():
            llm.step()
        return [r.output for r in reqs]

    sync = run(False)
    counters.clear()
    assert run(True) == sync
    assert counters["decode_chained"] > 0  # the device gather was exercised, not bypassed
    assert [len(o) for o in sync] == [7, 3, 9, 5]


def test_step_returns_a_request_once_its_last_token_is_read_back():
    llm = make_llm(async_scheduling=True)
    req = llm.add_request(PROMPTS[0], SamplingParams(max_new_tokens=3))
    assert llm.step() == []  # the prefill is launched; its token is not read yet
    assert req.num_generated == 1 and len(req.output) == 0
    assert llm.step() == [] and len(req.output) == 1  # read while the first decode is launched
    assert llm.step() == []  # the last decode launched: scheduling-finished, not read back
    assert req.finished and len(req.output) == 2 and llm.has_unfinished()
    assert llm.step() == [req] and len(req.output) == 3 and not llm.has_unfinished()
    assert req.output == ids(make_llm(async_scheduling=False).generate([PROMPTS[0]], SamplingParams(max_new_tokens=3)))[0]


def test_a_failed_launch_loses_no_finished_request_and_a_retry_gives_the_same_tokens():
    """A launch that raises after the step before it was read back: the request that step finished is
    returned by a later step, the scheduler is untouched, and retrying gives the tokens of a clean run."""
    params = [SamplingParams(max_new_tokens=1), SamplingParams(max_new_tokens=4)]
    clean = ids(make_llm().generate(PROMPTS[:2], params))
    llm = make_llm()
    short = llm.add_request(PROMPTS[0], params[0])
    assert llm.step() == []  # both prefills would fit, but only the first prompt is queued yet
    other = llm.add_request(PROMPTS[1], params[1])
    real = llm.runner.launch
    calls = []

    def fail_once(*a):
        if not calls:
            calls.append(1)
            raise RuntimeError("injected")
        return real(*a)

    llm.runner.launch = fail_once
    with pytest.raises(RuntimeError, match="injected"):
        llm.step()  # an extend step: it read the first step back, then failed to launch
    assert other.num_computed == 0 and other.num_generated == 0
    returned = []
    while llm.has_unfinished():
        returned += llm.step()
    assert [r.rid for r in returned] == [short.rid, other.rid]
    assert [short.output, other.output] == clean


def test_a_direct_runner_call_with_a_token_still_on_the_device_is_refused():
    llm = make_llm()
    ids(llm.generate([PROMPTS[0]], SamplingParams(max_new_tokens=2)))
    req = llm.add_request(PROMPTS[1], SamplingParams(max_new_tokens=5))
    llm.step()  # the prefill: its token is not read back
    plan = llm.scheduler.schedule()
    with pytest.raises(RuntimeError, match=r"tscompile: request \d+'s last token is still on the device; call "
                                           r"LLM.sync\(\)"):
        llm.runner.execute(plan)
    llm.sync()
    assert len(req.output) == 1
    llm.runner.execute(llm.scheduler.resolve_host_tokens(plan))  # now the host has the token


def test_a_launch_between_engine_steps_breaks_the_chain_instead_of_reading_the_clobbered_buffer():
    """Anything launched between two engine steps overwrites the sampled-token buffer: the next decode
    waits for the step in flight and takes its tokens from the host instead of the buffer."""
    from tscompile.counters import counters

    params = SamplingParams(max_new_tokens=6)
    clean = ids(make_llm().generate(PROMPTS[:2], params))
    llm = make_llm()
    reqs = [llm.add_request(p, params) for p in PROMPTS[:2]]
    for _ in range(3):
        llm.step()  # decodes in flight, each chained to the one before
    llm.runner.sampling.tokens.fill_(7)  # what a side launch would leave in the buffer...
    llm.runner.launches += 1  # ...and count
    counters.clear()
    llm.step()
    assert counters["decode_chained"] == 0  # this step waited instead of gathering
    while llm.has_unfinished():
        llm.step()
    assert [r.output for r in reqs] == clean


def test_token_readback_keeps_a_handles_tokens_when_its_buffer_is_reused():
    from tscompile.runtime.readback import TokenReadback

    rb = TokenReadback(8, torch.device("cpu"))
    values = [torch.randint(0, 1000, (n,)) for n in (5, 3, 8)]
    handles = [rb.start(v) for v in values]  # the third reuses the first's buffer
    assert [h.wait() for h in handles] == [v.tolist() for v in values]


def test_a_running_request_no_step_serves_is_an_error_not_a_spin(monkeypatch):
    llm = make_llm()
    llm.add_request(PROMPTS[0], SamplingParams(max_new_tokens=4))
    llm.step()
    monkeypatch.setattr(llm.scheduler, "schedule", lambda: None)  # a scheduler bug: nothing planned
    with pytest.raises(RuntimeError, match="tscompile: no step could be scheduled for 1 running request"):
        llm.step()


PREEMPT_PROMPTS = [[(5 * i + j) % 400 + 1 for j in range(n)] for i, n in enumerate([9, 3, 14, 6, 11, 2])]


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=20),
                                    SamplingParams(max_new_tokens=20, temperature=0.9, top_k=30, seed=5)])
def test_preemption_gives_the_tokens_of_an_ample_pool(async_scheduling, params):
    """12 pages of 4 tokens for six requests that grow to 22-34 tokens: blocks run out again and
    again; the most recently admitted request is preempted and recomputed, and every request still
    gets exactly the tokens it gets with a pool that holds them all."""
    ample = make_llm(max_num_seqs=6)
    want = ids(ample.generate(PREEMPT_PROMPTS, params))
    assert ample.scheduler.num_preemptions == 0
    llm = make_llm(max_num_seqs=6, num_pages=12, async_scheduling=async_scheduling)
    assert ids(llm.generate(PREEMPT_PROMPTS, params)) == want
    assert llm.scheduler.num_preemptions >= 3
    assert all(a.num_free == a.num_blocks - 1 for a in llm.scheduler.allocators)


def test_blocks_are_allocated_as_requests_grow():
    llm = make_llm(page_size=4)
    req = llm.add_request([3] * 9, SamplingParams(max_new_tokens=20))
    llm.step()  # the prefill: the prompt's 9 tokens and the first new one, 3 blocks (not 29 tokens' 8)
    assert len(req.blocks[0]) == 3
    for _ in range(6):
        llm.step()
    llm.sync()
    assert len(req.blocks[0]) == -(-(req.num_computed + 1) // 4)


def test_the_narrowing_model_reserves_at_admission_and_is_never_preempted():
    params = SamplingParams(max_new_tokens=20)
    want = ids(make_llm("narrow-tiny", max_num_seqs=6).generate(PREEMPT_PROMPTS, params))
    llm = make_llm("narrow-tiny", max_num_seqs=6, num_pages=20)
    req = llm.add_request(PREEMPT_PROMPTS[0], params)
    llm.step()
    assert len(req.blocks[0]) == -(-(len(PREEMPT_PROMPTS[0]) + 20) // 4)  # every block it can need
    llm.sync()
    while llm.has_unfinished():
        llm.step()
    assert ids(llm.generate(PREEMPT_PROMPTS, params)) == want and llm.scheduler.num_preemptions == 0
