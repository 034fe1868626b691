"""The skinny matmul (custom_ops/triton_gemv.py) against float32 math.

Without CUDA the kernel runs under the Triton interpreter (conftest sets TRITON_INTERPRET=1), so
the unmarked tests use tiny shapes and tiles: a few columns and K chunks still give several column
blocks, K ranges per split, a tail column block and a tail K chunk. The interpreter casts float32
to bf16/fp16 by truncation (the GPU rounds to nearest), so the tolerance is one unit in the last
place of the output dtype. ``gpu``-marked tests use the llama-1b qkv projection shape.
"""

from __future__ import annotations

import itertools
import json
import os

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
    tg._ARRIVALS[("cuda", 0)] = made
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


def test_shape_configs_take_precedence(monkeypatch):
    monkeypatch.setattr(tg, "SHAPE_CONFIGS", {(48, 64): DOT_SPLIT})
    assert tg.default_config(2, 48, 64) == (32, 16, 2, 4, 1, "dot")
    assert tg.default_config(2, 48, 96) != tg.default_config(2, 48, 64)


def test_split_layout_covers_k_with_whole_chunks():
    for k, block_k, split in ((72, 32, 3), (64, 32, 8), (2048, 256, 5), (1, 16, 4), (14336, 512, 9)):
        splits, per = tg.split_layout(k, block_k, split)
        assert per % block_k == 0 and 1 <= splits <= split
        assert (splits - 1) * per < k <= splits * per  # no empty program, K fully covered
    # N alone gives enough programs: no split; too few: about TARGET_PROGRAMS
    assert tg.auto_split(128256, 2048, 8, 512) == 1
    blocks = 2048 // 16
    assert tg.auto_split(2048, 8192, 16, 256) * blocks >= tg.TARGET_PROGRAMS


# -- the decode pass's fusions: an RMSNorm prologue, a residual epilogue ----------------------------


def _rms_norm_ref(x, g, eps):
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * g.float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("config, n, k", [
    (ACC, 9, 72),         # a tail column block and a tail K chunk: the sum of squares sees only real x
    (ACC_SPLIT, 12, 96),  # a split asked for: the fused call runs all of K in one program instead
    (FMA, 40, 72),
    (DOT, 33, 80),
])
def test_gemv_fused_norm_and_residual_match_float32_math(dtype, m, config, n, k, device):
    """``norm_weight``: rms_norm(x) * weight @ w.T with the norm in float32; ``residual``: the product
    rounded to the output dtype, then the residual added (the model's two roundings); both at once."""
    x, w = _inputs(m, n, k, dtype, device, seed=hash((str(dtype), m, config, n, "fused")) % 2**31)
    g = torch.Generator().manual_seed(n * k + m)
    x = x * 3.0 + 0.5  # far from unit RMS: a missing or wrong scale shows
    norm_weight = (1.0 + 0.5 * torch.randn(k, generator=g)).to(dtype=dtype, device=device)
    residual = torch.randn(m, n, generator=g).to(dtype=dtype, device=device)
    eps = 1e-5
    normed = _rms_norm_ref(x, norm_weight, eps) @ w.float().T
    product = (x.float() @ w.float().T).to(dtype).float()
    for kwargs, want in ((dict(norm_weight=norm_weight, eps=eps), normed),
                         (dict(residual=residual), product + residual.float()),
                         (dict(norm_weight=norm_weight, eps=eps, residual=residual),
                          normed.to(dtype).float() + residual.float())):
        out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
        assert tg.gemv(x, w, out, config=config, **kwargs) is out
        # the output is rounded once more than the reference: one ulp of |y| up to about 16
        torch.testing.assert_close(out.float(), want, rtol=2 * ULP[dtype], atol=2 * ULP[dtype] * 16,
                                   msg=lambda s: f"{sorted(kwargs)}: {s}")


def _rounded(t: torch.Tensor, dtype, device) -> torch.Tensor:
    """t (float32) rounded to dtype as the kernel rounds: to nearest on a GPU, by truncation under the
    CPU interpreter (module docstring); float32 unchanged."""
    if dtype == torch.float32:
        return t
    if torch.device(device).type == "cpu" and dtype == torch.bfloat16:
        return (t.contiguous().view(torch.int32) & -65536).view(torch.float32)  # keep the top 16 bits
    return t.to(dtype).float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("config, n, k", [(ACC, 9, 72), (ACC_SPLIT, 12, 96), (FMA, 40, 72), (DOT, 33, 80)])
