"""The KV pool sized from ``gpu_memory_utilization`` (the arithmetic on the CPU, the real sizing on a
GPU), a ``KeyboardInterrupt`` inside ``generate`` / ``stream`` leaving the engine clean, and a CUDA
fault killing the engine for good while an ordinary error does not."""

from __future__ import annotations

import logging
import math
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from helpers import PROMPTS, ids, small_llm
from tscompile import SamplingParams
from tscompile.kv_cache.pool import KVCachePool
from tscompile.models import build_config, build_model
from tscompile.runtime.build import profile_prompt_lengths
from tscompile.runtime.device_faults import EngineDeadError, is_cuda_fault
from tscompile.runtime.memory import kv_cache_pages, pages_for_requests
from tscompile.validation import validate_engine_args

GiB, MiB = 2**30, 2**20


def make_llm(**kw):
    kw.setdefault("dtype", torch.float32)
    kw.setdefault("enforce_eager", True)
    return small_llm(**kw)


def free_blocks(llm) -> list[int]:
    return [a.num_free for a in llm.scheduler.allocators]


# -- 1. the KV pool from gpu_memory_utilization ------------------------------------------------------

def _pages(**kw):
    args = dict(total_bytes=80 * GiB, used_bytes=20 * GiB, activation_peak_bytes=2 * GiB, margin_bytes=512 * MiB,
                utilization=0.9, bytes_per_page=64 * 1024, pages_per_block=2, min_pages=10, max_pages=10**9,
                max_model_len=4096)
    args.update(kw)
    return kv_cache_pages(**args)


def test_the_pool_takes_the_budget_left_in_whole_blocks():
    # 0.9 * 80 GiB - 20 GiB - 2 GiB - 0.5 GiB = 49.5 GiB = 405504 blocks of 2 pages of 64 KiB
    assert _pages() == 811008
    assert _pages(used_bytes=20 * GiB + 1) == 811006  # one byte short of a block: one block fewer
    assert _pages(pages_per_block=1) == 811008  # the same bytes in blocks of one page
    assert _pages(utilization=1.0) == 811008 + 8 * GiB // (64 * 1024)
    assert _pages(activation_peak_bytes=0, margin_bytes=0) == 811008 + int(2.5 * GiB) // (64 * 1024)


def test_the_pool_is_capped_at_what_the_requests_could_use():
    assert _pages(max_pages=5000) == 5000
    assert _pages(max_pages=811008 + 2) == 811008  # the cap is a bound, not a size


@pytest.mark.parametrize("kw,left", [
    (dict(used_bytes=80 * GiB), "0.0 MiB"),  # other processes hold more than the fraction
    (dict(utilization=0.25), "0.0 MiB"),  # 20 GiB allowed, 22.5 GiB taken before the pool
    (dict(used_bytes=int(49.5 * GiB) + 20 * GiB - 9 * 64 * 1024, min_pages=10), "0.6 MiB"),  # 9 pages, 10 needed
])
def test_too_little_memory_for_one_request_is_refused_with_the_numbers(kw, left):
    with pytest.raises(ValueError) as e:
        _pages(**kw)
    msg = str(e.value)
    assert msg.startswith(f"tscompile: gpu_memory_utilization {kw.get('utilization', 0.9)} leaves {left} for the "
                          f"KV cache")
    assert "one request of max_model_len 4096 needs 0.6 MiB (10 pages of 0.1 MiB" in msg
    assert "allowed: a fraction in (0, 1]" in msg
    assert "80.00 GiB total" in msg and "2.00 GiB activation peak" in msg and "512.0 MiB for CUDA graphs" in msg


def test_exactly_one_request_fits():
    budget_pages = 10
    used = int(0.9 * 80 * GiB) - 2 * GiB - 512 * MiB - budget_pages * 64 * 1024
    assert _pages(used_bytes=used, min_pages=10, pages_per_block=1) == 10
    with pytest.raises(ValueError, match="^tscompile: gpu_memory_utilization 0.9 leaves"):
        _pages(used_bytes=used + 1, min_pages=10, pages_per_block=1)


def test_pages_for_requests_counts_whole_blocks_and_the_null_block():
    assert pages_for_requests(1, 4096, 16, 1) == 257
    assert pages_for_requests(3, 17, 16, 2) == (3 * 2 + 1) * 2


