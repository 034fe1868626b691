"""Exported packages on a GPU: package tokens equal engine tokens (llama-1b and the narrowing model,
float32, greedy and seeded sampling), a bf16 package's logits equal the engine's within what bf16
costs (its tokens may part from the engine's at a near-tie: the two are different graphs), a package
exported from a Hugging Face checkpoint carries its tokenizer and stop ids, external weights are used
in place, and the limits and release refusals. Skipped without CUDA.

An export costs minutes on a GPU (two AOTInductor programs), so each model is exported once per
module, with small bounds, and shared. The exports build with the system ``g++`` where it exists:
a ``CXX`` that names a compiler whose libraries do not link ``libstdc++`` (the GPU machine has
one) makes packages that crash when loaded, and the export's own rebuild would double its time.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

import tscompile
import tscompile.version
from tscompile import SamplingParams
from tscompile.counters import counters
from tscompile.export import export_package, read_package_metadata
from tscompile.forward_context import ForwardMode
from tscompile.runtime.graph_runner import CudaGraphs
from helpers import (assert_other_releases_refused, assert_text_package_stops_like_engine, ids, record_modes,
                     write_text_checkpoint)
from package_logits import assert_bf16_package_logits_match_engine

# one worker builds the module's packages once (pytest-xdist's loadgroup)
pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("gpu_packages")]

SYSTEM_GXX = "/usr/bin/g++"
BOUNDS = dict(max_num_seqs=4, max_model_len=64, page_size=16, max_num_batched_tokens=64)
NEW_TOKENS = 8


def _prompts(vocab: int) -> list[list[int]]:
    """Six ragged prompts (1 to 40 tokens) of ids spread over the vocabulary."""
    lengths = [9, 1, 40, 3, 17, 2]
    return [[(97 * i + 31 * j + 5) % (vocab - 1) + 1 for j in range(n)] for i, n in enumerate(lengths)]


def _export(tmp_path_factory, model: str, *, weights: str, verify: bool, dtype: torch.dtype = torch.float32,
            name: str | None = None):
    """One CUDA package of ``model`` (a preset or a checkpoint directory, then ``name`` names the
    file); built with the system g++ when there is one."""
    name = name or model
    path = tmp_path_factory.mktemp(f"gpu-package-{name}") / f"{name}.pt2"
    options = {}
    with pytest.MonkeyPatch.context() as patch:
        if os.path.exists(SYSTEM_GXX):
            # CXX for the load check's child process; Inductor read CXX when it was imported, so
            # this process's builds get the compiler through cpp.cxx
            patch.setenv("CXX", SYSTEM_GXX)
            options["cpp.cxx"] = (SYSTEM_GXX,)
        export_package(model, path, device="cuda", dtype=dtype, weights=weights, verify=verify,
                       inductor_configs=options, **BOUNDS)
    return path


def _free_device_memory() -> int:
    """Free bytes on the device, with this process's cached blocks given back first: a load that
    allocates (through torch or cudaMalloc) shows as a drop."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


@pytest.fixture(scope="module")
def llama_1b(tmp_path_factory):
    """The llama-1b package (external weights) loaded once, and the device memory its load took."""
    path = _export(tmp_path_factory, "llama-1b", weights="external", verify=False)
    free_before = _free_device_memory()
    llm = tscompile.load_package(path)
    torch.cuda.synchronize()
    taken = free_before - torch.cuda.mem_get_info()[0]
    yield llm, taken
    del llm
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def narrow_path(tmp_path_factory):
    # the one GPU export that pays the load check: it proves on this machine that the export's own
    # subprocess check passes a package built by the system g++
    return _export(tmp_path_factory, "narrow-tiny", weights="inside", verify=True)


def _engine(model: str, dtype: torch.dtype = torch.float32):
    """The eager engine the packages are compared with: the same seeded weights, bounds and
    attention backend (auto: triton on CUDA), float32 unless asked."""
    return tscompile.LLM(model, device="cuda", dtype=dtype, enforce_eager=True, **BOUNDS)


@pytest.fixture(scope="module")
def llama_1b_engine():
    llm = _engine("llama-1b")
    yield llm
    del llm
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def llama_tiny_bf16_path(tmp_path_factory):
    # the smallest model with the whole decoder (norms, GQA, RoPE, MLP, LM head) in bf16
    return _export(tmp_path_factory, "llama-tiny", weights="inside", verify=False, dtype=torch.bfloat16,
                   name="llama-tiny-bf16")


@pytest.fixture(scope="module")
def llama_tiny_path(tmp_path_factory):
    # float32: the graphed and the direct decode must give the same tokens
    return _export(tmp_path_factory, "llama-tiny", weights="inside", verify=False)


@pytest.fixture(scope="module")
def text_checkpoint(tmp_path_factory):
    """A tiny Llama checkpoint with a tokenizer trained here (offline) and an eos id its first text
    produces: ``(path, transformers model, tokenizer, eos id)``."""
    pytest.importorskip("transformers")
    return write_text_checkpoint(tmp_path_factory.mktemp("gpu-text-checkpoint"))


