"""The skinny matmul (custom_ops/triton_gemv.py) against float32 math.

Without CUDA the kernel runs under the Triton interpreter (conftest sets TRITON_INTERPRET=1), so
the unmarked tests use tiny shapes and tiles: a few columns and K chunks still give several column
blocks, K ranges per split, a tail column block and a tail K chunk. The interpreter casts float32
to bf16/fp16 by truncation (the GPU rounds to nearest), so the tolerance is one unit in the last
place of the output dtype. ``gpu``-marked tests use the llama-1b qkv projection shape.
"""

from __future__ import annotations

import pytest
import torch

from tscompile.bench.graph_timing import capture_graph
from tscompile.custom_ops import triton_gemv as tg

ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 1e-5}

# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages[, mode]); 16-wide tiles keep the interpreter fast
FMA, FMA_SPLIT = (16, 32, 1, 4, 1), (16, 32, 3, 4, 1, "fma")
DOT, DOT_SPLIT = (16, 32, 1, 4, 1, "dot"), (32, 16, 2, 4, 1, "dot")
ACC, ACC_SPLIT = (2, 32, 1, 4, 1, "acc"), (4, 16, 3, 4, 1, "acc")  # Inductor-style: 1-4 columns per program


def _inputs(m, n, k, dtype, device, seed, x_row_stride=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, x_row_stride or k, generator=g).to(dtype=dtype, device=device)[:, :k]  # strided rows if wider
    w = torch.randn(n, k, generator=g).to(dtype=dtype, device=device)
    return x, w


