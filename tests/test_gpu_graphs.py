"""Decode CUDA graphs on a GPU: replay equals the eager refresh path, padding never touches a live
page, above-ladder decode, and the graph-debug pointer guard. Skipped without CUDA."""

import pytest
import torch

import tscompile
from tscompile import SamplingParams
from tscompile.attention import AttentionMetadata
from tscompile.runtime.step_builder import ScheduledBatch
from helpers import ids, poison_decode_metadata_at_each_replay

pytestmark = pytest.mark.gpu

PROMPTS = [[(7 * i + j) % 500 + 1 for j in range(5 + 9 * i)] for i in range(7)]


def make(model="llama-tiny", backend="torch", tuned=False, **kw):
    """A CUDA engine; ``tuned=True`` turns on the bs=1 decode graph's coordinate-descent tuning
    (off by default: tens of seconds per engine)."""
    kw.setdefault("max_model_len", 256)
    kw.setdefault("max_num_seqs", 16)
    kw.setdefault("page_size", 16)
    kw.setdefault("dtype", torch.float32)
    kw["compile_options"] = dict(kw.get("compile_options", {"decode_ladder": (1, 2, 4, 8)}))
    if tuned:
        kw["compile_options"].setdefault("static_inductor_options", {"coordinate_descent_tuning": True})
    return tscompile.LLM(model, attention_backend=backend, device="cuda", **kw)


def _prefill_all(llm, prompts):
    reqs = [llm.add_request(p, SamplingParams(max_new_tokens=50)) for p in prompts]
    while any(not r.prefill_done or not r.output for r in reqs):
        llm.step()
    llm.sync()  # the direct runner calls below read every last token on the host
    return reqs


