"""The replay and draft-model drafters in the engine: greedy output with speculation equals plain
greedy decode token for token (float32, CPU), on mixed chunked batches, under preemption, with a stop
token inside an accepted run, eager and compiled; the draft model's own KV is rolled back by counter."""

from __future__ import annotations

import pytest
import torch

import tscompile
from tscompile.models import build_model
from tests.helpers import ids, small_llm

# repetitive prompts, a short one, and lengths that chunk under a small budget
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3], [9, 8, 7],
           [11, 12, 11, 12, 11, 12, 13, 11, 12, 11, 12, 11]]
REPLAY = {"method": "replay", "num_speculative_tokens": 3}
# the target drafting for itself (every draft accepted: the draft cache stays in step)
SELF_DRAFT = {"method": "draft_model", "num_speculative_tokens": 3, "model": "llama-tiny"}
METHODS = {"replay": REPLAY, "draft_model": SELF_DRAFT}


def _greedy(n: int, **kw) -> tscompile.SamplingParams:
    return tscompile.SamplingParams(max_new_tokens=n, temperature=0.0, **kw)


def _run(config, prompts, params, want=None, **kw):
    """``prompts`` through a float32 engine with ``config``; a replay engine replays ``want``."""
    kw.setdefault("dtype", torch.float32)
    kw.setdefault("enforce_eager", True)
    llm = small_llm(speculative_config=config, **kw)
    if config["method"] == "replay":
        llm.set_replay_references({tuple(p): w for p, w in zip(prompts, want)})
    return llm, ids(llm.generate(prompts, params))


@pytest.mark.parametrize("method", sorted(METHODS))
def test_greedy_equals_plain_decode_on_mixed_chunked_batches(method):
    params = [_greedy(n) for n in (14, 9, 5, 12)]  # max_new_tokens ends requests at different steps
    want = ids(small_llm(dtype=torch.float32, enforce_eager=True, max_num_batched_tokens=8).generate(PROMPTS, params))
    llm, got = _run(METHODS[method], PROMPTS, params, want, max_num_batched_tokens=8)
    assert got == want
    stats = llm.stats()
    assert stats.spec_verify_steps > 0
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0  # these drafters propose the target's tokens