@pytest.mark.parametrize("seqs,max_len,budget", [(8, 512, 2048), (4, 64, 2048), (256, 4096, 2048), (2, 3, 100),
                                                 (3, 2, 1000), (1, 1, 16)])
def test_the_profiling_step_is_the_largest_step_the_scheduler_can_plan(seqs, max_len, budget):
    lengths = profile_prompt_lengths(seqs, max_len, budget)
    assert sum(lengths) == min(budget, seqs * (max_len - 1))
    assert len(lengths) <= seqs and all(1 <= n <= max_len - 1 for n in lengths)
    assert not lengths or max(lengths) - min(lengths) <= 1  # spread over as many requests as may run


@pytest.mark.parametrize("options,budget,want", [
    ({}, 2048, [16, 32, 64, 128, 256, 512, 1024, 2048]),
    ({}, 300, [16, 32, 64, 128, 256, 512]),  # a full step pads to 512 at most
    ({"prefill_graph_max_tokens": 200}, 2048, [16, 32, 64, 128]),
    ({"prefill_graph_max_tokens": 0}, 2048, []),
    ({"cudagraphs": False}, 2048, []),
])
def test_the_prefill_graph_margin_covers_the_buckets_a_step_can_reach(options, budget, want):
    from types import SimpleNamespace

    from tscompile.config import TscompileConfig
    from tscompile.runtime.build import prefill_graph_buckets
    from tscompile.runtime.memory import PREFILL_GRAPH_VARIANTS, prefill_graph_bytes

    support = SimpleNamespace(support=SimpleNamespace(prefill_graph=True))
    assert prefill_graph_buckets(TscompileConfig.from_options(options), support, budget) == want
    assert prefill_graph_buckets(None, support, budget) == []  # enforce_eager
    off = SimpleNamespace(support=SimpleNamespace(prefill_graph=False))
    assert prefill_graph_buckets(TscompileConfig.from_options(options), off, budget) == []
    # llama-1b (16 layers, dim 2048, bf16) at the 2048 bucket: measured 0.73 GiB per variant
    assert 0.73 * GiB < prefill_graph_bytes([2048], 16, 2048, 2) / PREFILL_GRAPH_VARIANTS < 0.8 * GiB


def test_the_graph_margin_counts_no_prefill_bucket_above_what_the_requests_can_hold():
    """llama-8b in float32 with one request of 128 tokens: a prefill step never holds more than 128
    tokens, so the buckets up to the 2048 of the token budget (about 48 GiB of margin, which left an
    80 GB card no room for the KV cache) do not count; the bucket 128 itself does."""
    from types import SimpleNamespace

    from tscompile.config import TscompileConfig
    from tscompile.models import build_config
    from tscompile.runtime.build import graph_margin_bytes
    from tscompile.runtime.memory import DECODE_GRAPH_MARGIN_BYTES, prefill_graph_bytes

    cfg = build_config("llama-8b")
    support = SimpleNamespace(support=SimpleNamespace(prefill_graph=True))
    config = TscompileConfig.from_options({})

    def margin(max_num_seqs, max_model_len, budget=2048):
        return graph_margin_bytes(cfg, torch.float32, config, support, max_num_seqs=max_num_seqs,
                                  max_model_len=max_model_len, max_num_batched_tokens=budget, max_verify_width=1)

    def prefill(buckets):
        return prefill_graph_bytes(buckets, cfg.n_layers, cfg.dim, 4)

    assert margin(1, 128) == DECODE_GRAPH_MARGIN_BYTES + prefill([16, 32, 64, 128]) < 4 * GiB
    assert margin(1, 100) == margin(1, 128)  # a 100-token step pads to the 128 bucket
    assert margin(32, 128) == DECODE_GRAPH_MARGIN_BYTES + prefill([16, 32, 64, 128, 256, 512, 1024, 2048])
    assert margin(32, 128, budget=256) == margin(2, 128)


