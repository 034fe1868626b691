"""TSCOMPILE_ROPE_QK_TOGETHER: the query and key heads rotated as one tensor (one RoPE kernel in a
compiled graph) give the attention the same bits as the two separate rotations, in eager and in a
compiled engine; only the layout differs (q and k become strided views of one buffer)."""

from __future__ import annotations

import types

import pytest
import torch

import tscompile.models.llama as llama
from tscompile import SamplingParams
from tscompile.models import build_config, build_model
from helpers import ids, one_thread_fixture, small_llm

one_thread = pytest.fixture(autouse=True)(one_thread_fixture)


class _Recorder:
    """A stand-in attention: keeps what a layer passes and writes a function of q into ``out``."""

    def __init__(self):
        self.calls = []

    def forward(self, layer_id, mode, q, k, v, k_cache, v_cache, out, scale):
        self.calls.append((q.clone(), k.clone(), v.clone(), q.stride(), k.stride()))
        out.copy_(q * 0.5 + 1.0)


def _layer_inputs(dtype, together, monkeypatch):
    monkeypatch.setattr(llama, "ROPE_QK_TOGETHER", together)
    recorder = _Recorder()
    monkeypatch.setattr(llama, "get_forward_context", lambda: types.SimpleNamespace(attention=recorder,
                                                                                   attention_mode=None))
    model = build_model("llama-tiny", dtype=dtype, device="cpu", seed=3)
    rows = 7
    x = torch.randn(rows, build_config("llama-tiny").dim, generator=torch.Generator().manual_seed(5)).to(dtype)
    positions = torch.tensor([0, 1, 2, 9, 30, 31, 63])
    cos, sin = model.rope(positions)
    out = model.layers[0].attention(x, cos, sin)
    return recorder.calls[0], out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_rotation_of_q_and_k_passes_the_attention_the_same_bits(dtype, monkeypatch):
    (q0, k0, v0, qs0, ks0), out0 = _layer_inputs(dtype, False, monkeypatch)
    (q1, k1, v1, qs1, ks1), out1 = _layer_inputs(dtype, True, monkeypatch)
    assert torch.equal(q0, q1) and torch.equal(k0, k1) and torch.equal(v0, v1) and torch.equal(out0, out1)
    cfg = build_config("llama-tiny")
    # the layouts: separate contiguous rotations before, views of one [rows, Hq + Hkv, D] tensor now
    assert qs0 == (cfg.n_heads * cfg.head_dim, cfg.head_dim, 1)
    assert qs1 == ks1 == ((cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim, cfg.head_dim, 1)


def test_a_compiled_engine_gives_the_same_tokens_with_one_rotation(monkeypatch):
    """Inductor on the CPU, the torch backend: the strided q/k views reach the attention op inside a
    compiled graph and the greedy tokens do not move. The default side runs eager (compiled equals
    eager in float32 is tests/test_compile.py's claim), which keeps one compile out of the suite."""
    prompts = [[5, 9, 2, 7, 1, 3], [8, 8, 4]]
    params = SamplingParams(max_new_tokens=6)
    got, rotations = {}, {}
    real_rope = llama.apply_rope
    for together in (False, True):
        calls = []
        monkeypatch.setattr(llama, "apply_rope", lambda x, c, s: calls.append(x.shape[1]) or real_rope(x, c, s))
        monkeypatch.setattr(llama, "ROPE_QK_TOGETHER", together)
        llm = small_llm(enforce_eager=not together, dtype=torch.float32)
        got[together] = ids(llm.generate(prompts, params))
        rotations[together] = sorted(set(calls))  # head counts rotated (together: traced into the compiled graphs)
    cfg = build_config("llama-tiny")
    assert rotations == {False: sorted({cfg.n_heads, cfg.n_kv_heads}), True: [cfg.n_heads + cfg.n_kv_heads]}
    assert got[True] == got[False] and all(len(t) == 6 for t in got[True])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gpu_graphs_give_the_same_tokens_with_one_rotation(backend, monkeypatch):
    """On CUDA: the decode graphs (the bs=1 static one and the dynamic-batch one) and the whole-step
    prefill graph compiled with q and k rotated together give the default's greedy tokens."""
    prompts = [[5, 9, 2, 7, 1, 3, 11, 4], [8, 8, 4], [1, 2, 3, 4, 5]]
    params = SamplingParams(max_new_tokens=8)
    got = {}
    for together in (False, True):
        monkeypatch.setattr(llama, "ROPE_QK_TOGETHER", together)
        llm = small_llm(device="cuda", attention_backend=backend, dtype=torch.float32, max_model_len=64)
        got[together] = [ids(llm.generate(prompts[:1], params)), ids(llm.generate(prompts, params))]
    assert got[True] == got[False]
