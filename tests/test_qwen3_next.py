"""The hybrid Qwen3-Next model end to end: a tiny checkpoint written by transformers (three Gated
DeltaNet layers, two gated-attention layers, dense MLPs, every weight random), loaded natively and
run by the engine; greedy tokens equal transformers' ``generate`` in float32, eager and compiled,
with mixed batches, chunked prefill and preemption; what hybrid models refuse."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import tscompile
from tscompile.forward_context import ForwardMode
from tscompile.models import PRESETS, load_checkpoint, model_config
from tscompile.models.qwen3_next import Qwen3NextConfig, Qwen3NextTransformer

transformers = pytest.importorskip("transformers")

LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"]
TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
            layer_types=LAYER_TYPES, num_experts=0, mlp_only_layers=list(range(5)), tie_word_embeddings=False)
PROMPTS = [[17], [5, 250, 3, 99, 42], list(range(7, 20)), [(i * 37) % 300 for i in range(30)]]
NEW_TOKENS = 8


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every weight drawn, norms too (offset norms around 0, the gated norm around 1), decays spread."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=gen)
            if name.endswith("A_log"):
                p.copy_((0.5 + 3 * torch.rand(p.shape, generator=gen)).log())
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * r)
            elif "norm" in name:
                p.copy_((1.0 if "linear_attn.norm" in name else 0.0) + 0.3 * r)
            elif "embed_tokens" in name:
                p.copy_(r)
            else:
                p.copy_(r / p.shape[-1] ** 0.5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(checkpoint directory, the transformers model it holds, its greedy tokens for PROMPTS)."""
    torch.manual_seed(0)
    hf = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**TINY)).eval()
    _randomize(hf, 0)
    path = tmp_path_factory.mktemp("qwen3_next")
    hf.save_pretrained(path)
    hf.generation_config.eos_token_id = None  # both sides run the full length
    hf.generation_config.pad_token_id = 0
    want = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS)
            want.append(out[0, len(p):].tolist())
    return path, hf, want


def _engine(path, **kw):
    kw.setdefault("enforce_eager", True)
    kw.setdefault("page_size", 4)
    return tscompile.LLM(str(path), device="cpu", attention_backend="torch", max_model_len=64, **kw)


def _generate(llm, prompts=PROMPTS):
    params = tscompile.SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _record_plans(llm) -> list:
    """Every plan the engine's scheduler hands out from now on."""
    plans, schedule = [], llm.scheduler.schedule

    def recording():
        plan = schedule()
        if plan is not None:
            plans.append(plan)
        return plan

    llm.scheduler.schedule = recording
    return plans


def _all_slots_free(llm) -> bool:
    slots = llm.scheduler.state_slots.allocator
    return slots.num_free == slots.num_slots - 1