@pytest.mark.parametrize("model", ["llama-tiny", "narrow-tiny"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_page_bytes_are_the_bytes_of_one_page_of_every_group(model, dtype):
    cfg = build_config(model)
    specs = build_model(cfg, dtype=dtype, device=torch.device("cpu")).cache_groups()
    pool = KVCachePool.allocate(specs, [6] * len(specs), page_size=4, pages_per_block=2, dtype=dtype, device="cpu")
    page = KVCachePool.page_bytes(specs, 4, dtype)
    assert pool.nbytes == 6 * page
    assert page == 2 * cfg.n_layers * 4 * cfg.n_kv_heads * cfg.head_dim * dtype.itemsize  # K and V of every layer


@pytest.mark.parametrize("value", [0, 0.0, -0.1, 1.5, math.nan, True, "0.9", None])
def test_gpu_memory_utilization_must_be_a_fraction(value):
    with pytest.raises(ValueError, match=rf"^tscompile: gpu_memory_utilization must be a float in \(0, 1\], "
                                         rf"got {re.escape(repr(value))}$"):
        validate_engine_args(gpu_memory_utilization=value)


def test_gpu_memory_utilization_accepts_fractions():
    for value in (1, 1.0, 0.5, 1e-3):
        validate_engine_args(gpu_memory_utilization=value)


@pytest.mark.parametrize("max_model_len,pages_per_block,blocks,concurrency", [(64, 1, 64, "4.0"), (50, 1, 52, "4.2"),
                                                                               (50, 2, 28, "4.5")])
def test_a_cpu_engine_logs_its_pool_once(caplog, max_model_len, pages_per_block, blocks, concurrency):
    """CPU sizing (no device memory to measure): 4 requests of max_model_len tokens, plus the null block."""
    caplog.set_level(logging.INFO, logger="tscompile")
    llm = make_llm(max_model_len=max_model_len, pages_per_block=pages_per_block, gpu_memory_utilization=0.1)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
    block = 4 * pages_per_block
    nbytes = (blocks + 1) * pages_per_block * 2 * 2 * 4 * 2 * 64 * 4  # pages x (K,V x 2 layers x 4 rows x 2 x 64 x f32)
    assert llm.pool.nbytes == nbytes and llm.scheduler.allocators[0].num_blocks == blocks + 1
    assert lines == [f"KV cache: {blocks} blocks of {block} tokens, {nbytes / GiB:.2f} GiB, max concurrency "
                     f"{concurrency} at max_model_len {max_model_len}"]
    assert llm.parts.memory is None  # nothing was measured


# -- 2. KeyboardInterrupt inside generate / stream -----------------------------------------------------

PARAMS = {"greedy": SamplingParams(max_new_tokens=6),
          "seeded": SamplingParams(max_new_tokens=6, temperature=0.8, top_k=40, seed=11)}


class _Tokens:
    """A launched step's token handle whose ``wait`` raises ``exc``."""

    def __init__(self, exc):
        self.exc = exc

    def wait(self):
        raise self.exc


def inject(llm, where: str, exc: BaseException, nth: int) -> list[int]:
    """Make the ``nth`` call of ``where`` raise ``exc``: the runner's ``launch``, the scheduler's
    ``schedule``, or the read-back (``wait``) of the ``nth`` launched step's tokens."""
    calls = []
    target, name = (llm.scheduler, "schedule") if where == "schedule" else (llm.runner, "launch")
    real = getattr(target, name)

    def wrapped(*a, **kw):
        calls.append(1)
        if len(calls) == nth and where != "wait":
            raise exc
        out = real(*a, **kw)
        return _Tokens(exc) if len(calls) == nth else out

    setattr(target, name, wrapped)
    return calls


def restore(llm) -> None:
    for obj, name in ((llm.runner, "launch"), (llm.scheduler, "schedule")):
        obj.__dict__.pop(name, None)


def assert_clean_like(llm, fresh) -> None:
    assert not llm.has_unfinished() and not llm.scheduler.waiting and not llm.scheduler.running
    assert not llm._requests and llm._inflight is None
    assert free_blocks(llm) == free_blocks(fresh)


@pytest.mark.parametrize("params", PARAMS.values(), ids=PARAMS.keys())
@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("where,nth", [("launch", 1), ("launch", 3), ("schedule", 1), ("schedule", 4),
                                       ("wait", 1), ("wait", 4)])
def test_keyboard_interrupt_in_generate_propagates_and_leaves_the_engine_clean(where, nth, async_scheduling, params):
    fresh = make_llm(async_scheduling=async_scheduling)
    want = ids(fresh.generate(PROMPTS, params))
    llm = make_llm(async_scheduling=async_scheduling)
    calls = inject(llm, where, KeyboardInterrupt(), nth)
    with pytest.raises(BaseException) as e:
        llm.generate(PROMPTS, params)
    assert e.type is KeyboardInterrupt and len(calls) >= nth  # neither swallowed nor converted
    assert not llm.is_dead
    assert_clean_like(llm, fresh)
    restore(llm)
    assert ids(llm.generate(PROMPTS, params)) == want
    assert_clean_like(llm, fresh)


@pytest.mark.parametrize("params", PARAMS.values(), ids=PARAMS.keys())
@pytest.mark.parametrize("where,nth", [("launch", 3), ("wait", 2)])
def test_keyboard_interrupt_in_stream_propagates_and_leaves_the_engine_clean(where, nth, params):
    fresh = make_llm()
    want = ids(fresh.generate(PROMPTS[:1], params))
    llm = make_llm()
    inject(llm, where, KeyboardInterrupt(), nth)
    with pytest.raises(BaseException) as e:
        list(llm.stream(PROMPTS[0], params))
    assert e.type is KeyboardInterrupt
    assert_clean_like(llm, fresh)
    restore(llm)
    assert ids(llm.generate(PROMPTS[:1], params)) == want


def test_an_interrupted_generate_leaves_another_callers_request_alone():
    """Only the call's own requests are aborted: a request queued with add_request keeps running
    and gets the tokens it gets alone."""
    params = PARAMS["seeded"]
    want = ids(make_llm().generate([PROMPTS[1]], params))[0]
    llm = make_llm()
    other = llm.add_request(PROMPTS[1], params)
    inject(llm, "launch", KeyboardInterrupt(), 3)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPTS[0], PROMPTS[2]], params)
    restore(llm)
    while llm.has_unfinished():
        llm.step()
    assert other.output == want and other.completion.finish_reason == "length"