def _greedy_batches(vocab: int):
    """(prompts, params) pairs: one prompt, a ragged full batch, and more requests than
    max_num_seqs finishing at different steps (late prompts join running ones: mixed steps)."""
    p = _prompts(vocab)
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS)
    staggered = [SamplingParams(max_new_tokens=n) for n in (3, 8, 5, 2, 7, 4)]
    return [(p[1:2], greedy), (p[:4], greedy), (p[::-1], staggered)]


def _seeded(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.9, top_k=50, top_p=0.9, seed=100 + s)
            for s in range(n)]


def _assert_package_equals_engine(package, engine, vocab: int) -> None:
    modes = record_modes(package)
    for prompts, params in _greedy_batches(vocab):
        got = ids(package.generate(prompts, params))
        assert got == ids(engine.generate(prompts, params)), f"{len(prompts)} prompts"
        wanted = [q.max_new_tokens for q in params] if isinstance(params, list) else [NEW_TOKENS] * len(prompts)
        assert [len(t) for t in got] == wanted
    assert {ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DECODE} <= set(modes)  # both programs ran
    prompts = _prompts(vocab)[:4]
    sampled = ids(package.generate(prompts, _seeded(4)))
    assert sampled == ids(engine.generate(prompts, _seeded(4)))
    greedy = ids(engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS)))
    assert sampled != greedy  # the sampler drew, or the seeded comparison proves nothing more
    assert not package.has_unfinished()


def test_llama_1b_package_tokens_equal_engine_greedy_and_seeded(llama_1b, llama_1b_engine):
    llm, _ = llama_1b
    assert llm.device.type == "cuda" and llm.package.record["device"] == "cuda"
    assert llm.package.record["dtype"] == "float32" and llm.package.record["attention_backend"] == "triton"
    _assert_package_equals_engine(llm, llama_1b_engine, tscompile.models.PRESETS["llama-1b"].vocab_size)


def test_narrowing_package_tokens_equal_engine_greedy_and_seeded(narrow_path):
    record = read_package_metadata(narrow_path)
    assert [g["name"] for g in record["cache_groups"]] == ["full", "tail"]
    assert "tscompile::narrow_rows" in record["ops"]["prefill"]
    if os.path.exists(SYSTEM_GXX):  # the compiler the record names is the one the export was given
        assert record["compiler"]["command"] == SYSTEM_GXX
    llm = tscompile.load_package(narrow_path)
    _assert_package_equals_engine(llm, _engine("narrow-tiny"), tscompile.models.PRESETS["narrow-tiny"].vocab_size)


def test_bf16_package_logits_equal_engine_within_what_bf16_costs(llama_tiny_bf16_path):
    """Prefill and three decode steps of the package, teacher forced: the engine walks the package's
    own greedy tokens, so both compute logits of the same sequences; the tolerance is the engine's
    bf16 error against its float32 logits on those sequences (package_logits.py)."""
    llm = tscompile.load_package(llama_tiny_bf16_path)
    assert llm.package.record["dtype"] == "bfloat16" and llm.package.record["attention_backend"] == "triton"
    prompts = _prompts(tscompile.models.PRESETS["llama-tiny"].vocab_size)[:3]  # 9, 1 and 40 tokens: one prefill each
    modes = record_modes(llm)
    worst = assert_bf16_package_logits_match_engine(llm, _engine("llama-tiny", torch.bfloat16), _engine("llama-tiny"),
                                                    prompts, steps=4)
    assert modes.count(ForwardMode.EXTEND) == len(prompts) and modes.count(ForwardMode.DECODE) == 3 * len(prompts)
    print(f"bf16 logits, max relative L2 error: {worst}")


def test_checkpoint_package_carries_its_tokenizer_and_stops_like_the_engine(tmp_path_factory, text_checkpoint):
    """Exported on CUDA in float32 (token equality with the engine needs the same arithmetic), from a
    checkpoint whose tokenizer was trained here and whose eos id its first text produces
    (``helpers.write_text_checkpoint``, shared with the CPU test in test_text_engine.py)."""
    path, _, tok, eos = text_checkpoint
    package = _export(tmp_path_factory, str(path), weights="inside", verify=False, name="text-checkpoint")
    llm = tscompile.load_package(package)
    assert llm.device.type == "cuda" and llm.package.record["dtype"] == "float32"
    assert_text_package_stops_like_engine(llm, _engine(str(path)), tok, eos)