def test_checkpoint_loads_into_the_native_hybrid_model(checkpoint):
    path, hf, _ = checkpoint
    model, info = load_checkpoint(path, device="cpu")
    cfg = model.config
    assert info.architecture == "Qwen3NextForCausalLM" and isinstance(cfg, Qwen3NextConfig)
    assert cfg.layer_types == tuple(LAYER_TYPES) and cfg.rotary_dim == 4  # transformers' default factor 0.25
    assert [g.layer_ids for g in model.cache_groups()] == [(1, 4)]
    assert model.state_spec().layer_ids == (0, 2, 3)
    # the fused q/gate, k, v rows are transformers' projections, in that order
    attn, sd = model.layers[1].attention, hf.state_dict()
    fused = torch.cat([sd[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(attn.wqkv.weight, fused)


def test_eager_engine_equals_transformers_with_mixed_batches_and_chunked_prefill(checkpoint):
    """Chunks of at most 8 tokens: the 13- and 30-token prompts prefill over several steps while the
    short ones decode beside them (mixed steps), and their later chunks continue the state."""
    path, _, want = checkpoint
    llm = _engine(path, max_num_seqs=4, max_num_batched_tokens=8)
    plans = _record_plans(llm)
    assert _generate(llm) == want
    assert any(p.mode is ForwardMode.MIXED for p in plans)
    assert any(p.num_extends and (p.prefix_lens[: p.num_extends] > 0).any() for p in plans)  # a later chunk
    for p in plans:  # each running request its own slot, never the null slot
        assert len(set(p.state_slots.tolist())) == p.num_requests and 0 not in p.state_slots.tolist()
    assert _all_slots_free(llm)


def test_preemption_recomputes_the_state(checkpoint):
    """19 pages of 2 tokens for four requests growing to 9-38 tokens: a request is preempted, gives
    its state slot back and re-prefills from zero state into another slot; tokens do not change."""
    path, _, want = checkpoint
    llm = _engine(path, max_num_seqs=4, page_size=2, num_pages=20)
    plans = _record_plans(llm)
    assert _generate(llm) == want
    assert llm.scheduler.num_preemptions >= 1
    assert _all_slots_free(llm)
    # some request prefilled from position 0 twice: once admitted, once re-admitted after preemption
    first_chunks = [r for p in plans for r, pre in zip(p.request_ids[: p.num_extends], p.prefix_lens) if pre == 0]
    assert len(first_chunks) > len(set(first_chunks))


def test_compiled_engine_equals_transformers_batched_and_one_at_a_time(checkpoint):
    """enforce_eager=False: the decode step compiled whole (its state metadata lifted as graph inputs),
    the prefill compiled; mixed chunked batches, then each prompt alone."""
    path, _, want = checkpoint
    llm = _engine(path, enforce_eager=False, max_num_seqs=4, max_num_batched_tokens=8)
    assert _generate(llm) == want
    assert [_generate(llm, [p])[0] for p in PROMPTS] == want
    assert _all_slots_free(llm)


@pytest.mark.parametrize("fused,split", [(True, False), (True, True), (False, False)],
                         ids=["fused", "fused-split", "unfused"])
def test_compiled_decode_steps_run_the_fused_op_where_the_policy_asks(checkpoint, fused, split, monkeypatch):
    """``KernelPolicy.fused_gated_delta`` (on by default): a compiled engine's decode steps run each
    linear layer's gates, delta rule and gated norm as ``tscompile::gated_delta_fused``, its prefill
    steps the three ops; off, every step runs the three. Tokens are transformers' either way.
    ``split_gated_delta_heads`` hands the op 4 programs a head (the torch form ignores it)."""
    from tscompile.custom_ops import gated_delta_fused

    path, _, want = checkpoint
    calls = []
    inner = gated_delta_fused._gated_delta_torch
    monkeypatch.setattr(gated_delta_fused, "_gated_delta_torch", lambda q, *a: (calls.append(q.shape[0]), inner(q, *a)))
    llm = _engine(path, enforce_eager=False, max_num_seqs=4, max_num_batched_tokens=8,
                  compile_options={"kernels": {"fused_gated_delta": fused, "split_gated_delta_heads": split}})
    assert {layer.linear_attn.fused_decode for layer in llm.runner.model.layers if layer.linear} == {fused}
    assert {layer.linear_attn.value_blocks for layer in llm.runner.model.layers if layer.linear} == {4 if split else 1}
    assert _generate(llm) == want
    assert bool(calls) == fused and all(rows <= 4 for rows in calls)  # decode steps only: a row per request
    assert tscompile.KernelPolicy().fused_gated_delta
    eager = _engine(path, max_num_seqs=2)  # no compile options: the eager engine runs the three ops
    assert not any(layer.linear_attn.fused_decode for layer in eager.runner.model.layers if layer.linear)


def test_a_one_request_prefill_after_a_batched_one_compiles_nothing(checkpoint):
    """The state metadata's request dimension is unbacked, as the page tables' are: a prefill of one
    request after one of three reuses the compiled prefill graph instead of specializing to 1."""
    from tscompile.counters import counters

    path, _, want = checkpoint
    llm = _engine(path, enforce_eager=False, max_num_seqs=4, max_num_batched_tokens=64)
    compiled = []  # (requests, graphs compiled) per prefill step
    run = llm.runner.prefill.run

    def counting(plan):
        before = counters["graphs"]
        run(plan)
        compiled.append((plan.num_requests, counters["graphs"] - before))

    llm.runner.prefill.run = counting
    assert _generate(llm, PROMPTS[:3]) == want[:3]
    assert compiled[0][0] == 3 and compiled[0][1] > 0  # the first prefill compiled
    compiled.clear()
    assert _generate(llm, PROMPTS[3:4]) == want[3:4]
    assert compiled == [(1, 0)]


def test_graphed_pieces_run_the_state_ops_eagerly_and_equal_transformers(checkpoint):
    """Decode graphs and piecewise prefill graphs (``HostGraphs``: each bucket's pieces captured
    once and replayed, as on CUDA): the state ops are split ops, so a replayed piece never keeps the
    state slots and row offsets of the step that captured it; padded token buckets, chunked mixed
    batches (the GPU test's engine shape)."""
    from tscompile.counters import counters
    from tscompile.runtime.graph_runner import HostGraphs

    path, _, want = checkpoint
    llm = _engine(path, enforce_eager=False, page_size=16, max_num_seqs=4, max_num_batched_tokens=8,
                  compile_options={"decode_ladder": (1, 2, 4)})
    llm.runner.use_graphs(HostGraphs(), decode=True, prefill="piecewise")
    before = counters["prefill_replays"], counters["decode_replays"]
    assert _generate(llm) == want
    assert counters["prefill_replays"] > before[0] and counters["decode_replays"] > before[1]
    assert _all_slots_free(llm)


def test_the_state_kernels_launch_with_pdl_on_cuda_only_where_state_pdl_asks():
    from tscompile.runtime.build import state_kernel_impl

    assert state_kernel_impl(torch.device("cuda"), pdl=True) == "triton/pdl"
    assert state_kernel_impl(torch.device("cuda"), pdl=False) == "triton"
    assert state_kernel_impl(torch.device("cpu"), pdl=True) == "torch"
    llm = tscompile.LLM("qwen3-next-tiny", device="cpu", attention_backend="torch", max_model_len=64, max_num_seqs=2,
                        page_size=8, compile_options={"kernels": {"state_pdl": True}})
    assert {layer.linear_attn.impl for layer in llm.runner.model.layers if layer.linear} == {"torch"}
    assert not tscompile.KernelPolicy().state_pdl  # off until measured


def test_the_state_backend_supports_every_graph_kind(checkpoint):
    from tscompile.attention import resolve_cuda_graph_support

    llm = _engine(checkpoint[0], max_num_seqs=2)
    assert llm.attention.state.cuda_graph_support.whole_prefill_graph
    support = resolve_cuda_graph_support(llm.attention)
    assert support.support.decode_graph and support.support.prefill_graph
    assert "StateBackend" not in support.whole_prefill_culprits and support.prefill_culprits == ()
    assert not llm.scheduler.prefix_caching_supported  # a cached KV prefix has no recurrent state


def test_whole_step_prefill_graphs_read_the_state_metadata_from_their_bucket_and_equal_transformers(checkpoint):
    """Whole-step prefill graphs (``HostGraphs``; a CUDA graph reads its inputs at the addresses of
    its capture): every graphed step publishes its state slots, row offsets and flags as views of its
    bucket's persistent buffers, the same storage at every step of a bucket, and the padded request
    rows (null slot, empty range, fresh state) leave the live slots alone: transformers' tokens, in
    chunked mixed batches and one prompt at a time."""
    from tscompile.counters import counters
    from tscompile.runtime.graph_runner import HostGraphs

    path, _, want = checkpoint
    llm = _engine(path, enforce_eager=False, page_size=16, max_num_seqs=4, max_num_batched_tokens=8,
                  compile_options={"decode_ladder": (1, 2, 4), "token_ladder": (4, 8), "prefill_graph_max_tokens": 8})
    llm.runner.use_graphs(HostGraphs(), decode=True, prefill="whole")
    whole, state = llm.runner.prefill.whole, llm.attention.state
    published: dict[tuple, set] = {}  # bucket -> the (slots, offsets, flags) storage its steps published
    stage = whole.stage

    def staging(size, fill):
        dev = stage(size, fill)
        staged = tuple(t.data_ptr() for t in dev[-3:])
        original_init = state.init_forward_metadata

        def init(plan, arrays):
            original_init(plan, arrays)
            meta = state.forward_extend_metadata
            published.setdefault(size, set()).add(
                (staged, tuple(t.data_ptr() for t in (meta.state_slots, meta.cu_seqlens, meta.has_state))))
            state.init_forward_metadata = original_init

        state.init_forward_metadata = init
        return dev

    whole.stage = staging
    before = counters["prefill_graphed"]
    assert _generate(llm) == want
    assert [_generate(llm, [p])[0] for p in PROMPTS] == want
    assert counters["prefill_graphed"] > before and published
    for size, seen in published.items():
        assert len(seen) == 1, (size, seen)  # one storage per bucket, step after step
        ((staged, meta),) = seen
        assert staged == meta  # the metadata the model reads is the bucket's buffers
    assert any(requests > 1 for _, requests in published)  # a batch of several requests ran graphed
    # the sampled variant's graphs are captured on sampling placeholders: seeded samples as eager's
    sampled = [tscompile.SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.8, seed=s, ignore_eos=True)
               for s in range(len(PROMPTS))]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    eager = _engine(path, max_num_seqs=4, max_num_batched_tokens=8)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sampled)] == \
        [o.outputs[0].token_ids for o in eager.generate(prompts, sampled)]
    assert _all_slots_free(llm)