def test_gemv_fused_swiglu_matches_the_models_silu_mul(dtype, m, config, n, k, device):
    """``swiglu``: x = [gate | up] (2K wide); the products use silu(gate) * up rounded as the model
    rounds ``F.silu(gate) * up`` (silu in float32, rounded, times up, rounded), then the down
    projection; with its residual too."""
    g = torch.Generator().manual_seed(hash((str(dtype), m, config, "swiglu")) % 2**31)
    gate_up = (torch.randn(m, 2 * k, generator=g) * 2).to(dtype=dtype, device=device)
    w = torch.randn(n, k, generator=g).to(dtype=dtype, device=device)
    residual = torch.randn(m, n, generator=g).to(dtype=dtype, device=device)
    gate, up = gate_up.float().chunk(2, dim=-1)
    act = _rounded(_rounded(gate / (1 + torch.exp(-gate)), dtype, device) * up, dtype, device)
    product = act @ w.float().T
    for kwargs, want in ((dict(), product), (dict(residual=residual), _rounded(product, dtype, device) + residual.float())):
        out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
        assert tg.gemv(gate_up, w, out, config=config, swiglu=True, **kwargs) is out
        torch.testing.assert_close(out.float(), want, rtol=2 * ULP[dtype], atol=2 * ULP[dtype] * 16,
                                   msg=lambda s: f"{sorted(kwargs)}: {s}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("config, n, k", [(ACC, 9, 72), (ACC_SPLIT, 12, 96), ((2, 32, 1, 4, 1, "acc"), 6, 32)])
def test_gemv_peeled_first_chunk_gives_the_plain_kernels_bits(dtype, config, n, k, device, monkeypatch):
    """TSCOMPILE_GEMV_PEEL peels the "acc" mode's first K chunk (its weights load before the PDL wait):
    the same products in the same order, so bit for bit the plain kernel's output, plain and with
    each fusion, with PDL asked for (a no-op without a Hopper GPU); (2, 32) at K = 32 is a program whose
    only chunk is the peeled one."""
    g = torch.Generator().manual_seed(hash((str(dtype), config, n, "peel")) % 2**31)
    m = 3
    x = (torch.randn(m, 2 * k, generator=g) * 2 + 0.5).to(dtype=dtype, device=device)
    w = torch.randn(n, k, generator=g).to(dtype=dtype, device=device)
    norm_weight = (1.0 + 0.5 * torch.randn(k, generator=g)).to(dtype=dtype, device=device)
    residual = torch.randn(m, n, generator=g).to(dtype=dtype, device=device)
    calls = (dict(x=x[:, :k]), dict(x=x[:, :k], norm_weight=norm_weight, eps=1e-5, residual=residual),
             dict(x=x, swiglu=True, residual=residual))
    for kwargs in calls:
        outs = []
        for peel in (False, True):
            monkeypatch.setattr(tg, "GEMV_PEEL", peel)
            out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
            outs.append(tg.gemv(w=w, out=out, config=config, pdl=peel, **kwargs))
        assert not outs[1].isnan().any()
        assert torch.equal(outs[0], outs[1]), sorted(kwargs)

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
        "norm_weight size": lambda: tg.gemv(x, w, norm_weight=torch.ones(31), eps=1e-5),
        "norm_weight 2-D": lambda: tg.gemv(x, w, norm_weight=torch.ones(1, 32), eps=1e-5),
        "eps": lambda: tg.gemv(x, w, norm_weight=torch.ones(32), eps=-1.0),
        "residual shape": lambda: tg.gemv(x, w, residual=torch.zeros(2, 9)),
        "residual dtype": lambda: tg.gemv(x, w, residual=torch.zeros(2, 8, dtype=torch.half)),
        "swiglu width": lambda: tg.gemv(x, w, swiglu=True),  # x is K wide, not 2K
        "swiglu and norm": lambda: tg.gemv(torch.randn(2, 64), w, swiglu=True, norm_weight=torch.ones(32), eps=1e-5),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_gemv_refuses_bad_inputs(case):
    with pytest.raises(ValueError, match=r"^tscompile: gemv"):
        _bad_calls()[case]()


def test_fused_table_env_loads_the_fused_sweeps_picks_only_with_the_fusion(tmp_path):
    """TSCOMPILE_GEMV_FUSED_TABLE: with TSCOMPILE_DECODE_GEMV_FUSE=1 a fresh process's fused launches
    are the fused sweep's best per shape (a shape with no correct launch keeps the plain one); without
    the fusion the file is never read; a bad file is a tscompile: ValueError."""
    import subprocess
    import sys

    good = tmp_path / "fused.json"
    good.write_text(json.dumps({"rows": [
        {"n": 6144, "k": 4096, "best_fused": "2,2048,1,8,1,acc"},
        {"n": 4096, "k": 14336, "best_fused": None}]}))
    code = "from tscompile.custom_ops import triton_gemv as tg; print(sorted(tg.DECODE_GEMV_FUSED_CONFIGS.items()))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TSCOMPILE_")}
    env.update(TSCOMPILE_GEMV_FUSED_TABLE=str(good), TSCOMPILE_DECODE_GEMV_FUSE="1")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[((6144, 4096), (2, 2048, 1, 8, 1, 'acc'))]"
    env.update(TSCOMPILE_DECODE_GEMV_FUSE="0", TSCOMPILE_GEMV_FUSED_TABLE=str(tmp_path / "missing.json"))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stderr[-2000:]
    (tmp_path / "bad.json").write_text(json.dumps({"rows": [{"n": 8, "k": 8, "best_fused": "3,64,1,4,1,acc"}]}))
    for name in ("bad.json", "missing.json"):
        with pytest.raises(ValueError, match=r"^tscompile: TSCOMPILE_GEMV_FUSED_TABLE=.*" + name):
            tg.fused_table_from_file(str(tmp_path / name))