@pytest.mark.parametrize("method", sorted(METHODS))
def test_stop_token_inside_an_accepted_run_ends_the_request_there(method):
    free = ids(small_llm(dtype=torch.float32, enforce_eager=True).generate(PROMPTS[:2], _greedy(16)))
    for prompt, out in zip(PROMPTS[:2], free):
        stop = out[len(out) // 2]
        _, got = _run(METHODS[method], [prompt], _greedy(16, stop_token_ids=[stop]), [out])
        assert got == [out[: out.index(stop) + 1]]


@pytest.mark.parametrize("method", sorted(METHODS))
def test_greedy_equals_plain_decode_under_preemption(method):
    kw = dict(num_pages=14, max_num_seqs=4, page_size=4)
    want = ids(small_llm(dtype=torch.float32, enforce_eager=True, **kw).generate(PROMPTS, _greedy(14)))
    llm, got = _run(METHODS[method], PROMPTS, _greedy(14), want, **kw)
    assert got == want
    assert llm.stats().num_preemptions > 0 and llm.stats().spec_verify_steps > 0


@pytest.mark.parametrize("method", sorted(METHODS))
def test_compiled_engine_equals_plain_decode(method):
    want = ids(small_llm(dtype=torch.float32, enforce_eager=True, max_num_seqs=2).generate(PROMPTS[:2], _greedy(8)))
    llm, got = _run(METHODS[method], PROMPTS[:2], _greedy(8), want, enforce_eager=False, max_num_seqs=2)
    assert got == want and llm.stats().spec_verify_steps > 0


def test_a_draft_model_with_other_weights_is_rejected_and_rolled_back():
    """A target with other random weights than the draft: drafts are mostly rejected, the draft
    cache's rejected rows are written over by counter, and the output is still plain greedy's."""
    plain_model = build_model("llama-tiny", seed=1)
    want = ids(small_llm(plain_model, dtype=torch.float32, enforce_eager=True).generate(PROMPTS, _greedy(12)))
    target = build_model("llama-tiny", seed=1)
    llm = small_llm(target, dtype=torch.float32, enforce_eager=True, speculative_config=SELF_DRAFT)
    assert ids(llm.generate(PROMPTS, _greedy(12))) == want
    stats = llm.stats()
    assert stats.spec_verify_steps > 0 and stats.spec_accepted_tokens < stats.spec_draft_tokens
    drafter = llm._verify.drafter
    assert drafter.cached == {} and drafter.runner._rows == {}  # finished requests released their draft cache
    assert drafter.runner.allocator.num_free == drafter.runner.allocator.num_blocks - 1


def test_replay_without_references_drafts_nothing_and_set_replay_references_needs_replay():
    llm = small_llm(dtype=torch.float32, enforce_eager=True, speculative_config=REPLAY)
    want = ids(small_llm(dtype=torch.float32, enforce_eager=True).generate(PROMPTS[:1], _greedy(6)))
    assert ids(llm.generate(PROMPTS[:1], _greedy(6))) == want
    assert llm.stats().spec_draft_tokens == 0
    with pytest.raises(ValueError, match=r"^tscompile: set_replay_references needs speculative_config method='replay'"):
        small_llm(dtype=torch.float32, enforce_eager=True).set_replay_references({})


def test_draft_model_on_real_weights_equals_plain_decode():
    """SmolLM2-135M drafting for itself, float32: every draft accepted, the tokens of plain decode."""
    from tests.real_weights import checkpoint_or_skip

    path = str(checkpoint_or_skip())
    kw = dict(enforce_eager=True, device="cpu", attention_backend="torch", dtype=torch.float32, max_model_len=128,
              max_num_seqs=1, page_size=16)
    prompt = list(range(100, 124))
    params = tscompile.SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    plain = ids(tscompile.LLM(path, **kw).generate([prompt], params))
    spec = tscompile.LLM(path, speculative_config={"method": "draft_model", "num_speculative_tokens": 3,
                                                   "model": path}, **kw)
    assert ids(spec.generate([prompt], params)) == plain
    assert spec.stats().spec_accepted_tokens == spec.stats().spec_draft_tokens > 0


def test_verify_steps_run_through_the_decode_graphs_per_batch_size_and_width():
    """Host graphs on the CPU: a verify step pads to the decode ladder and replays the graph keyed
    (bs, bs * N, N); the tokens equal plain greedy decode's."""
    from tscompile.runtime.graph_runner import HostGraphs

    params = [_greedy(n) for n in (12, 9, 15)]
    want = ids(small_llm(dtype=torch.float32, enforce_eager=True).generate(PROMPTS[:3], params))
    llm = small_llm(dtype=torch.float32, enforce_eager=True, speculative_config=REPLAY)
    llm.runner.use_graphs(HostGraphs())
    llm.set_replay_references({tuple(p): w for p, w in zip(PROMPTS, want)})
    assert ids(llm.generate(PROMPTS[:3], params)) == want
    keys = {(k.batch_size, k.tokens, k.width) for k in llm.runner.graphs.graphs if k.width > 1}
    assert (4, 16, 4) in keys and keys <= {(1, 4, 4), (2, 8, 4), (4, 16, 4)}  # 3 requests pad to 4


def test_verify_graph_memory_counts_every_window_row():
    from tscompile.runtime.memory import verify_graph_bytes

    assert verify_graph_bytes(32, 1, 128256, 4096, 2) == 0  # plain decode: the decode margin covers it
    four = verify_graph_bytes(32, 4, 128256, 4096, 2)
    assert four == 2 * verify_graph_bytes(16, 4, 128256, 4096, 2) > 32 * 4 * 128256 * 4


def test_staging_of_width_one_keeps_the_plain_layout_and_a_wider_one_stages_windows():
    """Width 1: the plain decode layout (ids, positions, seeds, steps, prev rows, bans), nothing
    more; width 3: ``bs * 3`` ids and positions and the drafts, padding requests without drafts."""
    import numpy as np

    from tscompile.runtime.staging import DecodeStaging
    from tscompile.spec_decode.verify import verify_plan

    cpu = torch.device("cpu")
    plain = DecodeStaging(4, 1, 5, 3, cpu)
    base = plain.d64.data_ptr()
    offsets = [(t.data_ptr() - base) // 8 for t in (plain.positions, plain.sampling_inputs.seeds,
                                                     plain.sampling_inputs.steps, plain.prev_rows,
                                                     plain.sampling_inputs.banned)]
    assert offsets == [4, 8, 12, 16, 20] and plain.d64.numel() == 20 + 4 * 3 and plain.drafts.numel() == 0

    llm = small_llm(dtype=torch.float32, enforce_eager=True)
    wide = DecodeStaging(4, 1, llm.scheduler.max_blocks, llm.scheduler.banned_width, cpu, max_width=3)
    llm.add_request([3, 4, 5], _greedy(4))
    llm.add_request([6, 7], _greedy(4))
    llm.step()
    llm.sync()
    plan = llm.scheduler.schedule()
    reqs = [llm._requests[rid] for rid in plan.request_ids]
    window = np.array([[r.output[-1], 10 + i, -1] for i, r in enumerate(reqs)])
    start = np.array([r.num_computed for r in reqs])
    tables = llm.scheduler.block_tables[0].take([r.slot for r in reqs], 0)
    verify = verify_plan(plan, window, start, tables)
    assert verify.verify_width == 3 and verify.draft_tokens.tolist() == [[10, -1], [11, -1]]
    wide.fill_verify(verify, 4)
    wide.upload()
    assert wide.input_ids[:12].tolist() == [reqs[0].output[-1], 10, 0, reqs[1].output[-1], 11, 0] + [0] * 6
    assert wide.positions[:6].tolist() == [3, 4, 5, 2, 3, 4]
    assert wide.drafts[:8].tolist() == [10, -1, 11, -1, -1, -1, -1, -1]
    assert wide.decode_inputs(2).seq_lens[0].tolist() == [6, 5]