def test_config_mapping_and_moe_refusal(checkpoint, tmp_path):
    path = checkpoint[0]
    cfg = model_config(str(path))
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim) == (2, 4, 8)
    assert cfg.partial_rotary_factor == 0.25 and cfg.head_dim == 16 and cfg.qk_norm
    moe = tmp_path / "moe"
    shutil.copytree(path, moe)
    raw = json.loads((moe / "config.json").read_text())
    (moe / "config.json").write_text(json.dumps({**raw, "num_experts": 4, "mlp_only_layers": [0, 1]}))
    with pytest.raises(ValueError, match=r"^tscompile: Qwen3-Next layers \[2, 3, 4\] use a mixture of experts"):
        load_checkpoint(moe, device="cpu")


@pytest.mark.parametrize("method", ["ngram", "replay"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
def test_speculative_greedy_tokens_equal_transformers(checkpoint, method, eager):
    """Verify windows of 4 rows over the state layers: a request that keeps fewer rows than its
    window gets the state after its kept rows from the step's checkpoints; the greedy tokens stay
    transformers' (n-gram drafts are mostly rejected on random weights, replayed ones all kept).
    Compiled, the verify steps replay graphs per (bs, 4) and the prefill pieces per bucket."""
    from tscompile.counters import counters
    from tscompile.runtime.graph_runner import HostGraphs

    path, _, want = checkpoint
    llm = _engine(path, enforce_eager=eager, max_num_seqs=4, max_num_batched_tokens=8,
                  speculative_config={"method": method, "num_speculative_tokens": 3,
                                      "prompt_lookup_min": 1, "prompt_lookup_max": 2} if method == "ngram"
                  else {"method": method, "num_speculative_tokens": 3})
    if not eager:
        llm.runner.use_graphs(HostGraphs(), decode=True, prefill="piecewise")
    if method == "replay":
        llm.set_replay_references({tuple(p): w for p, w in zip(PROMPTS, want)})
    replays = counters["decode_replays"]
    assert _generate(llm) == want
    assert eager or counters["decode_replays"] > replays
    assert [_generate(llm, [p])[0] for p in PROMPTS] == want
    verify = llm._verify
    assert verify.verify_steps > 0 and verify.proposed_drafts > 0
    if method == "replay":  # every draft kept: every state already the window's last
        assert verify.accepted_drafts == verify.proposed_drafts
    else:  # drafts rejected: states committed from the checkpoints at the kept rows
        assert verify.accepted_drafts < verify.proposed_drafts
    assert _all_slots_free(llm)


def test_tensor_parallel_and_export_are_refused(checkpoint, tmp_path):
    from tscompile.distributed.engine import check_tensor_parallel_model
    from tscompile.package.build import export_package

    path = checkpoint[0]
    with pytest.raises(ValueError, match=r"^tscompile: tensor_parallel_size 2 is not supported for a model with"):
        check_tensor_parallel_model(str(path), 2, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^tscompile: qwen3-next-tiny has recurrent-state"):
        export_package("qwen3-next-tiny", tmp_path / "m.pt2", device="cpu")


def test_presets_and_the_roofline_count_state_bytes():
    from tscompile.bench import roofline

    cfg = PRESETS["qwen3-next-1b"]
    assert cfg.layer_types.count("full_attention") == 4 and cfg.n_layers == 16
    bs, ctx = 32, 100.0
    got = roofline.decode_step_bytes(cfg, bs, ctx, 2)
    # per slot: 12 linear layers x (conv window 8192 x 3 + state 32 x 128 x 128) float32; read + written
    slot = 12 * 4 * (8192 * 3 + 32 * 128 * 128)
    assert got.state_bytes == 2 * bs * slot
    assert got.kv_bytes == round(bs * ctx * 4 * 2 * 2 * 256 * 2)  # 4 attention layers, 2 KV heads of 256
    assert got.total == got.weight_bytes + got.kv_bytes + got.state_bytes
    # every weight once (the tied embedding as the head): the model's parameter count
    with torch.device("meta"):
        model = Qwen3NextTransformer(cfg)
    assert got.weight_bytes == 2 * sum(p.numel() for p in model.parameters())


def test_a_preset_runs_through_the_engine():
    llm = tscompile.LLM("qwen3-next-tiny", device="cpu", attention_backend="torch", enforce_eager=True,
                        max_model_len=64, max_num_seqs=2, page_size=8)
    outs = llm.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4] * 9}],
                        tscompile.SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]