def _assert_matches(out, x, w):
    ref = x.float() @ w.float().T
    torch.testing.assert_close(out.float(), ref, rtol=ULP[x.dtype], atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("config, n, k", [
    (FMA, 40, 72),        # tail column block (40 = 2*16 + 8) and tail K chunk (72 = 2*32 + 8)
    (FMA_SPLIT, 32, 96),  # K divides evenly: the unmasked path, three K ranges summed
    (DOT, 33, 80),        # a one-column tail block, tail K chunk
    (DOT_SPLIT, 48, 56),  # tail K chunk in the last of two K ranges
    (ACC, 9, 72),         # a one-column tail block, tail K chunk carried in the accumulator
    (ACC_SPLIT, 12, 96),  # the accumulator reduced per K range, three ranges summed
])
def test_gemv_matches_float32_math(dtype, m, config, n, k, device):
    x, w = _inputs(m, n, k, dtype, device, seed=hash((str(dtype), m, config, n)) % 2**31)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
    assert tg.gemv(x, w, out, config=config) is out
    _assert_matches(out, x, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [17, 32])
@pytest.mark.parametrize("config", [DOT, DOT_SPLIT, None])  # None: DEFAULT_TILES' 32-row "dot" tile
def test_gemv_prefill_rows_match_float32_math(dtype, m, config, device):
    """17-32 rows (the 32-token prefill step's projections) in "dot" mode: the accumulator is
    [BLOCK_N, 32], rows past M are clamped loads never stored."""
    n, k = 40, 272  # 272 = 2 * 128 + 16: a tail K chunk for the default tile too
    x, w = _inputs(m, n, k, dtype, device, seed=m * 7 + (config is None))
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
    if config is None:
        assert tg.default_config(m, n, k)[-1] == "dot"
    tg.gemv(x, w, out, config=config)
    _assert_matches(out, x, w)


DOT_SUM = (16, 32, 3, 4, 1, "dot_sum")  # three K ranges, summed by the last program of each column block
FMA_SUM, ACC_SUM = (16, 32, 3, 4, 1, "fma_sum"), (4, 16, 3, 4, 1, "acc_sum")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("config, m, n, k", [(DOT_SUM, 3, 40, 96), (DOT_SUM, 17, 33, 80), (DOT_SUM, 32, 48, 200),
                                             (FMA_SUM, 1, 40, 96), (FMA_SUM, 5, 33, 200), (ACC_SUM, 1, 9, 72),
                                             (ACC_SUM, 2, 12, 96)])
def test_in_kernel_sums_give_the_two_kernel_splits_bits_and_leave_their_counters_zeroed(dtype, config, m, n, k, device,
                                                                                      monkeypatch):
    """Each "_sum" mode against its base mode at the same split (the partials summed by
    ``_sum_splits_kernel``), bit for bit, output poisoned first; no second kernel launched; every
    arrival counter back at 0, so the next call (fresh x, again poisoned) sums right too. Tails in N
    and K included."""
    from helpers import LaunchSpy

    sums = LaunchSpy(tg._sum_splits_kernel)
    base = config[:5] + (config[5].removesuffix("_sum"),)
    for seed in (1, 2):
        x, w = _inputs(m, n, k, dtype, device, seed=seed * 1000 + m + n)
        two_kernels = tg.gemv(x, w, config=base)
        out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
        with monkeypatch.context() as patch:
            patch.setattr(tg, "_sum_splits_kernel", sums)
            assert tg.gemv(x, w, out, config=config) is out
        assert sums.launches == []
        assert torch.equal(out, two_kernels)
        _assert_matches(out, x, w)
        assert int(tg.arrival_counters(x.device, 1).abs().sum()) == 0


def test_dot_sum_falls_back_to_the_sum_kernel_when_counters_are_short(device, monkeypatch):
    """More column blocks than counter slots: the call launches the second kernel instead (and
    gets the same result); so does a split of 1, which has nothing to sum."""
    from helpers import LaunchSpy

    x, w = _inputs(4, 48, 96, torch.float32, device, seed=7)
    monkeypatch.setattr(tg, "ARRIVAL_SLOTS", 2)  # 48 columns / 16 = 3 blocks
    sums = LaunchSpy(tg._sum_splits_kernel)
    monkeypatch.setattr(tg, "_sum_splits_kernel", sums)
    out = torch.full((4, 48), float("nan"), device=device)
    tg.gemv(x, w, out, config=DOT_SUM)
    assert len(sums.launches) == 1
    _assert_matches(out, x, w)
    assert tg.arrival_counters(torch.device(device), 3) is None


def test_counters_are_never_first_made_inside_a_cuda_graph_capture(monkeypatch):
    """A buffer zeroed inside a capture would be zeroed only by the graph's replays: while a capture
    runs, a device without counters gets none (the call takes the two-kernel sum); once they exist
    (made eagerly, e.g. by a warm-up call), a capture uses them."""
    cuda0 = torch.device("cuda", 0)
    monkeypatch.setattr(tg, "_ARRIVALS", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert tg.arrival_counters(cuda0, 4) is None and tg._ARRIVALS == {}
    made = torch.zeros(tg.ARRIVAL_SLOTS, dtype=torch.int32)
    tg._ARRIVALS[("gemv", "cuda", 0)] = made
    assert tg.arrival_counters(cuda0, 4) is made


def test_dot_sum_needs_tensor_core_tiles():
    assert tg.check_config((16, 16, 2, 4, 1, "dot_sum")) == (16, 16, 2, 4, 1, "dot_sum")
    assert tg.check_config((8, 32, 2, 4, 1, "fma_sum"))[-1] == "fma_sum"  # no tensor cores: any tile
    with pytest.raises(ValueError, match="tscompile: .*unknown mode 'dot_summed'"):
        tg.check_config((16, 16, 2, 4, 1, "dot_summed"))
    with pytest.raises(ValueError, match="tscompile: .*'dot_sum' needs BLOCK_N and BLOCK_K >= 16"):
        tg.check_config((8, 32, 2, 4, 1, "dot_sum"))


def test_gemv_writes_only_inside_out_and_reads_strided_x_rows(device):
    """out is a column window of a NaN buffer: tail blocks must not store past column N; x rows sit
    in a wider buffer (row stride > K)."""
    m, n, k = 5, 24, 40
    x, w = _inputs(m, n, k, torch.bfloat16, device, seed=11, x_row_stride=k + 24)
    assert x.stride(0) == k + 24
    for config in (FMA, DOT_SPLIT, ACC):
        buf = torch.full((m + 2, n + 8), float("nan"), dtype=torch.bfloat16, device=device)
        out = buf[1:m + 1, 3:n + 3]
        tg.gemv(x, w, out, config=config)
        _assert_matches(out, x, w)
        buf[1:m + 1, 3:n + 3] = float("nan")
        assert buf.isnan().all(), f"{config} wrote outside out"


def test_gemv_default_config_allocates_out(device, monkeypatch):
    """config=None: DEFAULT_TILES by M (shrunk to tiny tiles) with the automatic split-K, which the
    small TARGET_PROGRAMS turns on; and M = 0 returns an empty result without launching."""
    monkeypatch.setattr(tg, "DEFAULT_TILES", {1: (16, 32, 4, 1, "fma"), 2: (16, 32, 4, 1, "fma"),
                                              4: (16, 32, 4, 1, "fma"), 8: (16, 16, 4, 1, "dot"),
                                              16: (16, 16, 4, 1, "dot")})
    monkeypatch.setattr(tg, "TARGET_PROGRAMS", 8)
    for m, (n, k) in ((1, (24, 80)), (7, (40, 48))):
        assert tg.default_config(m, n, k)[2] > 1  # too few column blocks: split
        x, w = _inputs(m, n, k, torch.float16, device, seed=m)
        out = tg.gemv(x, w)
        assert out.shape == (m, n) and out.dtype == torch.float16
        _assert_matches(out, x, w)
    assert tg.gemv(torch.randn(0, 8, device=device), torch.randn(4, 8, device=device)).shape == (0, 4)


def test_split_layout_covers_k_with_whole_chunks():
    for k, block_k, split in ((72, 32, 3), (64, 32, 8), (2048, 256, 5), (1, 16, 4), (14336, 512, 9)):
        splits, per = tg.split_layout(k, block_k, split)
        assert per % block_k == 0 and 1 <= splits <= split
        assert (splits - 1) * per < k <= splits * per  # no empty program, K fully covered
    # N alone gives enough programs: no split; too few: about TARGET_PROGRAMS
    assert tg.auto_split(128256, 2048, 8, 512) == 1
    blocks = 2048 // 16
    assert tg.auto_split(2048, 8192, 16, 256) * blocks >= tg.TARGET_PROGRAMS


# -- refusals ---------------------------------------------------------------------------------------


def _bad_calls():
    x, w = torch.randn(2, 32), torch.randn(8, 32)
    return {
        "M > 32": lambda: tg.gemv(torch.randn(33, 32), w),
        "w dtype": lambda: tg.gemv(x, w.half()),
        "x dtype": lambda: tg.gemv(x.double(), w.double()),
        "x 1-D": lambda: tg.gemv(torch.randn(32), w),
        "K mismatch": lambda: tg.gemv(x, torch.randn(8, 24)),
        "x K stride": lambda: tg.gemv(torch.randn(32, 2).t(), w),
        "w K stride": lambda: tg.gemv(x, torch.randn(32, 8).t()),
        "out shape": lambda: tg.gemv(x, w, torch.empty(2, 9)),
        "out dtype": lambda: tg.gemv(x, w, torch.empty(2, 8, dtype=torch.half)),
        "config length": lambda: tg.gemv(x, w, config=(16, 32, 1, 4)),
        "BLOCK_N": lambda: tg.gemv(x, w, config=(12, 32, 1, 4, 1)),
        "SPLIT_K": lambda: tg.gemv(x, w, config=(16, 32, 0, 4, 1)),
        "warps": lambda: tg.gemv(x, w, config=(16, 32, 1, 3, 1)),
        "mode": lambda: tg.gemv(x, w, config=(16, 32, 1, 4, 1, "wgmma")),
        "dot tile": lambda: tg.gemv(x, w, config=(8, 32, 1, 4, 1, "dot")),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_gemv_refuses_bad_inputs(case):
    with pytest.raises(ValueError, match=r"^tscompile: gemv"):
        _bad_calls()[case]()




def _sweep_summary():
    return {
        "m/qkv": {"n": 6144, "k": 4096, "best_m1": [1, 512, 1, 8, 1, "acc"], "best_m1_us": 13.0,
                  "cublas_m1_us": 16.4, "speedup_m1": 16.4 / 13.0,
                  "best_by_m": {"32": {"best": [64, 128, 1, 4, 4, "dot"], "speedup": 1.1}}},
        "m/o": {"n": 4096, "k": 4096, "best_m1": [4, 4096, 1, 4, 1, "acc"], "best_m1_us": 11.0,
                "cublas_m1_us": 11.1, "speedup_m1": 11.1 / 11.0},  # within the margin: stays cuBLAS
        "m/up": {"n": 28672, "k": 4096, "best_m1": None, "best_m1_us": None, "cublas_m1_us": 57.0,
                 "speedup_m1": None},  # no correct launch
    }


def test_decode_table_takes_the_m1_picks_that_beat_cublas_by_the_margin():
    """A shape enters DECODE_GEMV_CONFIGS with its best M = 1 launch only when that beat cuBLAS by the
    margin."""
    summary = _sweep_summary()
    assert tg.decode_table_from_sweep({"summary": summary}) == {(6144, 4096): (1, 512, 1, 8, 1, "acc")}
    assert set(tg.decode_table_from_sweep({"summary": summary}, min_speedup=1.0)) == {(6144, 4096), (4096, 4096)}


# -- GPU ----------------------------------------------------------------------------------------------

QKV_1B = (3072, 2048)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8])
def test_gemv_llama_1b_qkv_matches_torch_gpu(m):
    n, k = QKV_1B
    x, w = _inputs(m, n, k, torch.bfloat16, "cuda", seed=m)
    # the defaults split K here (fma at M = 1, dot at M = 8); the explicit configs do not
    for config in (None, (8, 512, 1, 4, 2, "fma"), (64, 128, 1, 4, 4, "dot"), (1, 512, 1, 8, 1, "acc"),
                   (4, 2048, 1, 16, 1, "acc")):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        tg.gemv(x, w, out, config=config)
        torch.testing.assert_close(out.float(), x.float() @ w.float().T, rtol=2.0 ** -8, atol=1e-2,
                                   msg=lambda s: f"config {config}: {s}")


@pytest.mark.gpu
def test_gemv_32_rows_llama_1b_qkv_matches_torch_gpu():
    """The 32-token prefill's row count: "dot" tiles only (the default splits K; the others do not)."""
    n, k = QKV_1B
    x, w = _inputs(32, n, k, torch.bfloat16, "cuda", seed=32)
    for config in (None, (64, 128, 1, 4, 4, "dot"), (128, 128, 1, 8, 3, "dot")):
        out = torch.full((32, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        tg.gemv(x, w, out, config=config)
        torch.testing.assert_close(out.float(), x.float() @ w.float().T, rtol=2.0 ** -8, atol=1e-2,
                                   msg=lambda s: f"config {config}: {s}")


@pytest.mark.gpu
@pytest.mark.parametrize("m, config", [(1, (8, 512, 2, 4, 2, "fma")), (8, (64, 128, 8, 4, 4, "dot")),
                                       (1, (2, 1024, 2, 8, 1, "acc"))])
def test_gemv_replays_in_cuda_graph_with_new_x_gpu(m, config):
    """Captured once with split-K (two launches and a partial buffer, which comes from the graph's
    pool), replayed with new x values copied into the static input: the result follows x."""
    n, k = QKV_1B
    x, w = _inputs(m, n, k, torch.bfloat16, "cuda", seed=3)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tg.gemv(x, w, out, config=config)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tg.gemv(x, w, out, config=config)
    for seed in (4, 5):
        new_x, _ = _inputs(m, n, k, torch.bfloat16, "cuda", seed=seed)
        x.copy_(new_x)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), new_x.float() @ w.float().T, rtol=2.0 ** -8, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("model, proj", [("llama-8b", "o"), ("llama-8b", "qkv"), ("llama-1b", "down"), ("llama-1b", "o")])
def test_dot_sum_equals_the_two_kernel_split_on_every_launch_gpu(model, proj):
    """On the GPU the programs of a column block really race for the counter: 200 fresh inputs at 32
    rows (eager, then replayed from a CUDA graph with new x copied in), each "dot_sum" result bit-equal
    to the two-kernel "dot" split of the same launch; the counters end at zero."""
    n, k = {("llama-8b", "o"): (4096, 4096), ("llama-8b", "qkv"): (6144, 4096),
            ("llama-1b", "down"): (2048, 8192), ("llama-1b", "o"): (2048, 2048)}[(model, proj)]
    config = (64, 256, 4, 4, 3, "dot_sum")
    x, w = _inputs(32, n, k, torch.bfloat16, "cuda", seed=n + k)
    out = torch.full((32, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    graph = capture_graph(lambda: tg.gemv(x, w, out, config=config))
    g = torch.Generator("cuda").manual_seed(5)
    for i in range(200):
        x.copy_(torch.randn(x.shape, device="cuda", generator=g).to(torch.bfloat16))
        want = tg.gemv(x, w, config=config[:5] + ("dot",))
        out.fill_(float("nan"))
        if i % 2:
            graph.replay()
        else:
            tg.gemv(x, w, out, config=config)
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"launch {i} ({'replay' if i % 2 else 'eager'})"
    assert int(tg._ARRIVALS[("gemv", "cuda", torch.cuda.current_device())].abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("m, config", [(1, (1, 2048, 2, 8, 1, "acc_sum")), (1, (8, 512, 4, 4, 2, "fma_sum")),
                                       (4, (16, 256, 4, 4, 2, "fma_sum"))])
def test_fma_and_acc_sums_equal_their_two_kernel_splits_gpu(m, config):
    """The CUDA-core modes' in-kernel sums, racing for the counters on the GPU: 100 fresh inputs at
    llama-8b's output shape, each bit-equal to the base mode's two-kernel split."""
    n, k = 4096, 4096
    x, w = _inputs(m, n, k, torch.bfloat16, "cuda", seed=m)
    base = config[:5] + (config[5].removesuffix("_sum"),)
    g = torch.Generator("cuda").manual_seed(9)
    for i in range(100):
        x.copy_(torch.randn(x.shape, device="cuda", generator=g).to(torch.bfloat16))
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        tg.gemv(x, w, out, config=config)
        assert torch.equal(out, tg.gemv(x, w, config=base)), f"launch {i}"


@pytest.mark.gpu
def test_gemv_pdl_reads_what_the_kernel_before_wrote_in_a_cuda_graph_gpu():
    """PDL launches (``pdl=True``) on the H200: each follows a kernel that writes its x in the same
    captured graph, so a program that read x before its ``gdc_wait`` would read the previous replay's
    values. Replayed with new sources: every output follows them, for llama-8b's qkv, output and down
    shapes."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs Hopper or later")
    assert tg.pdl_launch(torch.device("cuda"), True) == {"PDL": True, "launch_pdl": True}  # PDL really on
    config = (1, 2048, 1, 8, 1, "acc")
    for n, k in ((6144, 4096), (4096, 4096), (4096, 14336)):
        src = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        x = torch.empty_like(src)
        w = _inputs(1, n, k, torch.bfloat16, "cuda", seed=n)[1]
        out = torch.empty((1, n), dtype=torch.bfloat16, device="cuda")

        def step():
            torch.mul(src, 2.0, out=x)  # the kernel before: x is written right before the GEMV reads it
            tg.gemv(x, w, out, config=config, pdl=True)

        graph = capture_graph(step)  # a warm-up call on a side stream, then the capture
        for seed in (1, 2, 3):
            src.copy_(torch.randn(1, k, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            want = (src.float() * 2.0) @ w.float().T
            torch.testing.assert_close(out.float(), want, rtol=2.0 ** -7, atol=5e-2,
                                       msg=lambda s: f"{(n, k)} seed {seed}: {s}")