# -- 3. a CUDA fault kills the engine ------------------------------------------------------------------

ILLEGAL = "CUDA error: an illegal memory access was encountered"


@pytest.mark.parametrize("exc,fault", [
    (RuntimeError(ILLEGAL), True),
    (RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"), True),
    (RuntimeError("CUDA error: device-side assert triggered\nCompile with TORCH_USE_CUDA_DSA"), True),
    (RuntimeError("CUDA error: unspecified launch failure"), True),
    (RuntimeError("CUDA error: misaligned address"), True),
    (RuntimeError("boom"), False),
    (ValueError("tscompile: prompt (70) + max_new_tokens (1) = 71 exceeds max_model_len 64"), False),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
    (RuntimeError("CUDA error: out of memory"), False),  # recoverable: nothing was corrupted
    (KeyboardInterrupt(), False),
])
def test_the_cuda_fault_classifier(exc, fault):
    assert is_cuda_fault(exc) is fault


def test_a_fault_behind_a_wrapping_error_is_a_fault():
    try:
        try:
            raise RuntimeError(ILLEGAL)
        except RuntimeError as inner:
            raise RuntimeError("tscompile: capturing prefill piece failed") from inner
    except RuntimeError as outer:
        assert is_cuda_fault(outer)


@pytest.mark.skipif(not hasattr(torch, "AcceleratorError"), reason="torch.AcceleratorError is torch >= 2.8")
def test_an_accelerator_error_is_a_fault_whatever_its_text():
    try:
        exc = torch.AcceleratorError("unnamed failure")
    except TypeError:
        pytest.skip("this torch's AcceleratorError cannot be built from Python")
    assert is_cuda_fault(exc)


def _forbid_device(llm) -> list[str]:
    """After death nothing may reach the runner or wait on a token: record any attempt."""
    touched = []
    llm.runner.launch = lambda *a, **kw: touched.append("launch")
    llm.scheduler.schedule = lambda: touched.append("schedule")
    return touched


def _assert_refuses_everything(llm) -> None:
    touched = _forbid_device(llm)
    refusal = r"^tscompile: the engine is unusable: a CUDA fault .*restart the process"
    for call in (lambda: llm.generate(PROMPTS[:1], PARAMS["greedy"]), lambda: llm.add_request(PROMPTS[0]),
                 llm.step, llm.sync, lambda: llm.stream(PROMPTS[0])):  # stream refuses before iterating
        with pytest.raises(EngineDeadError, match=refusal):
            call()
    assert touched == [] and llm.is_dead and not llm.has_unfinished()


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("where,nth", [("launch", 1), ("launch", 3), ("wait", 2)])
def test_a_cuda_fault_in_generate_kills_the_engine(where, nth, async_scheduling):
    llm = make_llm(async_scheduling=async_scheduling)
    injected = RuntimeError(ILLEGAL)
    inject(llm, where, injected, nth)
    with pytest.raises(EngineDeadError) as e:
        llm.generate(PROMPTS, PARAMS["greedy"])
    assert str(e.value).startswith("tscompile: the engine is unusable: a CUDA fault in a step (RuntimeError: "
                                   f"{ILLEGAL}) lost the CUDA context of this process; restart the process")
    assert e.value.__cause__ is injected
    assert not llm._requests and llm._inflight is None  # host bookkeeping cleared, nothing waited for
    _assert_refuses_everything(llm)


def test_a_cuda_fault_in_a_direct_step_and_in_stream_kills_the_engine():
    llm = make_llm()
    llm.add_request(PROMPTS[0], PARAMS["greedy"])
    inject(llm, "launch", RuntimeError(ILLEGAL), 2)
    llm.step()
    with pytest.raises(EngineDeadError):
        llm.step()
    _assert_refuses_everything(llm)

    streamed = make_llm()
    inject(streamed, "wait", RuntimeError(ILLEGAL), 2)
    with pytest.raises(EngineDeadError):
        list(streamed.stream(PROMPTS[0], PARAMS["greedy"]))
    _assert_refuses_everything(streamed)


@pytest.mark.parametrize("params", PARAMS.values(), ids=PARAMS.keys())
@pytest.mark.parametrize("where,nth", [("launch", 3), ("wait", 2)])
def test_an_ordinary_error_does_not_kill_the_engine(where, nth, params):
    fresh = make_llm()
    want = ids(fresh.generate(PROMPTS, params))
    llm = make_llm()
    inject(llm, where, RuntimeError("boom"), nth)
    with pytest.raises(RuntimeError, match="^boom$") as e:
        llm.generate(PROMPTS, params)
    assert e.type is RuntimeError and not llm.is_dead
    assert_clean_like(llm, fresh)
    restore(llm)
    assert ids(llm.generate(PROMPTS, params)) == want


# -- on a GPU ------------------------------------------------------------------------------------------

def _cuda_llm(**kw):
    import tscompile

    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("max_model_len", 256)
    return tscompile.LLM("llama-tiny", device="cuda", attention_backend="triton", enforce_eager=True, **kw)


@pytest.mark.gpu
@pytest.mark.gpu_alone  # reads the device's free memory
def test_gpu_pool_is_sized_from_gpu_memory_utilization(caplog):
    """A model whose requests could use more than half the GPU (128 x 1M tokens of 1 KiB): the pool
    is what the budget leaves, in whole blocks, and everything the engine holds stays inside half of
    the device, generate included."""
    import tscompile

    caplog.set_level(logging.INFO, logger="tscompile")
    cfg = build_config("llama-tiny", max_position=1 << 20)
    llm = tscompile.LLM(cfg, device="cuda", attention_backend="triton", enforce_eager=True, max_num_seqs=128,
                        max_model_len=1 << 20, gpu_memory_utilization=0.5)
    mem = llm.parts.memory
    free, total = torch.cuda.mem_get_info()
    assert mem is not None and mem.total_bytes == total and mem.utilization == 0.5
    assert 0 < mem.activation_peak_bytes < 1 * GiB and 0 < mem.used_bytes < 0.5 * total
    page = KVCachePool.page_bytes(llm.attention.specs, 16, llm.dtype)
    assert llm.pool.nbytes == llm.pool.num_blocks(0) * page  # one page per block here
    assert mem.kv_budget_bytes - page < llm.pool.nbytes <= mem.kv_budget_bytes  # the budget, in whole blocks
    assert total - free <= 0.5 * total - mem.activation_peak_bytes  # pool, weights, buffers: inside the half
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:")]
    blocks = llm.pool.num_blocks(0) - 1
    assert lines == [f"KV cache: {blocks} blocks of 16 tokens, {llm.pool.nbytes / GiB:.2f} GiB, max concurrency "
                     f"{blocks * 16 / (1 << 20):.1f} at max_model_len {1 << 20}"]
    torch.cuda.reset_peak_memory_stats()
    out = llm.generate([[j % 500 + 1 for j in range(3000)], [5, 6, 7]], SamplingParams(max_new_tokens=8))
    assert [len(o.outputs[0].token_ids) for o in out] == [8, 8]
    free_after, _ = torch.cuda.mem_get_info()
    assert total - free_after <= 0.5 * total  # the allocator's cache (the step peaks) included


@pytest.mark.gpu
@pytest.mark.gpu_alone  # reads the device's free memory
def test_gpu_pool_is_capped_at_what_the_requests_could_use():
    llm = _cuda_llm(gpu_memory_utilization=0.9)
    assert llm.pool.num_blocks(0) == 4 * 256 // 16 + 1 and llm.parts.memory is not None


@pytest.mark.gpu
@pytest.mark.gpu_alone  # reads the device's free memory
def test_gpu_too_small_a_fraction_is_refused():
    with pytest.raises(ValueError, match=r"^tscompile: gpu_memory_utilization 0.001 leaves .* for the KV cache "
                                         r"\(0.001 x .* GiB total"):
        _cuda_llm(gpu_memory_utilization=0.001)


FAULT_SCRIPT = textwrap.dedent("""
    import os, sys
    import torch, triton, triton.language as tl
    import tscompile
    from tscompile.runtime.device_faults import EngineDeadError

    @triton.jit
    def write_far(ptr):
        tl.store(ptr + (1 << 40), 1.0)  # a terabyte past the allocation: an illegal address

    llm = tscompile.LLM("llama-tiny", device="cuda", attention_backend="triton", enforce_eager=True,
                        max_num_seqs=4, max_model_len=128)
    print("warm", len(llm.generate([[1, 2, 3]], tscompile.SamplingParams(max_new_tokens=4))[0].outputs[0].token_ids))
    real, calls = llm.runner.launch, []

    def faulty(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            write_far[(1,)](torch.empty(1, device="cuda"))
        return real(*a, **kw)

    llm.runner.launch = faulty
    try:
        llm.generate([[1, 2, 3], [4, 5]], tscompile.SamplingParams(max_new_tokens=8))
        print("NO ERROR")
    except EngineDeadError as e:
        print("FIRST", e)
        print("CAUSE", type(e.__cause__).__name__, e.__cause__)
    for name, call in (("generate", lambda: llm.generate([[1]])), ("add_request", lambda: llm.add_request([1])),
                       ("step", llm.step), ("stream", lambda: llm.stream([1]))):
        try:
            call()
            print("ACCEPTED", name)
        except EngineDeadError as e:
            print("REFUSED", name, str(e).startswith("tscompile: the engine is unusable"))
    sys.stdout.flush()
    os._exit(0)  # the context is lost: skip teardown that would touch it
""")


@pytest.mark.gpu
def test_gpu_illegal_memory_access_kills_the_engine_in_a_subprocess(tmp_path):
    """A real illegal address (a Triton store a terabyte out of bounds) during generate, in a child
    process (the fault ends the CUDA context of the whole process)."""
    script = tmp_path / "fault.py"  # Triton's jit reads its kernel's source from a file
    script.write_text(FAULT_SCRIPT)
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    out = done.stdout
    assert done.returncode == 0, done.stderr[-3000:]
    assert "warm 4" in out and "NO ERROR" not in out, out
    first = next(line for line in out.splitlines() if line.startswith("FIRST"))
    assert "tscompile: the engine is unusable: a CUDA fault in a step" in first and "restart the process" in first
    assert "illegal memory access" in out or "CUDA error" in out, out
    for name in ("generate", "add_request", "step", "stream"):
        assert f"REFUSED {name} True" in out, out
