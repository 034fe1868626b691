"""Speculative decoding on the host: the settings (every refusal) and the drafters."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tscompile.custom_ops.acceptance import filtered_probs
from tscompile.sampling import SamplingParams
from tscompile.spec_decode import (MAX_NUM_SPECULATIVE_TOKENS, DraftBatch, DraftModelDrafter, Drafts, NgramDrafter,
                                   ReplayDrafter, SpeculativeConfig, lookup_continuation)

# ---------------------------------------------------------------------------------------------
# SpeculativeConfig


def test_config_reads_vllm_keys():
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                       "prompt_lookup_max": 3})
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", 4, 2, 3)
    assert cfg.verify_width == 5 and cfg.lookahead_slots == 4
    draft = SpeculativeConfig.from_dict({"method": "draft_model", "model": "/ckpt/small", "num_speculative_tokens": 3})
    assert draft.model == "/ckpt/small" and draft.prompt_lookup_min is None
    assert SpeculativeConfig.from_dict(None) is None
    assert SpeculativeConfig.from_dict(cfg) is cfg
    with pytest.raises(Exception):
        cfg.num_speculative_tokens = 2  # frozen


@pytest.mark.parametrize("given,expect", [({}, (5, 5)), ({"prompt_lookup_max": 4}, (4, 4)),
                                          ({"prompt_lookup_min": 2}, (2, 2))])
def test_config_ngram_window_defaults(given, expect):
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, **given})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == expect


@pytest.mark.parametrize("config,match", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0 must be an int in \\[1, "),
    ({"method": "ngram", "num_speculative_tokens": MAX_NUM_SPECULATIVE_TOKENS + 1},
     f"num_speculative_tokens={MAX_NUM_SPECULATIVE_TOKENS + 1} must be"),
    ({"method": "ngram", "num_speculative_tokens": 2.0}, "num_speculative_tokens=2.0"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens=True"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method='eagle' is not known; use one of"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "key 'lookahead' is not known"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 3}, "a vLLM setting"),
    ({"num_speculative_tokens": 2}, "needs 'method'"),
    ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs \"model\""),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": ""}, "needs \"model\""),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model='x' is only read by"),
    ({"method": "replay", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "only read by method='ngram'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min=0 must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 is above prompt_lookup_max=2"),
    ("ngram", "must be a dict"),
])
def test_config_refusals_name_value_limit_and_fix(config, match):
    with pytest.raises(ValueError, match="^tscompile: ") as err:
        SpeculativeConfig.from_dict(config)
    assert err.match(match)


def test_config_refuses_what_it_cannot_honour():
    cfg = SpeculativeConfig.from_dict({"method": "draft_model", "model": "m", "num_speculative_tokens": 4})
    cfg.check_sampling(SamplingParams(temperature=0.8, top_p=0.9))  # sampling itself is fine
    with pytest.raises(ValueError, match="^tscompile: min_tokens=2 cannot be honoured.*use min_tokens=0"):
        cfg.check_sampling(SamplingParams(min_tokens=2))
    with pytest.raises(ValueError, match="^tscompile: .*vocabulary of 100 tokens, the target has 128"):
        cfg.check_draft_vocab(128, 100)
    cfg.check_graph_widths(5)
    with pytest.raises(ValueError, match="^tscompile: .*windows of 5 rows; the engine captures at most 4; use "
                                         "num_speculative_tokens <= 3"):
        cfg.check_graph_widths(4)


# ---------------------------------------------------------------------------------------------
# drafters


def _batch(contexts, k, prompt_lens=None, ids=None):
    return DraftBatch(tuple(ids or range(len(contexts))), tuple(np.asarray(c, dtype=np.int64) for c in contexts),
                      tuple(prompt_lens or [len(c) for c in contexts]), k)


def _naive_lookup(tokens, k, lo, hi):
    """A plain-Python oracle: longest n first, most recent earlier occurrence."""
    tokens = list(tokens)
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n: start + n + k]
    return []


def test_ngram_constructed_cases():
    drafter = NgramDrafter(1, 3)
    contexts = [
        [1, 2, 3, 4, 5, 9, 2, 3, 4],  # "2 3 4" repeats: continue with 5 9 2
        [7, 8, 9, 1, 7, 8],  # "7 8" -> 9 1 7
        [5, 6, 7],  # nothing repeats
        [4, 4],  # "4" repeats at the end: the continuation is the last token only
    ]
    drafts = drafter.propose(_batch(contexts, 3))
    assert drafts.tokens.tolist() == [[5, 9, 2], [9, 1, 7], [-1, -1, -1], [4, -1, -1]]
    assert drafts.counts.tolist() == [3, 3, 0, 1] and drafts.probs is None


def test_ngram_prefers_longer_matches_and_respects_the_minimum():
    ctx = [1, 2, 3, 9, 9, 3, 5, 2, 3]  # "2 3" matched at 1 (-> 9 9); "3" alone more recently (-> 5 2)
    assert lookup_continuation(np.array(ctx), 2, 1, 2).tolist() == [9, 9]
    assert lookup_continuation(np.array(ctx), 2, 1, 1).tolist() == [5, 2]
    assert lookup_continuation(np.array([1, 2, 3, 1, 2, 4, 2]), 2, 2, 3).tolist() == []


@pytest.mark.parametrize("seed", range(8))
def test_ngram_random_against_oracle(seed):
    rng = np.random.default_rng(seed)
    vocab = 2 + seed % 5  # small vocabularies: long repeats, many candidates per context
    contexts = [rng.integers(0, vocab, size=rng.integers(1, 60)) for _ in range(30)]
    k, lo, hi = 4, 1 + seed % 3, 3 + seed
    drafts = NgramDrafter(lo, hi).propose(_batch(contexts, k))
    for row, ctx in zip(drafts.tokens.tolist(), contexts):
        expect = _naive_lookup(ctx, k, lo, hi)
        assert row == expect + [-1] * (k - len(expect))


def test_ngram_refuses_a_bad_window():
    with pytest.raises(ValueError, match="^tscompile: n-gram drafter needs 1 <= prompt_lookup_min"):
        NgramDrafter(3, 2)


def test_replay_proposes_the_reference_from_the_output_so_far():
    refs = {"a": [10, 11, 12, 13, 14], "b": [20, 21]}
    drafter = ReplayDrafter(refs)
    batch = _batch([[1, 2, 10, 11], [3, 20], [4]], 3, prompt_lens=[2, 1, 1], ids=["a", "b", "c"])
    assert drafter.propose(batch).tokens.tolist() == [[12, 13, 14], [21, -1, -1], [-1, -1, -1]]
    drafter.release("a")
    assert drafter.propose(batch).tokens[0].tolist() == [-1, -1, -1]


def test_window_input_ids_put_the_last_token_first_and_replace_pads():
    drafts = Drafts(np.array([[5, 6, -1], [-1, -1, -1]]))
    assert drafts.window_input_ids(np.array([9, 8])).tolist() == [9, 5, 6, 0, 8, 0, 0, 0]


class BigramRunner:
    """A draft "model" whose next-token logits depend only on the last token fed: logits = table[last].
    It keeps each request's cache as a list and checks that it is fed where the drafter says."""

    def __init__(self, vocab=7, seed=0):
        self.table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed))
        self.vocab_size = vocab
        self.caches: dict = {}
        self.released = []

    def forward(self, request_ids, new_tokens, start_positions):
        last = []
        for rid, toks, start in zip(request_ids, new_tokens, start_positions):
            cache = self.caches.setdefault(rid, [])
            assert len(toks) >= 1 and start <= len(cache)
            del cache[start:]  # rows past start are stale
            cache.extend(int(t) for t in toks)
            last.append(cache[-1])
        return self.table[torch.tensor(last)]

    def release(self, rid):
        self.released.append(rid)


