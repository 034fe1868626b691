"""Prefill graphs per token bucket and the narrowing decoder per row bucket, on the CPU.

CUDA graphs need a GPU; here the same bookkeeping runs through ``HostGraphs`` (a replay re-runs the
piece over the captured input tensors into the captured output tensors), so padding, handoff
buffers, copies into static inputs and the capture keys are all exercised. tests/test_gpu_graphs.py
runs the real graphs."""

import gc
import weakref

import pytest
from torch._dynamo.eval_frame import _debug_get_cache_entry_list as cache_entries
import torch

from helpers import small_llm, ids
from tscompile import SamplingParams
from tscompile.counters import counters
from tscompile.custom_ops.attention import run_attention
from tscompile.runtime.graph_runner import GraphRunner, HostGraphs
from tscompile.runtime.piece_graphs import GraphedPiece, NarrowHandoff

LADDER = {"token_ladder": (4, 8, 16), "prefill_graph_max_tokens": 16}
RAGGED = [[(5 * i + j) % 400 + 1 for j in range(n)] for i, n in enumerate([3, 9, 14, 1, 6])]


def _graphed_llm(model, **kw):
    kw.setdefault("enable_prefix_caching", False)  # the buckets of whole prompts, rerun: no prefix hits
    llm = small_llm(model, dtype=torch.float32, compile_options=LADDER, **kw)
    llm.runner.use_graphs(HostGraphs(), decode=False, prefill="piecewise")
    return llm


def _record_logits(llm):
    """Snapshot each step's logits outside the compiled region: a graph's outputs are its static
    tensors, overwritten by the next replay, so a snapshot taken inside would alias them."""
    seen = []
    original = llm.runner.sampling.sample

    @torch._dynamo.disable
    def record(logits):
        seen.append(logits.detach().clone())

    def sample(logits, *args):
        record(logits)
        return original(logits, *args)

    llm.runner.sampling.sample = sample
    return seen


def test_prefill_graphs_equal_eager_across_token_and_row_buckets():
    """narrow-tiny: its encoder pieces are llama-tiny's layers (graphed per token bucket) and its
    decoder adds the row buckets, so one model covers both kinds of graph; llama-tiny's piecewise
    graphs are also captured and replayed by test_a_direct_runner_call_reuses_the_engines_compiled_pieces_and_graphs."""
    model = "narrow-tiny"
    greedy, sampled = SamplingParams(max_new_tokens=3), SamplingParams(max_new_tokens=3, temperature=0.8, top_k=20,
                                                                        seed=7)
    runs = [(RAGGED, greedy), (RAGGED[::-1], greedy), (RAGGED, sampled)]  # later runs replay earlier captures
    eager = small_llm(model, dtype=torch.float32, enforce_eager=True, max_num_batched_tokens=20, max_num_seqs=5)
    expected = [ids(eager.generate(p, params)) for p, params in runs]
    counters.clear()
    graphed = _graphed_llm(model, max_num_batched_tokens=20, max_num_seqs=5)
    assert [ids(graphed.generate(p, params)) for p, params in runs] == expected
    # 20-token chunks run above the ladder (no graph); the smaller tail chunks and mixed steps are graphed
    assert counters["prefill_graphed"] > 0 and counters["prefill_eager"] > 0
    assert counters["prefill_replays"] > counters["prefill_captures"] > 0
    if model == "narrow-tiny":  # row ladder (4, 8, 16) clipped to window 4 * 5 seqs = 20
        assert counters["decoder_rows_graphed"] > 0


def test_prefill_graph_logits_match_eager_with_the_sampler_split_off():
    """Logits, not only tokens: snapshotting them splits the sampler into a graph of its own, so
    the pieces before it are the production ones and the last piece differs. narrow-tiny only: its
    graphed encoder pieces are llama-tiny's layers, and its decoder's row-bucket graphs come on top."""
    model = "narrow-tiny"
    eager = small_llm(model, dtype=torch.float32, enforce_eager=True, max_num_batched_tokens=20, max_num_seqs=5,
                      enable_prefix_caching=False)  # step for step with the graphed engine
    graphed = _graphed_llm(model, max_num_batched_tokens=20, max_num_seqs=5)
    eager_logits, graphed_logits = _record_logits(eager), _record_logits(graphed)
    for prompts in (RAGGED, RAGGED[::-1]):
        assert ids(graphed.generate(prompts, SamplingParams(max_new_tokens=3))) == ids(eager.generate(
            prompts, SamplingParams(max_new_tokens=3)))
    for a, b in zip(eager_logits, graphed_logits, strict=True):
        # a graphed step pads its logits rows to a request bucket: the live rows come first
        assert b.shape[0] >= a.shape[0]
        torch.testing.assert_close(b[: a.shape[0]], a, rtol=1e-4, atol=1e-4)


