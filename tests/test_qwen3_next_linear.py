"""Qwen3-Next's linear-attention layer on the state ops against transformers' own layer, in float32
on random weights: requests packed together, split into chunks, continued through decode steps and
one of them preempted and re-prefilled in another slot; and the refusal of mixture-of-experts configs."""

import pytest
import torch

from tscompile.kv_cache.state_pool import StatePool, StateSlotMetadata
from tscompile.models.qwen3_next_linear import GatedDeltaNet, check_dense, in_proj_rows, moe_layers, state_spec

transformers = pytest.importorskip("transformers")
qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


def _config(**overrides):
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
              layer_types=["linear_attention"] * 3 + ["full_attention"], num_experts=0, mlp_only_layers=[0, 1, 2, 3])
    kw.update(overrides)
    return transformers.Qwen3NextConfig(**kw)


def _layers(seed=0):
    cfg = _config()
    torch.manual_seed(seed)
    hf = qwen3_next.Qwen3NextGatedDeltaNet(cfg, 0).float().eval()
    with torch.no_grad():
        for p in hf.parameters():  # every weight random (the norm's too), never the init's ones/zeros
            p.copy_(torch.randn_like(p) * 0.3)
        hf.A_log.copy_(torch.rand_like(hf.A_log).log())
    ours = GatedDeltaNet(cfg).float().eval()
    state = hf.state_dict()  # the two input projections are one native in_proj, rows regrouped by kind
    stored = torch.cat([state.pop("in_proj_qkvz.weight"), state.pop("in_proj_ba.weight")])
    state["in_proj.weight"] = torch.full_like(stored, float("nan"))
    state["in_proj.weight"][list(in_proj_rows(cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                                              cfg.linear_key_head_dim, cfg.linear_value_head_dim))] = stored
    assert not state["in_proj.weight"].isnan().any()  # every native row filled once
    ours.load_state_dict(state)
    return cfg, hf, ours


@pytest.mark.parametrize("impl,triton_chunk", [("torch", 0), ("triton", 0), ("triton", 16)],
                         ids=["torch", "triton-walk", "triton-chunked"])
def test_layer_matches_transformers_across_chunks_and_preemption(impl, triton_chunk):
    cfg, hf, ours = _layers()
    ours.impl, ours.triton_chunk = impl, triton_chunk
    gen = torch.Generator().manual_seed(1)
    xs = {"a": torch.randn(9, cfg.hidden_size, generator=gen), "b": torch.randn(6, cfg.hidden_size, generator=gen)}
    with torch.no_grad():
        want = {n: hf(x[None])[0] for n, x in xs.items()}
    spec = state_spec(cfg)
    pool, meta = StatePool.allocate(spec, 5, "cpu"), StateSlotMetadata("cpu")
    pool.fill_(float("nan"))
    conv, ssm = pool.layer_state(spec.layer_ids[0])
    got = {"a": [], "b": []}

    def step(pieces, bucket):
        slots, flags = meta.refresh([pool.slots.slot_of(n) for n, *_ in pieces], [h for _, h, _, _ in pieces], bucket)
        lens = [hi - lo for *_, lo, hi in pieces] + [1] * (bucket - len(pieces))  # padding rows: one each
        cu = torch.tensor([0] + lens).cumsum(0)
        pad = torch.randn(bucket - len(pieces), cfg.hidden_size, generator=gen)
        x = torch.cat([xs[n][lo:hi] for n, _, lo, hi in pieces] + [pad])
        with torch.no_grad():
            out = ours(x, conv, ssm, slots, cu, flags)
        for i, (n, *_) in enumerate(pieces):
            got[n].append(out[cu[i]:cu[i + 1]])

    pool.slots.allocate("a")
    pool.slots.allocate("b")
    step([("a", False, 0, 4), ("b", False, 0, 3)], 2)
    pool.slots.free("b")  # preempted: b's partial state is dropped and it re-prefills elsewhere
    got["b"] = []
    pool.slots.allocate("c")
    pool.slots.allocate("b")
    step([("b", False, 0, 5), ("a", True, 4, 8)], 4)
    step([("a", True, 8, 9), ("b", True, 5, 6)], 4)  # decode
    for n in xs:
        torch.testing.assert_close(torch.cat(got[n]), want[n], rtol=1e-4, atol=1e-4)


def test_moe_configs_are_refused():
    dense = _config()
    assert moe_layers(dense) == []
    check_dense(dense)
    sparse = _config(num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0, 1], decoder_sparse_step=1)
    assert moe_layers(sparse) == [2, 3]
    with pytest.raises(ValueError, match=r"^tscompile: Qwen3-Next layers \[2, 3\] use a mixture of experts"):
        check_dense(sparse)


def test_state_spec_of_config():
    spec = state_spec(_config())
    assert spec.layer_ids == (0, 1, 2)
    assert (spec.conv_channels, spec.conv_width) == (2 * 2 * 8 + 4 * 6, 4)
    assert (spec.num_v_heads, spec.key_head_dim, spec.value_head_dim) == (4, 8, 6)
