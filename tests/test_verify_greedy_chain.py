"""The whole verify chain below the runner, token for token: a one-layer attention model decoded
greedily one token per step equals the same model decoded through verify windows (the width-N
refresh, window attention, ``tscompile::accept_greedy``, the commit and the KV counter rollback),
for drafts that are often wrong. Float32, a padded batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tscompile.attention import DecodeInputs, create_attention_router
from tscompile.forward_context import ForwardMode
from tscompile.kv_cache import CacheGroupSpec, KVCachePool
from tscompile.spec_decode import DraftBatch, NgramDrafter, ReplayDrafter
from tscompile.spec_decode.drafter import Drafts

VOCAB, HKV, GROUP, HEAD_DIM, PAGE, BLOCKS_PER_REQ = 13, 1, 2, 16, 4, 12
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class ToyModel:
    """Embedding + position embedding -> one paged attention layer -> LM head (float32)."""

    def __init__(self, name, bs, max_width, seed=0):
        g = torch.Generator().manual_seed(seed)
        hq = HKV * GROUP
        self.emb = torch.randn(VOCAB, 16, generator=g)
        self.pos = torch.randn(64, 16, generator=g) * 0.5
        self.wq, self.wk, self.wv = (torch.randn(16, h * HEAD_DIM, generator=g) for h in (hq, HKV, HKV))
        self.wo = torch.randn(hq * HEAD_DIM, VOCAB, generator=g) * 2
        for name_ in ("emb", "pos", "wq", "wk", "wv", "wo"):
            setattr(self, name_, getattr(self, name_).to(DEVICE))
        spec = CacheGroupSpec("full", (0,), HKV, HEAD_DIM)
        self.router = create_attention_router(name, [spec], max_model_len=PAGE * BLOCKS_PER_REQ, page_size=PAGE,
                                              pages_per_block=1, device=DEVICE)
        self.pool = KVCachePool.allocate([spec], [bs * BLOCKS_PER_REQ + 2], page_size=PAGE, pages_per_block=1,
                                         dtype=torch.float32, device=DEVICE)
        self.pool.fill_(float("nan"))  # a read of any slot no step wrote shows up as NaN
        self.router.set_cache_pool(self.pool)
        self.router.bind_query_heads(hq)
        self.router.allocate_decode_buffers(bs, max_width)
        self.bs = bs

    def table(self, rid):
        return np.arange(1 + rid * BLOCKS_PER_REQ, 1 + (rid + 1) * BLOCKS_PER_REQ, dtype=np.int32)

    def step(self, rids, tokens, positions, kv_lens, width):
        """One decode step of ``len(rids)`` requests, ``width`` rows each, padded to ``self.bs``.
        tokens, positions: [n * width]; kv_lens: [n] (after the step). Returns logits [n * width, V]."""
        n, rows = len(rids), self.bs * width
        tables = np.stack([self.table(r) for r in rids])
        lens = np.asarray(kv_lens, dtype=np.int32)
        self.router.refresh_decode_metadata(self.bs, DecodeInputs(
            (torch.from_numpy(tables).to(DEVICE),), (torch.from_numpy(lens).to(DEVICE),), (tables,), (lens,), width))
        ids = torch.zeros(rows, dtype=torch.long, device=DEVICE)
        pos = torch.zeros(rows, dtype=torch.long, device=DEVICE)
        ids[: n * width], pos[: n * width] = torch.as_tensor(tokens), torch.as_tensor(positions)
        x = self.emb[ids] + self.pos[pos]
        q, k, v = (x @ w for w in (self.wq, self.wk, self.wv))
        out = torch.full((rows, HKV * GROUP, HEAD_DIM), float("nan"), device=DEVICE)
        kc, vc = self.pool.layer_cache(0)
        self.router.forward(0, ForwardMode.DECODE, q.view(rows, -1, HEAD_DIM), k.view(rows, HKV, HEAD_DIM),
                            v.view(rows, HKV, HEAD_DIM), kc, vc, out, 1 / HEAD_DIM ** 0.5)
        logits = out.reshape(rows, -1) @ self.wo
        assert not logits[: n * width].isnan().any(), "a live row read a slot nothing wrote"
        return logits[: n * width].cpu()


def _prefill(model, prompts):
    """The prompts one token per step (width-1 steps), all requests together (equal lengths)."""
    rids = list(range(len(prompts)))
    for t in range(len(prompts[0])):
        logits = model.step(rids, [p[t] for p in prompts], [t] * len(rids), [t + 1] * len(rids), 1)
    return logits.argmax(-1).tolist()


def _plain_greedy(name, prompts, max_new):
    model = ToyModel(name, bs=4, max_width=1)
    first = _prefill(model, prompts)
    outs = [[t] for t in first]
    for _ in range(max_new - 1):
        ctx = [p + o for p, o in zip(prompts, outs)]
        logits = model.step(list(range(len(prompts))), [c[-1] for c in ctx], [len(c) - 1 for c in ctx],
                            [len(c) for c in ctx], 1)
        for o, t in zip(outs, logits.argmax(-1).tolist()):
            o.append(t)
    return outs


def _speculative_greedy(name, prompts, max_new, drafter, k):
    width = k + 1
    model = ToyModel(name, bs=4, max_width=width)
    first = _prefill(model, prompts)
    outs = [[t] for t in first]
    steps = accepted_total = 0
    while min(len(o) for o in outs) < max_new:
        ctx = [p + o for p, o in zip(prompts, outs)]
        batch = DraftBatch(tuple(range(len(prompts))), tuple(np.asarray(c) for c in ctx),
                           tuple(len(p) for p in prompts), k)
        drafts: Drafts = drafter.propose(batch)
        tokens = drafts.window_input_ids(np.array([c[-1] for c in ctx]))
        positions = np.concatenate([np.arange(len(c) - 1, len(c) - 1 + width) for c in ctx])
        # the window's KV length: the context's tokens plus the k drafts
        logits = model.step(list(range(len(prompts))), tokens, positions, [len(c) + k for c in ctx], width)
        n = len(prompts)
        out_tokens = torch.full((n, width), -7, dtype=torch.int64)
        out_accepted = torch.full((n,), -7, dtype=torch.int32)
        torch.ops.tscompile.accept_greedy(logits, torch.from_numpy(drafts.tokens.reshape(-1)),
                                          (torch.arange(n + 1) * k).to(torch.int32), out_tokens, out_accepted)
        for i, o in enumerate(outs):
            a = int(out_accepted[i])
            o.extend(out_tokens[i, : a + 1].tolist())  # the KV counter is len(context) - 1: rejected rows get rewritten
            accepted_total += a
        drafter.on_accepted(list(range(n)), out_accepted.numpy())
        steps += 1
    return [o[:max_new] for o in outs], steps, accepted_total


class NoisyReplay(ReplayDrafter):
    """Replays the reference but corrupts some drafts, so rejections happen at every depth."""

    def __init__(self, references, seed):
        super().__init__(references)
        self.rng = np.random.default_rng(seed)

    def propose(self, batch):
        drafts = super().propose(batch).tokens.copy()
        wrong = self.rng.random(drafts.shape) < 0.3
        drafts = np.where(wrong & (drafts >= 0), (drafts + 1) % VOCAB, drafts)
        return Drafts(drafts)


PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8], [1, 1, 2, 3, 5, 8, 1, 3]]


# the Triton leaf's window attention is checked against the torch leaf's in test_verify_router.py;
# here the chain runs on the torch leaf on the CPU and on both on a GPU
@pytest.mark.parametrize("name,k,max_new", [("torch", 1, 10), ("torch", 3, 12),
                                            pytest.param("triton", 3, 12, marks=pytest.mark.gpu)])
def test_verify_windows_give_plain_greedy_tokens(name, k, max_new):
    plain = _plain_greedy(name, PROMPTS, max_new)
    refs = {i: o for i, o in enumerate(plain)}
    spec, steps, accepted = _speculative_greedy(name, PROMPTS, max_new, NoisyReplay(refs, seed=k), k)
    assert spec == plain
    assert 0 < accepted < steps * k * len(PROMPTS)  # some drafts kept, some rejected
    exact, steps_exact, _ = _speculative_greedy(name, PROMPTS, max_new, ReplayDrafter(refs), k)
    assert exact == plain and steps_exact == -(-(max_new - 1) // (k + 1))  # every draft accepted


def test_ngram_drafts_keep_plain_greedy_tokens():
    max_new = 16
    plain = _plain_greedy("torch", PROMPTS, max_new)
    spec, _, _ = _speculative_greedy("torch", PROMPTS, max_new, NgramDrafter(1, 3), 3)
    assert spec == plain