def _greedy_chain(table, token, k):
    out = []
    for _ in range(k):
        token = int(table[token].argmax())
        out.append(token)
    return out


def test_draft_model_greedy_drafts_and_rollback():
    runner = BigramRunner()
    drafter = DraftModelDrafter(runner)
    k = 3
    contexts = [[1, 2, 3], [4]]
    drafts = drafter.propose(_batch(contexts, k, ids=["x", "y"]))
    assert drafts.tokens.tolist() == [_greedy_chain(runner.table, 3, k), _greedy_chain(runner.table, 4, k)]
    assert runner.caches["x"] == [1, 2, 3] + drafts.tokens[0, :k - 1].tolist()
    # x kept one draft and got a bonus token 6; y kept all three and a bonus 0
    drafter.on_accepted(["x", "y"], np.array([1, 3]))
    assert drafter.cached == {"x": 4, "y": 1 + k - 1}
    x_next = [1, 2, 3, int(drafts.tokens[0, 0]), 6]
    y_next = [4] + drafts.tokens[1].tolist() + [0]
    drafts2 = drafter.propose(_batch([x_next, y_next], k, ids=["x", "y"]))
    assert runner.caches["x"][:5] == x_next and runner.caches["y"][:5] == y_next  # caught up, stale rows gone
    assert drafts2.tokens.tolist() == [_greedy_chain(runner.table, 6, k), _greedy_chain(runner.table, 0, k)]
    drafter.release("x")
    assert "x" not in drafter.cached and runner.released == ["x"]