def test_narrowing_decoder_runs_without_graphs_above_the_largest_row_bucket():
    params = SamplingParams(max_new_tokens=2)
    prompts = [[(3 * i + j) % 300 + 1 for j in range(4)] for i in range(4)]  # 16 tokens, 16 kept rows
    options = {"token_ladder": (4, 8, 16), "prefill_graph_max_tokens": 16}
    expected = ids(small_llm("narrow-tiny", dtype=torch.float32, enforce_eager=True,
                         max_num_batched_tokens=16).generate(prompts, params))
    counters.clear()
    llm = small_llm("narrow-tiny", dtype=torch.float32, compile_options=options, max_num_batched_tokens=16)
    llm.runner.use_graphs(HostGraphs(), decode=False, prefill="piecewise")
    llm.runner.prefill.buckets.row_ladder = (4, 8)  # the 16 kept rows of the first step exceed it
    assert ids(llm.generate(prompts, params)) == expected
    assert counters["decoder_rows_eager"] >= 1 and counters["prefill_graphed"] >= 1


def test_narrowing_steps_above_the_token_ladder_capture_nothing_and_equal_eager():
    """Above the token ladder the decoder runs without graphs as well: its last piece's logits rows
    are a view into the step's upload whose offset follows the unpadded token count, so graphing it
    would capture a new graph for every token count (kept rows 8 here fit the row ladder)."""
    params = SamplingParams(max_new_tokens=2)
    batches = [[[(3 * i + j) % 300 + 1 for j in range(n)] for i in range(2)] for n in (12, 20)]  # 24, 40 tokens
    eager = small_llm("narrow-tiny", dtype=torch.float32, enforce_eager=True, max_num_batched_tokens=64)
    expected = [ids(eager.generate(b, params)) for b in batches]
    llm = _graphed_llm("narrow-tiny", max_num_batched_tokens=64)
    assert max(llm.runner.prefill.buckets.row_ladder) >= 8
    ids(llm.generate([[5, 6, 7]], params))  # inside the ladder: the graphs of that bucket
    counters.clear()
    assert [ids(llm.generate(b, params)) for b in batches] == expected
    assert counters["prefill_captures"] == 0 and counters["decoder_rows_graphed"] == 0
    assert counters["decoder_rows_eager"] == 2


def test_steps_inside_one_bucket_replay_without_capturing_or_recompiling():
    llm = _graphed_llm("llama-tiny")
    params = SamplingParams(max_new_tokens=1)
    ids(llm.generate([[7] * 5], params))  # 5 tokens -> bucket 8: first capture
    captures, graphs = counters["prefill_captures"], counters["graphs"]
    frames = dict(torch._dynamo.utils.counters["frames"])
    ids(llm.generate([[9] * 6], params))  # 6 and 8 tokens: the same bucket, one request
    ids(llm.generate([[4] * 8], params))
    assert counters["prefill_captures"] == captures
    assert counters["graphs"] == graphs and dict(torch._dynamo.utils.counters["frames"]) == frames
    ids(llm.generate([[3] * 12], params))  # bucket 16: new captures, still no recompile
    assert counters["prefill_captures"] > captures and counters["graphs"] == graphs