def _decode_once(llm, reqs, *, graphed):
    """One decode step for ``reqs``; graphed=False runs the compiled step eagerly at the same bs."""
    graphs = llm.runner.graphs
    plan = llm.scheduler.plan(ScheduledBatch([], list(reqs)))
    graphs.replay = graphed  # False: the same ladder bs and refresh, the step run without its graph
    try:
        return llm.runner.execute(plan)
    finally:
        graphs.replay = True


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("n_live", [1, 3, 5, 8])
def test_replay_equals_eager_refresh_bitwise_and_padding_never_writes_live_pages(backend, n_live):
    llm = make(backend=backend)
    reqs = _prefill_all(llm, PROMPTS[:n_live])
    pool = llm.pool.groups[0]
    before = {lid: (k.clone(), pool.v[lid].clone()) for lid, k in pool.k.items()}
    graph_tokens = _decode_once(llm, reqs, graphed=True)
    after_graph = {lid: (k.clone(), pool.v[lid].clone()) for lid, k in pool.k.items()}
    for lid in pool.k:  # restore, replay the same step eagerly at the same padded bs
        pool.k[lid].copy_(before[lid][0])
        pool.v[lid].copy_(before[lid][1])
    eager_tokens = _decode_once(llm, reqs, graphed=False)
    assert graph_tokens == eager_tokens
    live_slots = set()
    for r in reqs:
        block = llm.scheduler.block_tables[0][r.slot, r.num_computed // 16]
        live_slots.add(int(block) * 16 + r.num_computed % 16)
    for lid in pool.k:
        g_k, e_k = after_graph[lid][0], pool.k[lid]
        assert torch.equal(g_k[1:], e_k[1:]), "graph and eager wrote different live K"
        changed = (g_k.view(-1, *g_k.shape[2:]) != before[lid][0].view(-1, *g_k.shape[2:])).flatten(1).any(1)
        changed[: 16] = False  # the null page takes the padded rows' writes
        assert set(changed.nonzero()[:, 0].tolist()) <= live_slots


def test_padded_rows_write_only_the_null_page_with_a_poisoned_pool():
    llm = make()
    reqs = _prefill_all(llm, PROMPTS[:3])  # bs 4: one padded row
    pool = llm.pool.groups[0]
    for lid in pool.k:  # poison every page no live request owns
        owned = torch.zeros(pool.num_pages, dtype=torch.bool, device="cuda")
        for r in reqs:
            owned[torch.tensor(r.blocks[0], device="cuda")] = True
        pool.k[lid][~owned] = float("nan")
        pool.v[lid][~owned] = float("nan")
    snapshot = {lid: pool.k[lid].clone() for lid in pool.k}
    tokens = _decode_once(llm, reqs, graphed=True)
    assert llm.runner.decode.padded_size(3) == 4
    assert all(0 <= t < llm.config.vocab_size for t in tokens)
    for lid in pool.k:
        k = pool.k[lid]
        assert not torch.isnan(k[[b for r in reqs for b in r.blocks[0]]]).any()
        same = (k[1:] == snapshot[lid][1:]) | (torch.isnan(k[1:]) & torch.isnan(snapshot[lid][1:]))
        owned_rows = torch.tensor([b - 1 for r in reqs for b in r.blocks[0]], device="cuda")
        same[owned_rows] = True
        assert same.all(), "a padded row wrote outside the null page"


def test_above_ladder_decode_runs_eagerly_and_matches():
    params = SamplingParams(max_new_tokens=6)
    eager = ids(make(enforce_eager=True).generate(PROMPTS, params))
    llm = make(compile_options={"decode_ladder": (1, 2, 4)})
    from tscompile.counters import counters
    before = counters["decode_eager"]
    assert ids(llm.generate(PROMPTS, params)) == eager
    assert counters["decode_eager"] > before  # 7 requests > ladder top 4


def test_a_ladder_without_1_pads_a_single_request_to_2_and_compiles_no_bs1_graph():
    """``decode_ladder`` (2, 4, 8): a lone request's decode steps replay the bs=2 graph (one padding
    row), its tokens are eager's, and the engine never compiles its bs=1 step (the start-up lever
    `scripts/startup.py --decode-ladder` prices)."""
    from tscompile.counters import counters

    params = SamplingParams(max_new_tokens=6)
    eager = ids(make(enforce_eager=True).generate(PROMPTS[:1], params))
    llm = make(compile_options={"decode_ladder": (2, 4, 8)})
    assert llm.runner.decode.padded_size(1) == 2
    compiled_one = []
    llm.runner.decode.compiled_one = lambda *a, **kw: compiled_one.append(1)  # would compile the bs=1 graph
    replays, direct = counters["decode_replays"], counters["decode_eager"]
    assert ids(llm.generate(PROMPTS[:1], params)) == eager
    # every decode step a replay: none ran outside the graphs
    assert counters["decode_replays"] > replays and counters["decode_eager"] == direct
    assert not compiled_one and sorted(k.batch_size for k in llm.runner.graphs.graphs) == [2, 4, 8]


def test_graph_debug_names_a_rebound_metadata_tensor(monkeypatch):
    monkeypatch.setenv("TSCOMPILE_GRAPH_DEBUG", "1")
    llm = make()
    reqs = _prefill_all(llm, PROMPTS[:2])
    leaf = llm.attention.leaves[0]
    views = leaf._decode_views_by_bs[2]
    leaf._decode_views_by_bs[2] = AttentionMetadata(views.page_table.clone(), views.seq_lens, views.qo_indptr, True)
    with pytest.raises(RuntimeError, match=r"leaves\[0\]\.forward_decode_metadata\.page_table"):
        _decode_once(llm, reqs, graphed=True)


def _decode_kernels(runner, bs: int) -> list[str]:
    """The CUDA kernels of one compiled decode step at ``bs``, run without its graph (compiled already)
    so that the profiler sees each kernel."""
    runner.decode.idle_inputs(bs)
    runner.decode.run_compiled(bs, True)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        runner.decode.run_compiled(bs, True)
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def test_bs1_decode_runs_its_matmuls_as_gemv_reductions_and_bs2_through_cublas():
    """The bs=1 decode graph is compiled static, so coordinate-descent tuning asked for in
    ``static_inductor_options`` reaches it: Inductor lowers its
    one-row matmuls to its own reductions, so no cuBLAS kernel runs; the dynamic graph (bs=2) calls
    cuBLAS (which proves the check can see a cuBLAS kernel). Tokens as eager's. The Triton attention
    backend: the torch backend's decode attention is itself a cuBLAS batched matmul."""
    import re

    cublas = re.compile(r"gemm|gemv|nvjet|cutlass|xmma|splitK", re.IGNORECASE)
    params = SamplingParams(max_new_tokens=4)
    eager = ids(make(backend="triton", enforce_eager=True).generate(PROMPTS[:1], params))
    llm = make(backend="triton", tuned=True, compile_options={"decode_ladder": (1, 2)})
    assert ids(llm.generate(PROMPTS[:1], params)) == eager
    one, two = _decode_kernels(llm.runner, 1), _decode_kernels(llm.runner, 2)
    assert one and not [k for k in one if cublas.search(k)], one
    assert [k for k in two if cublas.search(k)], two


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_decode_gemv_pass_runs_the_listed_projections_in_the_gemv_kernel_and_gives_eager_tokens(monkeypatch, pdl):
    """``KernelPolicy.decode_gemv`` (passes/decode_gemv.py) with llama-tiny's qkv, output and gate/up
    shapes in the launch table (a 640-id vocabulary, so the LM head's shape is no projection's): one
    bs=1 step runs ``_gemv_kernel`` three times per layer and cuBLAS for the down projections and the
    LM head only; the dynamic bs=2 graph is untouched; tokens as eager's (float32). ``pdl``
    (``KernelPolicy.decode_pdl``, on by default): the kernel and the graph's Inductor kernels
    (``triton.enable_pdl``) launch with PDL; without it neither does; eager's tokens either way. An
    engine with ``decode_gemv=False`` in the same process runs no ``_gemv_kernel``."""
    import re

    from tscompile.custom_ops import triton_gemv as tg

    if pdl and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs Hopper or later")
    monkeypatch.setattr(tg, "DECODE_GEMV_DEVICES", (torch.cuda.get_device_name(),))  # any GPU: the table is llama-tiny's
    monkeypatch.setattr(tg, "DECODE_GEMV_CONFIGS", {
        (512, 256): (1, 256, 1, 4, 1, "acc"), (256, 256): (2, 256, 1, 4, 1, "acc"), (1024, 256): (4, 128, 1, 8, 1, "acc")})
    pdl_calls, real = [], tg.gemv

    def counting(x, w, out=None, config=None, **kw):
        pdl_calls.append(kw.get("pdl", False))
        return real(x, w, out, config, **kw)

    monkeypatch.setattr(tg, "gemv", counting)
    model = tscompile.models.build_config("llama-tiny", vocab_size=640)
    cublas = re.compile(r"gemm|gemv|nvjet|cutlass|xmma|splitK", re.IGNORECASE)
    params = SamplingParams(max_new_tokens=6)
    eager = ids(make(model, backend="triton", enforce_eager=True).generate(PROMPTS[:1], params))
    llm = make(model, backend="triton", compile_options={"decode_ladder": (1, 2), "kernels": {"decode_pdl": pdl}})
    assert ids(llm.generate(PROMPTS[:1], params)) == eager
    assert pdl_calls and set(pdl_calls) == {pdl}
    one, two = _decode_kernels(llm.runner, 1), _decode_kernels(llm.runner, 2)
    layers = model.n_layers
    assert sum(k == "_gemv_kernel" for k in one) == 3 * layers, one
    # the down projections and the LM head: one cuBLAS GEMV each, or two with a split-K reduce
    assert layers + 1 <= len([k for k in one if cublas.search(k) and k != "_gemv_kernel"]) <= 2 * (layers + 1), one
    assert "_gemv_kernel" not in two, two
    off = make(model, backend="triton", compile_options={"decode_ladder": (1, 2), "kernels": {"decode_gemv": False}})
    assert ids(off.generate(PROMPTS[:1], params)) == eager
    assert "_gemv_kernel" not in _decode_kernels(off.runner, 1)


def test_tuned_decode_graph_puts_the_policys_kernels_back_and_gives_eager_tokens(monkeypatch):
    """Coordinate-descent tuning on in the bs=1 graph, with llama-tiny's shapes in the tuned policy
    (``DECODE_TUNED_MATMULS``: qkv 512x256 to the GEMV kernel, the output projection to cuBLAS): one
    bs=1 step runs ``_gemv_kernel`` once per layer and cuBLAS for the output projections only, gate/up,
    down and the LM head (a 640-id vocabulary) stay Inductor's reductions; tokens as eager's (float32)."""
    import re

    from tscompile.custom_ops import triton_gemv as tg

    monkeypatch.setattr(tg, "DECODE_GEMV_DEVICES", (torch.cuda.get_device_name(),))
    monkeypatch.setattr(tg, "DECODE_GEMV_CONFIGS", {(512, 256): (1, 256, 1, 4, 1, "acc")})
    monkeypatch.setattr(tg, "DECODE_TUNED_MATMULS", {(512, 256): "gemv", (256, 256): "cublas"})
    model = tscompile.models.build_config("llama-tiny", vocab_size=640)
    cublas = re.compile(r"gemm|gemv|nvjet|cutlass|xmma|splitK", re.IGNORECASE)
    params = SamplingParams(max_new_tokens=6)
    eager = ids(make(model, backend="triton", enforce_eager=True).generate(PROMPTS[:1], params))
    llm = make(model, backend="triton", tuned=True, compile_options={"decode_ladder": (1, 2)})
    assert ids(llm.generate(PROMPTS[:1], params)) == eager
    one = _decode_kernels(llm.runner, 1)
    layers = model.n_layers
    assert sum(k == "_gemv_kernel" for k in one) == layers, one
    assert layers <= len([k for k in one if cublas.search(k) and k != "_gemv_kernel"]) <= 2 * layers, one


@pytest.mark.parametrize("pdl, launch", [(False, (64, 128, 1, 4, 4, "dot")), (True, (64, 128, 1, 4, 4, "dot")),
                                         (True, (64, 128, 2, 4, 4, "dot_sum")), (True, (1, 128, 2, 4, 1, "acc_sum"))],
                         ids=["plain", "pdl", "pdl-dot_sum", "pdl-acc_sum"])
def test_batch_gemv_runs_the_kernel_in_the_decode_batch_graphs_and_gives_eager_tokens(monkeypatch, pdl, launch):
    """``KernelPolicy.batch_gemv`` with llama-tiny's qkv and gate/up weights listed at every row count the
    kernel takes: one bs=4 decode step of the dynamic-batch graph runs ``_gemv_kernel`` twice per layer
    (at capture the row count is 4: listed) and cuBLAS for o, down and the LM head; tokens as eager's
    (float32, three requests padded to the 4-row graph). ``pdl``: the graph's Inductor kernels and
    the kernel launch with PDL (``KernelPolicy.decode_pdl``). "dot_sum" and "acc_sum"
    (K split in two, summed by the last program; the table's 2-row pick is "acc_sum"): still no second
    kernel in the step."""
    import re

    from tscompile import piece_compiler
    from tscompile.custom_ops import triton_gemv as tg
    from tscompile.kernel_policy import KernelPolicy

    if pdl and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs Hopper or later")
    monkeypatch.setattr(tg, "DECODE_GEMV_DEVICES", (torch.cuda.get_device_name(),))  # any GPU: the table is llama-tiny's
    monkeypatch.setattr(tg, "BATCH_GEMV_CONFIGS", {(m, n, 256): launch for m in range(2, tg.MAX_ROWS + 1)
                                                   for n in (512, 1024)})
    pdl_calls, real = [], tg.gemv

    def counting(x, w, out=None, config=None, **kw):
        pdl_calls.append(kw.get("pdl", False))
        return real(x, w, out, config, **kw)

    monkeypatch.setattr(tg, "gemv", counting)
    assert piece_compiler.graph_pdl_on(KernelPolicy(decode_pdl=pdl), False, False) is pdl
    model = tscompile.models.build_config("llama-tiny", vocab_size=640)  # the LM head is no listed shape
    params = SamplingParams(max_new_tokens=6)
    eager = ids(make(model, backend="triton", enforce_eager=True).generate(PROMPTS[:3], params))
    llm = make(model, backend="triton", compile_options={"decode_ladder": (1, 2, 4), "kernels": {"decode_pdl": pdl}})
    assert ids(llm.generate(PROMPTS[:3], params)) == eager
    assert pdl_calls and set(pdl_calls) == {pdl}
    four = _decode_kernels(llm.runner, 4)
    layers = model.n_layers
    assert sum(k == "_gemv_kernel" for k in four) == 2 * layers, four
    assert "_sum_splits_kernel" not in four, four
    cublas = re.compile(r"gemm|gemv|nvjet|cutlass|xmma|splitK", re.IGNORECASE)
    assert len([k for k in four if cublas.search(k) and k != "_gemv_kernel"]) >= 2 * layers + 1, four


@pytest.mark.parametrize("model", ["llama-tiny", "narrow-tiny"])
def test_compiled_graphs_equal_enforce_eager_tokens(model):
    params = SamplingParams(max_new_tokens=8)
    eager = ids(make(model, enforce_eager=True, max_num_batched_tokens=32).generate(PROMPTS, params))
    assert ids(make(model, max_num_batched_tokens=32).generate(PROMPTS, params)) == eager


@pytest.mark.parametrize("speculative", [None, "ngram"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_graphs_holding_the_refresh_give_the_tokens_of_graphs_refreshed_before_replay(backend, speculative):
    """``KernelPolicy.graphed_refresh``: the decode and verify graphs refresh their metadata over the
    staged rows padded to the graph's batch size. Before each of their replays every decode metadata
    buffer is overwritten with wrong in-range values, and the tokens are still those of the default
    engine (greedy and sampled, 7 requests in graphs of 8, async scheduling, n-gram verify windows)."""
    spec = None if speculative is None else {"method": "ngram", "num_speculative_tokens": 3}
    params = [SamplingParams(max_new_tokens=6 + 2 * (i % 3), temperature=0.7 * (i % 2), top_k=50, seed=i)
              for i in range(len(PROMPTS))]
    want = ids(make(backend=backend, speculative_config=spec).generate(PROMPTS, params))
    llm = make(backend=backend, speculative_config=spec,
               compile_options={"decode_ladder": (1, 2, 4, 8), "kernels": {"graphed_refresh": True}})
    assert llm.runner.decode.graphed_refresh
    replayed = poison_decode_metadata_at_each_replay(llm)
    assert ids(llm.generate(PROMPTS, params)) == want
    assert (4 if speculative else 1) in {key.width for key in replayed}  # the verify graphs (N = 4) replayed too


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_async_scheduling_on_graphs_gives_the_tokens_of_synchronous_steps(backend):
    """Decode replays launched before the previous step's tokens are read (the input token gathered
    inside the graph), with greedy and sampled rows, finishing at different steps, and a sampled
    batch that needs a capture first (that step waits instead of chaining)."""
    from tscompile.counters import counters
    params = [SamplingParams(max_new_tokens=4 + 3 * (i % 4), temperature=0.7 * (i % 2), top_k=50, seed=i)
              for i in range(len(PROMPTS))]
    sync = ids(make(backend=backend, async_scheduling=False, tuned=True).generate(PROMPTS, params))
    counters.clear()
    assert ids(make(backend=backend, tuned=True).generate(PROMPTS, params)) == sync
    assert counters["decode_chained"] > 0 and counters["decode_replays"] > 0


def test_triton_equals_torch_on_llama_1b_ragged_greedy():
    prompts = [[(13 * i + 7 * j) % 128000 + 1 for j in range(n)] for i, n in enumerate([3, 40, 17, 130, 64])]
    params = SamplingParams(max_new_tokens=12)
    kw = dict(max_model_len=512, max_num_seqs=8, dtype=torch.float32, compile_options={})
    ref = ids(make("llama-1b", "torch", **kw).generate(prompts, params))
    torch.cuda.empty_cache()
    assert ids(make("llama-1b", "triton", **kw).generate(prompts, params)) == ref


# -- prefill graphs ---------------------------------------------------------------------------------
PREFILL_LADDER = {"decode_ladder": (1, 2, 4, 8), "token_ladder": (16, 32, 64), "prefill_graph_max_tokens": 64}


def _pool_state(llm):
    return [t.clone() for g in llm.pool.groups.values() for t in [*g.k.values(), *g.v.values()]]


def _restore(llm, state):
    for t, saved in zip([t for g in llm.pool.groups.values() for t in [*g.k.values(), *g.v.values()]], state):
        t.copy_(saved)


# (model, prefill_graph_mode): the narrowing model always runs piecewise prefill graphs; whole-step
# graphs need a backend whose extend can be captured (Triton; the torch backend falls back to piecewise)
MODEL_MODES = [("llama-tiny", "whole"), ("llama-tiny", "piecewise"), ("narrow-tiny", "piecewise")]


def _ladder(mode):
    return {**PREFILL_LADDER, "prefill_graph_mode": mode}


@pytest.mark.parametrize("model, mode", MODEL_MODES)
def test_prefill_pdl_gives_the_eager_tokens_in_whole_step_and_piecewise_graphs(monkeypatch, model, mode):
    """``KernelPolicy.prefill_pdl`` on Hopper: the prefill pieces compile with Inductor's PDL and the
    extend kernel launches with it (the attention leaves' impl carries it); prefill graphs (whole-step
    and per piece, the narrowing model's too) give the eager tokens (float32, Triton, a 64-token chunk
    and mixed steps)."""
    from tscompile import piece_compiler
    from tscompile.counters import counters
    from tscompile.kernel_policy import KernelPolicy

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs Hopper or later")
    assert piece_compiler.graph_pdl_on(KernelPolicy(prefill_pdl=True), False, True)  # the pieces really get it
    prompts, params = PROMPTS[:4], SamplingParams(max_new_tokens=4)
    eager = ids(make(model, "triton", enforce_eager=True, max_num_batched_tokens=64).generate(prompts, params))
    llm = make(model, "triton", compile_options={**_ladder(mode), "kernels": {"prefill_pdl": True}},
               max_num_batched_tokens=64)
    assert {leaf.impl for leaf in llm.attention.child_backends()} == {"triton/prefill_pdl=1"}
    counters.clear()
    assert ids(llm.generate(prompts, params)) == eager
    assert counters["prefill_graphed"] > 0


@pytest.mark.parametrize("model, backend, whole", [("llama-tiny", "triton", True), ("llama-tiny", "torch", False),
                                                   ("narrow-tiny", "triton", False)])
def test_default_prefill_graph_mode_picks_whole_step_graphs_where_they_can_run(model, backend, whole):
    """``prefill_graph_mode`` left unset ("auto"): whole-step graphs over Triton for a plain model,
    piecewise ones over the torch backend and for the narrowing model; tokens as eager's either way."""
    from tscompile.counters import counters
    options = {k: v for k, v in PREFILL_LADDER.items()}
    assert "prefill_graph_mode" not in options
    llm = make(model, backend, compile_options=options, max_num_batched_tokens=64)
    assert (llm.runner.prefill.whole is not None) is whole
    assert (llm.runner.prefill.buckets is not None) is not whole
    prompts = PROMPTS[:4]  # 74 tokens: chunked at 64
    params = SamplingParams(max_new_tokens=4)
    # the reference chunks as the engine does: the narrowing model's decoder keeps the last row of an
    # open chunk, so its tokens depend on the chunking (on the H200, narrow-tiny eager unchunked and
    # eager chunked at 64 differ at request 3's third token, for the torch and Triton backends alike)
    expected = ids(make(model, backend, enforce_eager=True, max_num_batched_tokens=64).generate(prompts, params))
    counters.clear()
    assert ids(llm.generate(prompts, params)) == expected
    assert counters["prefill_graphed"] > 0


@pytest.mark.parametrize("model, mode, backend", [(m, md, b) for m, md in MODEL_MODES for b in ("torch", "triton")
                                                   if (md, b) != ("whole", "torch")])
@pytest.mark.parametrize("lens, other", [([11], [14]), ([30, 20, 5, 1], [25, 22, 9, 3])])
def test_prefill_graph_replay_is_bitwise_the_same_padded_step_without_graphs(model, mode, backend, lens, other):
    """Capture on one batch, then replay on another of the same bucket and request count whose
    row plan differs (so a replay that kept the captured metadata would pick the wrong rows)."""
    from tscompile.counters import counters
    llm = make(model, backend, compile_options=_ladder(mode), max_num_batched_tokens=64)
    assert (llm.runner.prefill.whole is not None) == (mode == "whole")
    ids(llm.generate([[(7 * i + j) % 400 + 1 for j in range(n)] for i, n in enumerate(lens)],
                 SamplingParams(max_new_tokens=2)))  # captures this bucket's pieces
    counters.clear()
    for i, n in enumerate(other):
        llm.add_request([(11 * i + 3 * j) % 400 + 1 for j in range(n)], SamplingParams(max_new_tokens=2))
    plan = llm.scheduler.schedule()
    graphs = llm.runner.graphs  # the one switch, for whole-step graphs and graphed pieces alike
    before = _pool_state(llm)
    replayed = llm.runner.execute(plan)
    after_replay = _pool_state(llm)
    replays = counters["prefill_replays"]
    _restore(llm, before)
    graphs.replay = False  # the same padding, the same compiled pieces, no graphs
    try:
        plain = llm.runner.execute(plan)
    finally:
        graphs.replay = True
    after_plain = _pool_state(llm)
    assert replayed == plain and counters["prefill_replays"] == replays  # off means off
    for a, b in zip(after_replay, after_plain):  # bit patterns: unwritten pages may hold NaN
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert counters["prefill_captures"] == 0 and counters["prefill_replays"] > 0


@pytest.mark.parametrize("model, mode", MODEL_MODES)
def test_prefill_graphs_equal_eager_tokens_across_buckets_and_above_them(model, mode):
    from tscompile.counters import counters
    params = SamplingParams(max_new_tokens=6)
    prompts = PROMPTS + [[(3 * j) % 300 + 1 for j in range(90)]]  # 90 tokens: above the ladder top 64
    # the second batch: the same lengths in reverse order with other tokens, so its steps reach the
    # buckets the first batch captured instead of hitting the prefix cache
    again = [[t % 499 + 2 for t in p] for p in prompts[::-1]]
    backend = "triton" if mode == "whole" else "torch"
    eager = make(model, backend, enforce_eager=True, max_num_batched_tokens=100)
    expected = [ids(eager.generate(prompts, params)), ids(eager.generate(again, params))]
    counters.clear()
    llm = make(model, backend, compile_options=_ladder(mode), max_num_batched_tokens=100)
    assert (llm.runner.prefill.whole is not None) == (mode == "whole")
    assert [ids(llm.generate(prompts, params)), ids(llm.generate(again, params))] == expected
    assert counters["prefill_graphed"] > 0 and counters["prefill_eager"] > 0
    assert counters["prefill_replays"] > counters["prefill_captures"] > 0
    if model == "narrow-tiny":
        assert counters["decoder_rows_graphed"] > 0


@pytest.mark.parametrize("mode, backend", [("whole", "triton"), ("piecewise", "torch"), ("piecewise", "triton")])
def test_prefill_graph_padding_writes_only_the_null_page_with_a_poisoned_pool(mode, backend):
    from tscompile.counters import counters
    counters.clear()
    llm = make(backend=backend, compile_options=_ladder(mode))
    llm.pool.fill_(float("nan"))
    req = llm.add_request(list(range(1, 12)), SamplingParams(max_new_tokens=2))  # 11 tokens -> bucket 16
    llm.step()
    llm.sync()
    assert counters["prefill_graphed"] == 1 and counters["prefill_captures"] > 0 and len(req.output) == 1
    pool = llm.pool.groups[0]
    page = pool.geometry.page_size
    live = {s for b in req.blocks[0] for s in range(b * page, (b + 1) * page)}
    for lid, k in pool.k.items():
        written = set((~torch.isnan(k.view(-1, *k.shape[2:]))).flatten(1).any(1).nonzero()[:, 0].tolist())
        # 11 live rows in the request's pages, the 5 padded rows in the null page's slot 0
        assert written <= live | set(range(page)) and len(written & live) == 11 and 0 in written


def test_narrowing_decoder_above_the_largest_row_bucket_runs_without_graphs_and_matches():
    from tscompile.counters import counters
    params = SamplingParams(max_new_tokens=4)
    prompts = [[(3 * i + j) % 300 + 1 for j in range(9)] for i in range(6)]  # one step keeps 6 * 4 = 24 rows
    eager = ids(make("narrow-tiny", enforce_eager=True, max_num_batched_tokens=64).generate(prompts, params))
    counters.clear()
    llm = make("narrow-tiny", compile_options=PREFILL_LADDER, max_num_batched_tokens=64)
    llm.runner.prefill.buckets.row_ladder = (16,)  # 24 kept rows exceed it: the decoder stage runs the pieces ungraphed
    assert ids(llm.generate(prompts, params)) == eager
    assert counters["decoder_rows_eager"] >= 1 and counters["prefill_graphed"] >= 1