def test_external_weights_are_used_in_place(llama_1b):
    """The programs borrow the tensors read from the weights file: every constant they need is one
    of them, tied weights share one storage, loading took one copy's worth of device memory (a
    second copy of llama-1b's 4.9 GB would double it), and a change made in place to one of those
    tensors changes what the programs compute."""
    llm, taken = llama_1b
    weights = llm.package.weights
    assert llm.package.record["weights"] == "external" and weights
    programs = llm.runner.programs
    for name, program in programs.items():
        wanted = {f.removeprefix("model.") for f in program.get_constant_fqns()}
        assert wanted and wanted <= set(weights), (name, sorted(wanted - set(weights))[:3])
    assert all(t.device.type == "cuda" for t in weights.values())
    assert weights["output.weight"].data_ptr() == weights["tok_embeddings.weight"].data_ptr()  # tied, once
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in weights.values()}
    weight_bytes = sum(unique.values())
    assert weight_bytes > 4 << 30  # llama-1b in float32: the bound below can tell one copy from two
    assert 0.9 * weight_bytes <= taken <= weight_bytes + (768 << 20), (taken, weight_bytes)

    prompts = _prompts(tscompile.models.PRESETS["llama-1b"].vocab_size)[:2]
    params = SamplingParams(max_new_tokens=4)
    before = ids(llm.generate(prompts, params))
    norm = weights["norm.weight"]
    saved = norm.clone()
    try:
        norm.zero_()  # the final norm's output is zero: every logit is zero, one token wins everywhere
        zeroed = ids(llm.generate(prompts, params))
    finally:
        norm.copy_(saved)
    assert len({t for seq in zeroed for t in seq}) == 1 and zeroed != before
    assert ids(llm.generate(prompts, params)) == before  # restored in place, as it was


@pytest.mark.parametrize("name,value,limit", [("max_num_seqs", 5, 4), ("max_model_len", 65, 64),
                                              ("max_num_batched_tokens", 65, 64)])
def test_limits_beyond_the_package_bounds_are_refused(narrow_path, name, value, limit):
    with pytest.raises(ValueError, match=rf"^tscompile: {name} {value} is outside the package's bound "
                                         rf"\[1, {limit}\]"):
        tscompile.load_package(narrow_path, **{name: value})


def test_requests_beyond_the_bounds_are_refused_and_lower_limits_hold(narrow_path):
    llm = tscompile.load_package(narrow_path)
    with pytest.raises(ValueError, match=r"^tscompile: .* = 66 exceeds max_model_len 64 \(package bound 64\)"):
        llm.generate([[1, 2, 3], list(range(1, 61))], SamplingParams(max_new_tokens=6))
    assert not llm.has_unfinished()
    with pytest.raises(ValueError, match=r"^tscompile: token id 512 outside the vocabulary"):
        llm.generate([[512]])
    small = tscompile.load_package(narrow_path, max_model_len=16, max_num_seqs=2)
    with pytest.raises(ValueError, match=r"^tscompile: .* = 20 exceeds max_model_len 16 \(package bound 64\)"):
        small.generate([list(range(1, 11))], SamplingParams(max_new_tokens=10))
    short = [p for p in _prompts(512) if len(p) + 4 <= 16][:3]
    got = ids(small.generate(short, SamplingParams(max_new_tokens=4)))
    assert len(short) == 3 and [len(t) for t in got] == [4, 4, 4]  # three requests through two slots


def test_other_releases_and_the_cpu_are_refused(narrow_path, monkeypatch):
    assert_other_releases_refused(narrow_path, monkeypatch)
    with pytest.raises(ValueError, match=r"^tscompile: package was built for device 'cuda', cannot load it on 'cpu'"):
        tscompile.load_package(narrow_path, device="cpu")


def test_cuda_graphs_decode_gives_the_direct_programs_tokens_and_replays_every_decode_step(llama_tiny_path):
    """``cuda_graphs=True``: decode steps replay one CUDA graph per padded size of the ladder
    (1, 2, 4) (max_num_seqs 4). Three ragged prompts pad to 4 rows, one prompt runs at 1, six
    staggered ones pass through every size, seeded sampling too: the tokens of the program called
    directly (``cuda_graphs=False``), and every decode step was a replay."""
    direct = tscompile.load_package(llama_tiny_path)
    graphed = tscompile.load_package(llama_tiny_path, cuda_graphs=True)
    graphs = graphed.runner.decode_graphs
    assert direct.runner.decode_graphs is None
    assert graphs is not None and isinstance(graphs.graphs.backend, CudaGraphs) and graphs.ladder == (1, 2, 4)
    modes = record_modes(graphed)
    counters.clear()
    p = _prompts(tscompile.models.PRESETS["llama-tiny"].vocab_size)
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS)
    staggered = [SamplingParams(max_new_tokens=n) for n in (3, 8, 5, 2, 7, 4)]
    for prompts, params in [(p[:3], greedy), (p[1:2], greedy), (p[::-1], staggered), (p[:3], _seeded(3))]:
        assert ids(graphed.generate(prompts, params)) == ids(direct.generate(prompts, params)), len(prompts)
    decode_steps = modes.count(ForwardMode.DECODE)
    assert decode_steps > 0 and graphs.replays == decode_steps  # nothing above the ladder: all replayed
    # the engine's counters, which the bench's captures column reads, see the same replays and captures
    assert counters["decode_replays"] == decode_steps and counters["decode_eager"] == 0
    assert counters["decode_captures"] == graphs.captures
    assert {1, 4} <= {k.batch_size for k in graphs.graphs.graphs} and graphs.captures == len(graphs.graphs.graphs)
    assert graphs.padded_rows >= 2 * (NEW_TOKENS - 1)  # the two three-prompt batches pad each decode step
    assert graphed.capture_seconds > 0
    assert not graphed.has_unfinished()