@pytest.mark.parametrize("prefill,speculation", [
    ("piecewise", None), ("whole", None), ("piecewise", {"method": "ngram", "num_speculative_tokens": 3}),
], ids=["piecewise", "whole", "piecewise-ngram"])
def test_a_deleted_engine_frees_its_weights_and_graphs(prefill, speculation):
    """Dynamo keeps an engine's compiled steps for the process's life (a map from the code it wrote
    back to the code it compiled), and the prefill step holds the graphed pieces, whose captures hold
    the weights: deleting the engine must still free them, or a second engine in the process runs
    out of device memory beside the first one's weights. Decode, verify and whole-step prefill
    graphs are the engine's own."""
    import tscompile.runtime.prefill_step as prefill_module

    def compiled_in_globals():  # Dynamo installs each compiled graph in the traced function's globals
        return {k for k in vars(prefill_module) if k.startswith("__compiled_fn")}

    before = compiled_in_globals()
    llm = small_llm("llama-tiny", dtype=torch.float32, compile_options={**LADDER, "decode_ladder": (1, 2, 4)},
                    max_num_batched_tokens=16, enable_prefix_caching=False, speculative_config=speculation)
    llm.runner.use_graphs(HostGraphs(), decode=True, prefill=prefill)
    repeating = [[5, 6, 7, 8] * 3, [9, 10] * 5]  # the n-gram drafter finds drafts in them
    llm.generate(RAGGED + repeating, SamplingParams(max_new_tokens=6, temperature=0.0))
    assert llm.runner.graphs.graphs  # decode (or verify) graphs captured
    weight = weakref.ref(next(llm.parts.model.parameters()))
    pieces = [weakref.ref(p) for p in (llm.runner.prefill.buckets.pieces if prefill == "piecewise" else [])]
    assert prefill == "whole" or pieces  # some piece captured
    added = compiled_in_globals() - before  # this engine's (an earlier test's may go meanwhile)
    assert added
    del llm
    gc.collect()
    assert weight() is None
    assert all(p() is None or not p().graphs for p in pieces)
    assert not compiled_in_globals() & added  # the engine's compiled graphs went with it


def test_padded_tail_rows_of_attention_outputs_are_zero_and_write_only_the_null_page():
    counters.clear()
    llm = _graphed_llm("llama-tiny", max_num_batched_tokens=16)
    pool = llm.pool.groups[0]
    for lid in pool.k:  # poison every page: a padded row reading or a live row leaking would show
        pool.k[lid].fill_(float("nan"))
        pool.v[lid].fill_(float("nan"))
    req = llm.add_request(list(range(1, 12)), SamplingParams(max_new_tokens=2))  # 11 tokens -> bucket 16
    llm.step()
    llm.sync()
    assert len(req.output) == 1 and counters["prefill_graphed"] == 1
    page = pool.geometry.page_size
    live = {s for b in req.blocks[0] for s in range(b * page, (b + 1) * page)}
    for lid in pool.k:  # every written slot is either this request's or in the null page (page 0)
        written = (~torch.isnan(pool.k[lid].view(-1, *pool.k[lid].shape[2:]))).flatten(1).any(1).nonzero()[:, 0]
        written = set(written.tolist())
        # the 11 live rows land in the request's pages, the 5 padded rows in the null page's slot 0
        assert written <= live | set(range(page)) and len(written & live) == 11 and 0 in written
    cfg = llm.model.config
    # the attention breaks wrote into the `out` buffers the pieces allocated: rows 11..15 are zero
    outs = [o for p in llm.runner.prefill.buckets.pieces for e in p.graphs.values() for o in e.outputs
            if isinstance(o, torch.Tensor) and tuple(o.shape) == (16, cfg.n_heads, cfg.head_dim)]
    tails = [o for o in outs if (o[11:] == 0).all() and (o[:11] != 0).any()]
    assert len(tails) >= cfg.n_layers