def test_the_op_runs_a_fused_call_at_its_own_launch(monkeypatch):
    """``tscompile::gemv``: a fused call (norm, swiglu or residual) at DECODE_GEMV_FUSED_CONFIGS' launch
    where the shape has one, a plain call at the plain table's."""
    plain, fused = (16, 32, 1, 4, 1, "acc"), (8, 16, 1, 4, 1, "acc")
    monkeypatch.setattr(tg, "DECODE_GEMV_CONFIGS", {(24, 48): plain})
    monkeypatch.setattr(tg, "DECODE_GEMV_FUSED_CONFIGS", {(24, 48): fused})
    seen, real = [], tg.gemv
    monkeypatch.setattr(tg, "gemv", lambda x, w, out=None, config=None, **kw: seen.append(config) or real(x, w, out, config, **kw))
    x, w = torch.randn(1, 48), torch.randn(24, 48)
    torch.ops.tscompile.gemv(x, w)
    torch.ops.tscompile.gemv(x, w, residual=torch.randn(1, 24))
    torch.ops.tscompile.gemv(x, w, norm_weight=torch.ones(48), eps=1e-5)
    torch.ops.tscompile.gemv(torch.randn(1, 96), w, swiglu=True)
    assert seen == [plain, fused, fused, fused]


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


