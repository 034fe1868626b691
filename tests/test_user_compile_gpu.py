"""torch.compile users' CUDA graphs (needs CUDA): a transformers decoder's split graph captured whole
per bucket replays bitwise equal to the same padded graph run without graphs and within bf16
tolerance of eager, no capture or recompile inside a bucket, unsplit graphs under Inductor's
CUDA-graph trees, transformers generate (its last-row logits piece runs live: piece graphs)."""

import pytest
import torch
import torch._dynamo.utils as dynamo_utils

from tscompile.counters import counters
from tscompile import user_graphs

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu

LADDER = (32, 64, 128)


def tiny_llama(dtype, layers=2):
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval().to("cuda", dtype)


def split_graphs(model, kernels=None):
    return torch.compile(model.forward, backend="tscompile", dynamic=True,
                         options={"split_sdpa": True, "cudagraphs": True, "token_ladder": LADDER, "kernels": kernels})


def graph_counters():
    """For failure messages: why pieces did or did not get graphs."""
    return {k: v for k, v in counters.items() if k.startswith("user")}


def logits(fwd, ids):
    return fwd(input_ids=ids, use_cache=False).logits


def test_whole_graphs_replay_bitwise_equal_to_the_padded_graph_and_close_to_eager():
    torch.compiler.reset()
    model = tiny_llama(torch.bfloat16)
    fwd = split_graphs(model)
    gen = torch.Generator("cuda").manual_seed(1)
    replays = counters["user_replays"]
    with torch.no_grad():
        for n in (20, 32, 100, 17):
            ids = torch.randint(0, 256, (1, n), device="cuda", generator=gen)
            replayed = logits(fwd, ids)
            replayed_again = logits(fwd, ids)
            with user_graphs.pad_without_graphs():
                padded = logits(fwd, ids)
            eager = model(input_ids=ids, use_cache=False).logits
            assert replayed.shape == (1, n, 256)
            assert torch.equal(replayed, padded), f"length {n}"
            assert torch.equal(replayed, replayed_again), f"length {n}: the first call's output was overwritten"
            torch.testing.assert_close(replayed.float(), eager.float(), rtol=3e-2, atol=3e-2, msg=f"length {n}")
    assert counters["user_replays"] > replays, graph_counters()
    assert counters["user_whole_graphs"] == 1 and counters["user_captures"] == 2, graph_counters()  # at 32 and 128


def test_large_logits_leave_the_graph_and_need_no_copy(monkeypatch):
    """``KernelPolicy.user_graph_eager_tail`` with outputs over ``EAGER_TAIL_MIN_BYTES`` (here every
    bucket's): each bucket's graph stops before its
    last piece, which runs after the replay at the live rows. The logits handed back are the tail's
    own output (no copy), equal to the padded graph's bit for bit, and a later call at the same
    bucket with other ids leaves them as they were."""
    from tscompile import user_graph_tail

    monkeypatch.setattr(user_graph_tail, "EAGER_TAIL_MIN_BYTES", 0)
    made = []
    finish = user_graph_tail.GraphTail.finish

    def spy(self, head_out, live):
        out, fresh = finish(self, head_out, live)
        made.append(out[0])
        return out, fresh

    monkeypatch.setattr(user_graph_tail.GraphTail, "finish", spy)
    torch.compiler.reset()
    model = tiny_llama(torch.bfloat16)
    fwd = split_graphs(model, kernels={"user_graph_eager_tail": True})
    gen = torch.Generator("cuda").manual_seed(2)
    tails = counters["user_eager_tails"]
    with torch.no_grad():
        for n in (20, 100):
            ids, other_ids = (torch.randint(0, 256, (1, n), device="cuda", generator=gen) for _ in range(2))
            replayed = logits(fwd, ids)
            assert replayed is made[-1], f"length {n}: the logits were copied"
            kept = replayed.clone()
            other = logits(fwd, other_ids)
            assert not torch.equal(other, kept)
            assert torch.equal(replayed, kept), f"length {n}: the next call overwrote the logits"
            with user_graphs.pad_without_graphs():
                padded = logits(fwd, ids)
            assert torch.equal(replayed, padded), f"length {n}"
            torch.testing.assert_close(replayed.float(), model(input_ids=ids, use_cache=False).logits.float(),
                                       rtol=3e-2, atol=3e-2, msg=f"length {n}")
    assert counters["user_eager_tails"] - tails == 6, graph_counters()  # 2 replays and 1 padded run a length


def test_no_capture_or_recompile_inside_a_bucket_and_none_above_the_ladder():
    torch.compiler.reset()
    model = tiny_llama(torch.bfloat16)
    fwd = split_graphs(model)
    with torch.no_grad():
        logits(fwd, torch.randint(0, 256, (1, 33), device="cuda"))  # compiles, captures bucket 64
        graphs, captures, replays = dynamo_utils.counters["stats"]["unique_graphs"], counters["user_captures"], \
            counters["user_replays"]
        assert captures > 0, graph_counters()
        for n in (40, 64, 50):  # the same bucket
            logits(fwd, torch.randint(0, 256, (1, n), device="cuda"))
        assert counters["user_captures"] == captures
        assert counters["user_replays"] - replays == 3 * captures
        logits(fwd, torch.randint(0, 256, (1, 300), device="cuda"))  # above the ladder: no graphs
        assert counters["user_captures"] == captures
        assert counters["user_above_ladder"] >= 1
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs


def test_unsplit_graph_is_captured_whole_by_cudagraph_trees():
    torch.compiler.reset()
    model = tiny_llama(torch.bfloat16)
    skips = dynamo_utils.counters["inductor"]["cudagraph_skips"]
    captures = counters["user_captures"]
    fwd = torch.compile(model.forward, backend="tscompile", mode="reduce-overhead")
    ids = torch.randint(0, 256, (1, 24), device="cuda")
    with torch.no_grad():
        eager = model(input_ids=ids, use_cache=False).logits
        for _ in range(3):
            torch.compiler.cudagraph_mark_step_begin()
            out = logits(fwd, ids).clone()
    torch.testing.assert_close(out.float(), eager.float(), rtol=3e-2, atol=3e-2)
    assert dynamo_utils.counters["inductor"]["cudagraph_skips"] == skips
    assert counters["user_captures"] == captures  # the trees captured it, not the piece graphs


def test_generate_under_piece_graphs_gives_eager_greedy_tokens():
    # float32: greedy tokens of random weights can tie within bf16 rounding
    torch.compiler.reset()
    model = tiny_llama(torch.float32)
    ids = torch.randint(0, 256, (1, 21), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=8, do_sample=False)
        captures = counters["user_captures"]
        model.forward = split_graphs(model)
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
        out_again = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.tolist() == ref.tolist()
    assert out_again.tolist() == ref.tolist()
    assert counters["user_captures"] > captures, graph_counters()  # the prompt's pieces ran as graphs