def test_the_kernel_policy_gives_the_linear_layers_the_chunked_triton_form():
    """``chunked_gated_delta``: every linear-attention layer's Triton gated delta rule chunks its
    multi-row steps (16 rows); by default, and in an eager engine, it walks the tokens."""
    def chunks(**kw):
        llm = tscompile.LLM("qwen3-next-tiny", device="cpu", attention_backend="torch", max_model_len=64,
                            max_num_seqs=2, page_size=8, **kw)
        return {layer.linear_attn.triton_chunk for layer in llm.runner.model.layers if layer.linear}

    assert chunks(compile_options={"kernels": {"chunked_gated_delta": True}}) == {16}
    assert chunks() == {0} and chunks(enforce_eager=True) == {0}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("prefill", ["whole", "piecewise"])
@pytest.mark.parametrize("chunked", [False, True], ids=["walk", "chunked"])
def test_cuda_graphs_equal_transformers_in_float32(checkpoint, chunked, prefill):
    """On the GPU with graphs on (decode graphs per ladder size; prefill graphs per token and request
    bucket, whole-step (the state kernels captured with the step, each graph captured on a
    placeholder step) or piecewise (the state kernels in Triton between the pieces); the gated delta
    rule's prefill walking the tokens or chunked): the greedy tokens of transformers in float32,
    batched with padding rows (3 and 4 live rows in the bs 4 graph) and one request at a time (bs 1
    graph)."""
    from tscompile.counters import counters

    path, _, want = checkpoint
    llm = tscompile.LLM(str(path), device="cuda", dtype=torch.float32, attention_backend="triton",
                        max_model_len=64, page_size=16, max_num_seqs=4, max_num_batched_tokens=8,
                        compile_options={"decode_ladder": (1, 2, 4), "kernels": {"chunked_gated_delta": chunked},
                                         "prefill_graph_mode": prefill})
    assert (llm.runner.prefill.whole is not None) == (prefill == "whole")
    assert {layer.linear_attn.impl for layer in llm.runner.model.layers if layer.linear} == {"triton"}
    before = counters["decode_replays"], counters["prefill_replays"], counters["prefill_graphed"]
    assert _generate(llm) == want
    assert [_generate(llm, [p])[0] for p in PROMPTS] == want
    assert counters["decode_replays"] > before[0] and counters["prefill_replays"] > before[1]
    assert counters["prefill_graphed"] > before[2]
    assert _all_slots_free(llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_state_kernels_launched_with_pdl_equal_transformers_in_float32(checkpoint):
    """``KernelPolicy.state_pdl``: the convolution and gated delta kernels launched with PDL (where the
    GPU has it) inside the decode and whole-step prefill graphs give transformers' float32 tokens."""
    from tscompile.custom_ops.triton_attention import pdl_available

    path, _, want = checkpoint
    llm = tscompile.LLM(str(path), device="cuda", dtype=torch.float32, attention_backend="triton",
                        max_model_len=64, page_size=16, max_num_seqs=4, max_num_batched_tokens=8,
                        compile_options={"decode_ladder": (1, 2, 4), "kernels": {"state_pdl": True}})
    assert {layer.linear_attn.impl for layer in llm.runner.model.layers if layer.linear} == \
        {"triton/pdl" if pdl_available() else "triton"}
    assert _generate(llm) == want
    assert [_generate(llm, [p])[0] for p in PROMPTS] == want
    assert _all_slots_free(llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fused,split", [(True, False), (True, True), (False, False)],
                         ids=["fused", "fused-split", "unfused"])
def test_decode_graphs_with_and_without_the_fused_op_equal_transformers_in_float32(checkpoint, fused, split,
                                                                                   monkeypatch):
    """``KernelPolicy.fused_gated_delta``: the decode graphs' linear layers as one Triton kernel each
    (gates, delta rule, gated norm; with ``split_gated_delta_heads`` each head over several programs)
    or as three; transformers' float32 tokens either way."""
    from tscompile.custom_ops import triton_gemv

    monkeypatch.setattr(triton_gemv, "_ARRIVALS", {})  # this engine's launches make their own counters
    path, _, want = checkpoint
    llm = tscompile.LLM(str(path), device="cuda", dtype=torch.float32, attention_backend="triton",
                        max_model_len=64, page_size=16, max_num_seqs=4, max_num_batched_tokens=8,
                        compile_options={"decode_ladder": (1, 2, 4),
                                         "kernels": {"fused_gated_delta": fused, "split_gated_delta_heads": split}})
    assert {layer.linear_attn.fused_decode for layer in llm.runner.model.layers if layer.linear} == {fused}
    assert {layer.linear_attn.value_blocks for layer in llm.runner.model.layers if layer.linear} == {4 if split else 1}
    assert _generate(llm) == want
    assert [_generate(llm, [p])[0] for p in PROMPTS] == want
    assert _all_slots_free(llm)
    # the split kernel ran (without its counters it falls back to whole heads, silently)
    assert (("gated_delta", "cuda", torch.cuda.current_device()) in triton_gemv._ARRIVALS) == split


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["ngram", "replay"])
def test_cuda_graphs_with_speculation_equal_transformers_in_float32(checkpoint, method):
    """Verify windows of 4 rows replayed from graphs on the GPU: the Triton state kernels store their
    checkpoints and the commit kernel puts each slot at its kept rows inside the graph; the greedy
    tokens stay transformers' in float32 (n-gram drafts mostly rejected, replayed ones all kept)."""
    from tscompile.counters import counters

    path, _, want = checkpoint
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        spec.update(prompt_lookup_min=1, prompt_lookup_max=2)
    llm = tscompile.LLM(str(path), device="cuda", dtype=torch.float32, attention_backend="triton",
                        max_model_len=64, page_size=16, max_num_seqs=4, max_num_batched_tokens=8,
                        compile_options={"decode_ladder": (1, 2, 4)}, speculative_config=spec)
    if method == "replay":
        llm.set_replay_references({tuple(p): w for p, w in zip(PROMPTS, want)})
    replays = counters["decode_replays"]
    assert _generate(llm) == want
    assert [_generate(llm, [p])[0] for p in PROMPTS] == want
    verify = llm._verify
    assert counters["decode_replays"] > replays and verify.verify_steps > 0
    if method == "replay":
        assert verify.accepted_drafts == verify.proposed_drafts > 0
    else:
        assert verify.accepted_drafts < verify.proposed_drafts
    assert _all_slots_free(llm)


def test_a_hybrid_model_compiles_without_combo_kernels_unless_asked(monkeypatch):
    """Every graph of a model with recurrent-state layers compiles with combo kernels off (the CUDA
    default for static graphs keeps them for dense models); a user's own setting wins."""
    from tscompile import piece_compiler
    from tscompile.runtime.build import without_combo_kernels
    from tscompile.config import TscompileConfig

    seen = []
    original = piece_compiler.piece_inductor_patches

    def spy(config, *args, **kwargs):
        seen.append(dict(config.inductor_options).get("combo_kernels"))
        return original(config, *args, **kwargs)

    monkeypatch.setattr(piece_compiler, "piece_inductor_patches", spy)
    llm = tscompile.LLM("qwen3-next-tiny", device="cpu", attention_backend="torch", max_model_len=64, max_num_seqs=2,
                        page_size=8)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], tscompile.SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert seen and set(seen) == {False}
    patches = original(without_combo_kernels(TscompileConfig()), True, device_type="cuda", split_piece=False,
                       cudagraph_trees=False)
    assert patches["combo_kernels"] is False
    mine = TscompileConfig.from_options({"inductor_options": {"combo_kernels": True}})
    assert without_combo_kernels(mine) is mine
