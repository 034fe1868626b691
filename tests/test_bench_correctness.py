"""The bench's correctness column catches bugs: on SmolLM2-135M-Instruct's trained weights, in float32,
the eager engine with a real bug injected decodes other tokens than the float32 reference, or the
same tokens with other log-probabilities, and the bench marks the row FAIL and exits non-zero;
without a bug it agrees and exits 0. The fair prefill
baseline (causal over the prompt only) gives the engine's prefill logits."""

from __future__ import annotations

import json

import pytest
import torch

from real_weights import checkpoint_or_skip
from tscompile.bench.static_cache_model import StaticCacheModel
from tscompile.cli import main as tscompile_main

attention_ops = pytest.importorskip("tscompile.custom_ops.attention")


@pytest.fixture(scope="module")
def checkpoint():
    return checkpoint_or_skip()


# -- the injected bugs ------------------------------------------------------------------------------
def _forget_newest_kv(impl):
    """Decode never writes its own K/V: the slot keeps what it held, and the new token attends to that."""
    def buggy(q, k, v, k_cache, v_cache, out, page_table, seq_lens, qo_indptr, write_loc, scale, decode):
        if decode:
            hkv, d = k_cache.shape[-2:]
            k = k_cache.view(-1, hkv, d)[write_loc].clone()
            v = v_cache.view(-1, hkv, d)[write_loc].clone()
        return impl(q, k, v, k_cache, v_cache, out, page_table, seq_lens, qo_indptr, write_loc, scale, decode)
    return buggy


def _gqa_round_robin(impl):
    """Decode maps query head h to KV head h % n_kv (repeat instead of repeat_interleave) rather than
    h // group: every group reads the wrong keys."""
    def buggy(q, k, v, k_cache, v_cache, out, page_table, seq_lens, qo_indptr, write_loc, scale, decode):
        if not decode:
            return impl(q, k, v, k_cache, v_cache, out, page_table, seq_lens, qo_indptr, write_loc, scale, decode)
        hq, hkv = q.shape[1], k_cache.shape[-2]
        group = hq // hkv
        # the kernel gives row i KV head i // group; row i carries query head perm[i], whose KV head
        # under the bug is perm[i] % hkv == i // group
        perm = torch.tensor([(i % group) * hkv + i // group for i in range(hq)], device=q.device)
        shuffled = torch.empty_like(out)
        impl(q[:, perm], k, v, k_cache, v_cache, shuffled, page_table, seq_lens, qo_indptr, write_loc, scale, decode)
        out[:, perm] = shuffled
    return buggy


def _decode_position_off_by_one(monkeypatch):
    """A decode step rotates its query and its new key as if one position later: the relative
    distances to every cached key are off by one (a shift of every position alike would be invisible
    to RoPE). SmolLM2 keeps its greedy tokens under it; their probabilities move."""
    from tscompile.runtime.staging import DecodeStaging

    fill = DecodeStaging.fill

    def buggy(self, plan, bs, prev_rows=None, **kw):
        fill(self, plan, bs, prev_rows, **kw)
        self._sets[self._turn].n64[self.max_bs: self.max_bs + plan.num_requests] += 1

    monkeypatch.setattr(DecodeStaging, "fill", buggy)


def _inject(monkeypatch, bug: str) -> None:
    """Break only the engine: the float32 reference (the static-cache model) runs the model's own math."""
    if bug == "forget_newest_kv":
        monkeypatch.setitem(attention_ops._IMPLS, "torch", _forget_newest_kv(attention_ops._IMPLS["torch"]))
    elif bug == "gqa_round_robin":
        monkeypatch.setitem(attention_ops._IMPLS, "torch", _gqa_round_robin(attention_ops._IMPLS["torch"]))
    elif bug == "decode_position_off_by_one":
        _decode_position_off_by_one(monkeypatch)
    else:
        assert bug == "none"


def _bench_check(model_dir, tmp_path) -> tuple[int, dict]:
    """One float32 eager bench row against the float32 reference: (exit code, its reference_check)."""
    out_json = tmp_path / "bench.json"
    argv = ["bench", "--model", str(model_dir), "--device", "cpu", "--dtype", "float32", "--batch-size", "1",
            "--input-len", "24", "--output-len", "8", "--prefill-lens", "16", "--num-iters", "1",
            "--num-iters-warmup", "0", "--modes", "eager", "--output-json", str(out_json), "--no-progress",
            "--bandwidth-mib", "16"]
    code = tscompile_main(argv)
    (row,) = json.loads(out_json.read_text())["results"]
    return code, row["reference_check"]


def _assert_caught(code: int, check: dict) -> None:
    from tscompile.bench.reference import describe

    assert code == 1 and check["agrees"] is False and check["fail"] is True, check
    assert describe(check).startswith("**FAIL**"), describe(check)


BUGS = ["forget_newest_kv", "gqa_round_robin", "decode_position_off_by_one"]


@pytest.mark.parametrize("bug", ["none", *BUGS])
def test_float32_check_fails_for_injected_bugs_on_trained_weights(checkpoint, bug, monkeypatch, tmp_path):
    """On SmolLM2's weights."""
    _inject(monkeypatch, bug)
    code, check = _bench_check(checkpoint, tmp_path)
    if bug == "none":
        assert code == 0 and check["agrees"] is True and check["compared_tokens"] == 8, check
        assert check["max_logprob_diff"] < 1e-4, check  # the engine's own: summation order only
    else:
        _assert_caught(code, check)


# -- the fair prefill baseline -----------------------------------------------------------------------
def test_fair_prefill_baseline_logits_equal_the_engines_float32(checkpoint):
    """``StaticCacheModel.prefill`` (SDPA is_causal over the prompt only) gives the engine's prefill
    logits, and the old masked attention over the whole static cache's, on trained weights in float32."""
    import tscompile
    from tscompile.models import load_model

    model, _ = load_model(checkpoint, dtype=torch.float32, device="cpu", max_model_len=128)
    prompt = torch.randint(0, model.config.vocab_size, (37,), generator=torch.Generator().manual_seed(5)).tolist()
    ids = torch.tensor([prompt])
    for gqa in ("repeat_interleave", "enable_gqa"):
        sm = StaticCacheModel(model, batch_size=1, max_len=96, gqa=gqa)
        with torch.no_grad():
            fair = sm.prefill(ids)[0]
            masked = StaticCacheModel(model, batch_size=1, max_len=96, gqa=gqa)(ids, torch.arange(len(prompt)))[0]
        torch.testing.assert_close(fair, masked, rtol=1e-4, atol=1e-4)

    captured = []
    hook = model.output.register_forward_hook(lambda mod, args, out: captured.append(out.detach().float().clone()))
    try:
        llm = tscompile.LLM(model, enforce_eager=True, device="cpu", attention_backend="torch", max_model_len=128,
                            max_num_seqs=1, page_size=16)
        llm.generate([{"prompt_token_ids": prompt}], tscompile.SamplingParams(max_new_tokens=1))
    finally:
        hook.remove()
    torch.testing.assert_close(captured[0][0], fair, rtol=1e-4, atol=1e-4)
    assert fair.argmax() == captured[0][0].argmax()