def test_attention_zeroes_rows_past_the_live_ones_even_over_poison():
    torch.manual_seed(0)
    hq, hkv, d, page = 4, 2, 16, 4
    k_cache, v_cache = torch.randn(6, page, hkv, d), torch.randn(6, page, hkv, d)
    q, k, v = torch.randn(9, hq, d), torch.randn(9, hkv, d), torch.randn(9, hkv, d)
    out = torch.full((9, hq, d), float("nan"))
    page_table = torch.tensor([[1, 2, 0], [3, 0, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([6, 2], dtype=torch.int32)
    qo_indptr = torch.tensor([0, 4, 6], dtype=torch.int32)  # rows 6..8 pad the bucket
    write_loc = torch.tensor([6, 7, 8, 9, 12, 13, 0, 0, 0])  # padded rows -> the null page's slot 0
    run_attention(q, k, v, k_cache, v_cache, out, page_table, seq_lens, qo_indptr, write_loc, 0.25, False, "torch")
    assert (out[6:] == 0).all() and not torch.isnan(out[:6]).any()


def test_graphed_piece_copies_moved_inputs_and_passes_through_without_a_plan():
    calls = []

    def fn(x, w):
        calls.append(x.data_ptr())
        return (x * w,)

    piece = GraphedPiece("submod_0", "encoder", fn)
    w = torch.nn.Parameter(torch.randn(4), requires_grad=False)
    x = torch.randn(3, 4)
    assert torch.equal(piece(x, w)[0], x * w)  # no forward context: a plain call
    assert not piece.graphs
    from tscompile.forward_context import ForwardContext, ForwardMode, forward_context
    from tscompile.runtime.piece_graphs import PrefillGraphPlan

    plan = PrefillGraphPlan(GraphRunner(HostGraphs()), [], encoder_tokens=4)
    with forward_context(ForwardContext(ForwardMode.EXTEND, None, torch.zeros(0, dtype=torch.int64), prefill_graphs=plan)):
        first = piece(x, w)[0]
        y = torch.randn(3, 4)  # a new address: copied into the captured input, same output tensor
        second = piece(y, w)[0]
    assert second is first and torch.equal(second, y * w)
    assert torch.equal(x, y)  # the captured input tensor now holds this step's values


def test_narrow_handoff_pads_rows_and_the_row_count_to_the_bucket():
    from tscompile.forward_context import ForwardContext, ForwardMode, forward_context
    from tscompile.runtime.piece_graphs import PrefillGraphPlan

    x = torch.randn(5, 4)
    live = {"n": 5}
    handoff = NarrowHandoff("submod_4", lambda: (x[:live["n"]], torch.arange(live["n"]), live["n"]),
                            [True, True, False], [False, False, True])
    plan = PrefillGraphPlan(GraphRunner(HostGraphs()), [], None, decoder_rows=8)
    with forward_context(ForwardContext(ForwardMode.EXTEND, None, torch.zeros(0, dtype=torch.int64), prefill_graphs=plan)):
        first, _, _ = handoff()
        live["n"] = 3  # the same bucket's buffers again, fewer live rows: rows 3..4 must be zeroed again
        rows, pos, n = handoff()
    assert rows is first  # one handoff buffer per bucket: the next piece sees a stable address
    assert rows.shape == (8, 4) and n == 8 and torch.equal(rows[:3], x[:3]) and (rows[3:] == 0).all()
    assert torch.equal(pos, torch.tensor([0, 1, 2, 0, 0, 0, 0, 0]))


def test_a_moved_parameter_or_written_input_is_refused_not_copied():
    from tscompile.forward_context import ForwardContext, ForwardMode, forward_context
    from tscompile.runtime.piece_graphs import PrefillGraphPlan

    def fn(x, w, out):
        out.copy_(x * w)
        return (out,)

    piece = GraphedPiece("submod_2", "encoder", fn, written=frozenset({2}))
    w = torch.nn.Parameter(torch.randn(4), requires_grad=False)
    x, out = torch.randn(3, 4), torch.zeros(3, 4)
    plan = PrefillGraphPlan(GraphRunner(HostGraphs()), [], encoder_tokens=4)
    with forward_context(ForwardContext(ForwardMode.EXTEND, None, torch.zeros(0, dtype=torch.int64), prefill_graphs=plan)):
        piece(x, w, out)
        assert torch.equal(out, x * w)
        with pytest.raises(RuntimeError, match="not the tensor it was captured with"):
            piece(x, w, torch.zeros(3, 4))  # the write would land in the captured `out`, not this one
        with pytest.raises(RuntimeError, match="not the tensor it was captured with"):
            piece(x, torch.nn.Parameter(w.detach().clone(), requires_grad=False), out)


def test_mutated_inputs_finds_in_place_writes_through_views_and_op_schemas():
    from tscompile.piece_compiler import mutated_inputs

    def f(a, b, c, tokens, logits, d):
        a[1:].add_(1)  # in-place method on a view of input 0
        torch.ops.tscompile.sample(logits, c, torch.ones(2, dtype=torch.int32), torch.ones(2), torch.zeros(
            2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), torch.full((2, 1), -1, dtype=torch.int64),
            tokens[:2])  # schema marks `out` written
        return b * 2

    gm = torch.fx.symbolic_trace(f)
    assert mutated_inputs(gm) == frozenset({0, 3})
    import operator  # `d[0] = 1.0` as Dynamo records it (symbolic_trace cannot trace setitem)

    d = [n for n in gm.graph.nodes if n.op == "placeholder"][5]
    with gm.graph.inserting_before(next(n for n in gm.graph.nodes if n.op == "output")):
        gm.graph.call_function(operator.setitem, (d, 0, 1.0))
    assert mutated_inputs(gm) == frozenset({0, 3, 5})


def test_prefill_graph_max_tokens_zero_turns_prefill_graphs_off():
    from tscompile.config import TscompileConfig

    with pytest.raises(ValueError, match="tscompile: prefill_graph_max_tokens must be >= 0"):
        TscompileConfig(prefill_graph_max_tokens=-1)
    llm = small_llm("narrow-tiny", dtype=torch.float32, compile_options={"prefill_graph_max_tokens": 0})
    llm.runner.use_graphs(HostGraphs(), decode=False, prefill="piecewise")
    counters.clear()
    assert ids(llm.generate(RAGGED[:3], SamplingParams(max_new_tokens=2)))
    assert counters["prefill_eager"] > 0 and counters["prefill_graphed"] == 0
    assert counters["prefill_captures"] == 0 and counters["decoder_rows_graphed"] == 0


def test_a_direct_runner_call_reuses_the_engines_compiled_pieces_and_graphs():
    """Dynamo guards on inference mode: the runner enters it itself, so a step launched outside the
    engine (as the GPU tests do) neither recompiles nor captures again."""
    llm = _graphed_llm("llama-tiny", max_num_batched_tokens=64)
    ids(llm.generate([[(7 * j) % 400 + 1 for j in range(11)]], SamplingParams(max_new_tokens=2)))
    counters.clear()
    llm.add_request([(3 * j) % 400 + 1 for j in range(14)], SamplingParams(max_new_tokens=2))  # same bucket
    assert not torch.is_inference_mode_enabled()
    llm.runner.execute(llm.scheduler.schedule())
    assert counters["graphs"] == 0 and counters["prefill_captures"] == 0 and counters["prefill_replays"] > 0


# -- whole-step prefill graphs (GraphRunner + runtime/prefill_buffers.py), host graphs -----------------

WHOLE = {"token_ladder": (4, 8, 16), "prefill_graph_max_tokens": 16, "decode_ladder": (1, 2, 4)}


@pytest.fixture(scope="module")
def whole_llm():
    """One compiled engine for the whole-step tests (each leaves it with nothing queued)."""
    # the tests rerun their prompts and count the buckets of whole prompts: no prefix hits shortening them
    llm = small_llm("llama-tiny", dtype=torch.float32, compile_options=WHOLE, max_num_batched_tokens=20,
                    max_num_seqs=5, enable_prefix_caching=False)
    llm.runner.use_graphs(HostGraphs(), decode=False, prefill="whole")
    return llm


def _spy_stage(llm, monkeypatch):
    staged = []
    original = llm.runner.prefill.whole.stage

    def spy(size, arrays):
        out = original(size, arrays)
        staged.append((size, [t.data_ptr() for t in out], [t.clone() for t in out]))
        return out

    monkeypatch.setattr(llm.runner.prefill.whole, "stage", spy)
    return staged


def test_whole_step_bucket_is_the_smallest_token_and_request_bucket_that_fit():
    w = GraphRunner(HostGraphs(), token_ladder=(4, 8, 16), request_ladder=(1, 2, 4, 5))
    assert w.prefill_size(3, 1) == (4, 1)
    assert w.prefill_size(5, 3) == (8, 4)
    assert w.prefill_size(16, 5) == (16, 5)
    assert w.prefill_size(4, 5) == (4, 4)  # never more request rows than token rows
    assert w.prefill_size(17, 1) is None and w.prefill_size(8, 6) is None


def test_whole_step_prefill_equals_eager_across_buckets_and_above_them(whole_llm):
    greedy = SamplingParams(max_new_tokens=3)
    sampled = SamplingParams(max_new_tokens=3, temperature=0.8, top_k=20, seed=7)
    runs = [(RAGGED, greedy), (RAGGED[::-1], greedy), (RAGGED, sampled)]
    eager = small_llm(dtype=torch.float32, enforce_eager=True, max_num_batched_tokens=20, max_num_seqs=5)
    expected = [ids(eager.generate(p, params)) for p, params in runs]
    counters.clear()
    assert [ids(whole_llm.generate(p, params)) for p, params in runs] == expected
    # 20-token chunks run above the token ladder; the tails and the mixed steps are whole-step graphs
    assert counters["prefill_graphed"] > 0 and counters["prefill_eager"] > 0
    assert counters["prefill_replays"] > counters["prefill_captures"] > 0
    assert whole_llm.runner.prefill.buckets is None  # no per-piece graphs in this mode
    # greedy and sampled steps: two variants by design, no other recompile
    assert len(cache_entries(whole_llm.runner.prefill.compiled.__wrapped__.__code__)) == 2


def test_fresh_and_persistent_extend_metadata_sit_at_the_same_kind_of_storage_offset(whole_llm, monkeypatch):
    """Dynamo specializes a storage offset of 0 or 1 and guards ``>= 2`` otherwise: on the H200 a
    page table at offset 0 (a step above the token ladder, fresh storage) recompiled the extend graph
    that whole-step buffers (offset >= 2) had compiled. Every metadata view the model reads must
    fall in the same class (0, 1, >= 2) on both paths."""
    seen = []
    original = whole_llm.attention.publish_extend_metadata

    def spy(plan, arrays):
        seen.append(plan.num_tokens)
        original(plan, arrays)

    monkeypatch.setattr(whole_llm.attention, "publish_extend_metadata", spy)
    kinds = []
    real_forward = whole_llm.runner.prefill.compiled

    def offsets(*args):
        from tscompile.forward_context import get_forward_context

        ctx = get_forward_context()
        tensors = [*args[:2], ctx.logits_rows, ctx.qo_indptr, ctx.completes]
        for leaf in whole_llm.attention.leaves:
            meta = leaf.forward_extend_metadata
            tensors += [meta.page_table, meta.seq_lens, meta.qo_indptr]
        tensors += list(whole_llm.attention.extend_write_locations)
        kinds.append([min(t.storage_offset(), 2) for t in tensors])
        return real_forward(*args)

    monkeypatch.setattr(whole_llm.runner.prefill, "compiled", offsets)
    whole_llm.generate([[(7 * j) % 300 + 1 for j in range(18)]], SamplingParams(max_new_tokens=1))  # above 16
    whole_llm.generate([[(7 * j) % 300 + 1 for j in range(6)]], SamplingParams(max_new_tokens=1))  # bucket 8
    # a first capture of bucket 8 runs its step twice (capture, then replay): every run alike
    assert seen == [18, 6] and len(kinds) >= 2
    assert all(k == kinds[0] for k in kinds), kinds


def test_whole_step_buffers_never_move_and_padded_token_rows_write_the_null_slot(whole_llm, monkeypatch):
    staged = _spy_stage(whole_llm, monkeypatch)
    params = SamplingParams(max_new_tokens=1)
    ids(whole_llm.generate([[5, 6, 7], [8, 9]], params))  # 5 tokens, 2 requests -> bucket (8, 2)
    ids(whole_llm.generate([[1, 2, 3, 4, 5, 6], [7]], params))  # 7 tokens, 2 requests: the same bucket
    # one request pads to the smallest request bucket, 2 (a bucket of 1 would specialize the graph)
    ids(whole_llm.generate([[4, 4, 4]], params))  # (4, 2)
    (s1, p1, _), (s2, p2, t2), (s3, _, t3) = staged
    assert s1 == s2 == (8, 2) and s3 == (4, 2) and p1 == p2
    ids_, pos, logits_rows, qo, completes, pages, seq_lens, gqo, slots = t2
    assert ids_.tolist() == [1, 2, 3, 4, 5, 6, 7, 0] and pos.tolist() == [0, 1, 2, 3, 4, 5, 0, 0]
    assert logits_rows.tolist() == [5, 6] and qo.tolist() == gqo.tolist() == [0, 6, 7]
    assert slots[7].item() == 0 and (slots[:7] > 0).all()
    # the padded request: an empty query range, KV length 0, the null page only, logits row 0
    ids_, pos, logits_rows, qo, completes, pages, seq_lens, gqo, slots = t3
    assert pages.shape[0] == 2 and pages[0].any() and not pages[1].any()
    assert qo.tolist() == gqo.tolist() == [0, 3, 3] and seq_lens.tolist() == [3, 0]
    assert logits_rows.tolist() == [2, 0] and completes.tolist() == [True, False]
    assert slots[3].item() == 0 and (slots[:3] > 0).all()


def test_whole_step_pads_request_rows_with_empty_ranges_and_the_null_page(whole_llm, monkeypatch):
    staged = _spy_stage(whole_llm, monkeypatch)
    prompts = [[3, 1, 4], [1, 5], [9]]  # 6 tokens, 3 requests -> bucket (8, 4): one padded request
    params = SamplingParams(max_new_tokens=2)
    expected = ids(small_llm(dtype=torch.float32, enforce_eager=True, max_num_seqs=5).generate(prompts, params))
    assert ids(whole_llm.generate(prompts, params)) == expected
    size, _, (ids_, pos, logits_rows, qo, completes, pages, seq_lens, gqo, slots) = staged[0]
    assert size == (8, 4) and qo.tolist() == [0, 3, 5, 6, 6] and seq_lens.tolist()[3] == 0
    assert not pages[3].any() and logits_rows.tolist()[3] == 0 and not completes[3]