def test_gemv_table_env_loads_a_sweeps_picks_and_refuses_a_bad_file(tmp_path):
    """TSCOMPILE_GEMV_TABLE: a fresh process's decode and prefill tables are the sweep's (the decode
    pass is on unless TSCOMPILE_DECODE_GEMV=0, so the file is read with no other setting); a file that
    is not a sweep's JSON, or holds a launch the kernel refuses, is a tscompile: ValueError."""
    import subprocess
    import sys

    good = tmp_path / "sweep.json"
    good.write_text(json.dumps({"summary": _sweep_summary()}))
    code = ("from tscompile.custom_ops import triton_gemv as tg; "
            "print(tg.DECODE_GEMV, sorted(tg.DECODE_GEMV_CONFIGS.items()), sorted(tg.PREFILL_GEMV_CONFIGS.items()),"
            " sorted(tg.DECODE_GEMV_FUSE_ONLY.items()))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TSCOMPILE_")}
    env["TSCOMPILE_GEMV_TABLE"] = str(good)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    # m/o beat cuBLAS by 1.01x: below the margin, so listed only for the fusion (at parity or better)
    assert run.stdout.strip() == ("True [((6144, 4096), (1, 512, 1, 8, 1, 'acc'))] "
                                  "[((32, 6144, 4096), (64, 128, 1, 4, 4, 'dot'))] "
                                  "[((4096, 4096), (4, 4096, 1, 4, 1, 'acc'))]")
    # with the passes off the file is never read: a missing one is no error, the shipped tables stay
    env.update(TSCOMPILE_DECODE_GEMV="0", TSCOMPILE_BATCH_GEMV="0", TSCOMPILE_GEMV_TABLE=str(tmp_path / "missing.json"))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == (f"False {sorted(tg.DECODE_GEMV_CONFIGS.items())} {sorted(tg.PREFILL_GEMV_CONFIGS.items())} "
                                  f"{sorted(tg.DECODE_GEMV_FUSE_ONLY.items())}")
    env["TSCOMPILE_BATCH_GEMV"] = "1"  # the batch swap alone reads it too
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode != 0 and "tscompile: TSCOMPILE_GEMV_TABLE=" in run.stderr
    bad_launch = _sweep_summary()
    bad_launch["m/qkv"]["best_m1"] = [3, 512, 1, 8, 1, "acc"]  # BLOCK_N not a power of two
    (tmp_path / "bad_launch.json").write_text(json.dumps({"summary": bad_launch}))
    (tmp_path / "not_json.json").write_text("{")
    (tmp_path / "no_summary.json").write_text("{}")
    for name in ("bad_launch.json", "not_json.json", "no_summary.json", "missing.json"):
        with pytest.raises(ValueError, match=r"^tscompile: TSCOMPILE_GEMV_TABLE=.*" + name):
            tg.gemv_tables_from_file(str(tmp_path / name))


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
def test_gemv_fused_norm_and_residual_llama_8b_shapes_match_torch_gpu():
    """The shipped launch on llama-8b's qkv (RMSNorm prologue) and output (residual epilogue) shapes,
    bf16, against float32 math; and the fused kernel in a CUDA graph replayed with new inputs."""
    config = (1, 2048, 1, 8, 1, "acc")
    for (n, k), fuse in (((6144, 4096), "norm"), ((4096, 4096), "residual")):
        x, w = _inputs(1, n, k, torch.bfloat16, "cuda", seed=n)
        norm_weight = (1.0 + 0.5 * torch.randn(k, device="cuda")).to(torch.bfloat16)
        residual = torch.randn(1, n, device="cuda").to(torch.bfloat16)
        kwargs = dict(norm_weight=norm_weight, eps=1e-5) if fuse == "norm" else dict(residual=residual)
        out = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        tg.gemv(x, w, out, config=config, **kwargs)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            tg.gemv(x, w, out, config=config, **kwargs)
        for seed in (1, 2):
            x.copy_(_inputs(1, n, k, torch.bfloat16, "cuda", seed=seed * 7 + n)[0] * 2.0)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            if fuse == "norm":
                want = _rms_norm_ref(x, norm_weight, 1e-5) @ w.float().T
            else:
                want = (x.float() @ w.float().T).to(torch.bfloat16).float() + residual.float()
            torch.testing.assert_close(out.float(), want, rtol=2.0 ** -7, atol=5e-2, msg=lambda s: f"{fuse}: {s}")


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
    assert int(tg._ARRIVALS[("cuda", torch.cuda.current_device())].abs().sum()) == 0


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
def test_gemv_pdl_reads_what_the_kernel_before_wrote_in_a_cuda_graph_gpu(monkeypatch):
    """PDL launches (``pdl=True``, with and without the peeled first chunk) on the H200: each follows
    a kernel that writes its x (and its residual) in the same captured graph, so a program that read
    x before its ``gdc_wait`` would read the previous replay's values. Replayed with new sources: every output follows them, for
    llama-8b's qkv (norm fused) and output (residual fused) shapes and the plain down shape."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs Hopper or later")
    assert tg.pdl_launch(torch.device("cuda"), True) == {"PDL": True, "launch_pdl": True}  # PDL really on
    config = (1, 2048, 1, 8, 1, "acc")
    cases = (((6144, 4096), "norm"), ((4096, 4096), "residual"), ((4096, 14336), None))
    for ((n, k), fuse), peel in itertools.product(cases, (False, True)):
        monkeypatch.setattr(tg, "GEMV_PEEL", peel)
        src = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        x = torch.empty_like(src)
        w = _inputs(1, n, k, torch.bfloat16, "cuda", seed=n)[1]
        norm_weight = (1.0 + 0.5 * torch.randn(k, device="cuda")).to(torch.bfloat16)
        r_src = torch.randn(1, n, device="cuda", dtype=torch.bfloat16)
        residual = torch.empty_like(r_src)
        kwargs = {"norm": dict(norm_weight=norm_weight, eps=1e-5), "residual": dict(residual=residual)}.get(fuse, {})
        out = torch.empty((1, n), dtype=torch.bfloat16, device="cuda")

        def step():
            torch.mul(src, 2.0, out=x)  # the kernel before: x is written right before the GEMV reads it
            torch.mul(r_src, -1.0, out=residual)
            tg.gemv(x, w, out, config=config, pdl=True, **kwargs)

        graph = capture_graph(step)  # a warm-up call on a side stream, then the capture
        for seed in (1, 2, 3):
            src.copy_(torch.randn(1, k, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
            r_src.copy_(torch.randn(1, n, device="cuda", generator=torch.Generator("cuda").manual_seed(seed + 9)))
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            xs = src.float() * 2.0
            if fuse == "norm":
                want = _rms_norm_ref(xs, norm_weight, 1e-5) @ w.float().T
            elif fuse == "residual":
                want = (xs @ w.float().T).to(torch.bfloat16).float() - r_src.float()
            else:
                want = xs @ w.float().T
            torch.testing.assert_close(out.float(), want, rtol=2.0 ** -7, atol=5e-2,
                                       msg=lambda s: f"{fuse} peel {peel} seed {seed}: {s}")