def test_draft_runner_steps_through_its_engine_equal_the_argmax_of_its_logits():
    """``next_tokens`` (the draft engine's runner: an extend step, then decode steps) picks the
    argmax of ``forward``'s logits, over the same draft cache rows."""
    import numpy as np

    llm = small_llm(dtype=torch.float32, enforce_eager=True, speculative_config=SELF_DRAFT)
    runner = llm._verify.drafter.runner
    feed = [np.array(p, dtype=np.int64) for p in PROMPTS[:3]]
    starts = np.zeros(3, dtype=np.int64)
    want = torch.argmax(runner.forward(["a", "b", "c"], feed, starts), -1).tolist()
    assert runner.next_tokens(["a", "b", "c"], feed, starts).tolist() == want
    starts = np.array([len(p) for p in PROMPTS[:3]])
    step = [np.array([t]) for t in want]
    want = torch.argmax(runner.forward(["a", "b", "c"], step, starts), -1).tolist()
    assert runner.next_tokens(["a", "b", "c"], step, starts).tolist() == want  # a decode step


def test_sampled_requests_with_a_draft_model_replay_the_sampled_verify_graph():
    """A sampled request makes the step a rejection-sampling step: its graph (greedy=False) is
    captured on first use; seeded draws repeat, and a temperature-0 row is still plain greedy."""
    from tscompile.runtime.graph_runner import HostGraphs

    sampled = tscompile.SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9, seed=3)
    params = [_greedy(8), sampled]
    llm = small_llm(dtype=torch.float32, enforce_eager=True, speculative_config=SELF_DRAFT)
    llm.runner.use_graphs(HostGraphs())
    first = ids(llm.generate(PROMPTS[:2], params))
    assert first == ids(llm.generate(PROMPTS[:2], params))
    assert first[0] == ids(small_llm(dtype=torch.float32, enforce_eager=True).generate(PROMPTS[:1], _greedy(8)))[0]
    assert any(not k.greedy and k.width == 4 for k in llm.runner.graphs.graphs)
    assert len(first[1]) == 8 and llm.stats().spec_accepted_tokens > 0