def test_draft_model_sampled_drafts_report_their_distribution():
    runner = BigramRunner(seed=3)
    drafter = DraftModelDrafter(runner, seed=1)
    k, bs = 2, 3
    sampling = (np.full(bs, 0.8, dtype=np.float32), np.array([0, 3, 2], dtype=np.int32),
                np.full(bs, 0.95, dtype=np.float32))
    drafts = drafter.propose(_batch([[1], [2, 5], [6]], k), sampling)
    assert drafts.probs.shape == (bs, k, runner.vocab_size)
    prev = torch.tensor([1, 5, 6])
    for step in range(k):
        q = filtered_probs(runner.table[prev], *(torch.as_tensor(a) for a in sampling))
        torch.testing.assert_close(drafts.probs[:, step].double(), q, atol=1e-6, rtol=1e-6)
        chosen = torch.as_tensor(drafts.tokens[:, step])
        assert (q.gather(1, chosen[:, None]) > 0).all()  # drawn from the support
        prev = chosen


# ---------------------------------------------------------------------------------------------
# committing a verify step


def _plain_decode_tokens(params, eos, stream):
    """What plain decode keeps from the same token stream: one append per step until finished."""
    from tscompile.text import CompletionState
    state = CompletionState(params, eos)
    for t in stream:
        if state.finished:
            break
        state.append(t)
    return state.token_ids, state.finish_reason


@pytest.mark.parametrize("params,stream,runs", [
    (SamplingParams(max_new_tokens=20, stop_token_ids=[9]), [1, 2, 3, 9, 4, 5], [[1, 2], [3, 9, 4], [5]]),
    (SamplingParams(max_new_tokens=4), [1, 2, 3, 4, 5, 6], [[1, 2, 3], [4, 5, 6]]),
    (SamplingParams(max_new_tokens=10), [7, 1, 2], [[7, 1, 2]]),  # eos 7 first
    (SamplingParams(max_new_tokens=10, ignore_eos=True), [7, 1, 2, 3], [[7, 1], [2, 3]]),
])
def test_commit_stops_inside_an_accepted_run_like_plain_decode(params, stream, runs):
    from tscompile.spec_decode import commit_emitted, kv_len_after
    from tscompile.text import CompletionState
    state = CompletionState(params, eos_ids=(7,))
    context = 5  # prompt tokens
    for run in runs:
        if state.finished:
            break
        kept = commit_emitted(state, run)
        assert kv_len_after(context, kept) == context + kept - 1
        context += kept
    tokens, reason = _plain_decode_tokens(params, (7,), stream)
    assert state.token_ids == tokens and state.finish_reason == reason
