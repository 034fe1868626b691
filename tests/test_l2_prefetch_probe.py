"""scripts/l2_prefetch_probe.py on the CPU (Triton interpreter): the prefetch kernel reads every element
of the weight (its partial sums, poisoned first, add up to the weight's sum, a ragged tail included),
it refuses what it cannot read, and the script says so plainly when no GPU is there."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "l2_prefetch_probe.py"
_spec = importlib.util.spec_from_file_location("l2_prefetch_probe", _PATH)
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)


@pytest.mark.parametrize("shape", [(3, 4096), (5, 1000)])  # whole blocks; a ragged last block
def test_prefetch_kernel_reads_every_element(shape):
    torch.manual_seed(sum(shape))
    for _ in range(2):  # fresh data per check
        w = torch.randn(*shape, dtype=torch.float32).to(torch.bfloat16)
        partial = probe.prefetch_partials(w)
        partial.fill_(float("nan"))
        probe.prefetch_into_l2(w, partial)
        assert torch.isfinite(partial).all()
        torch.testing.assert_close(partial.sum(), w.float().sum(), rtol=1e-4, atol=1e-2)
        # block by block too: a program that read another's elements would pass the total only by luck
        flat = torch.nn.functional.pad(w.float().reshape(-1), (0, partial.numel() * probe.PREFETCH_BLOCK - w.numel()))
        torch.testing.assert_close(partial, flat.view(-1, probe.PREFETCH_BLOCK).sum(1), rtol=1e-4, atol=1e-3)


def test_prefetch_refuses_a_strided_weight_or_a_wrong_buffer():
    w = torch.randn(8, 512).to(torch.bfloat16)
    with pytest.raises(ValueError, match="^tscompile: .*contiguous"):
        probe.prefetch_into_l2(w.t(), probe.prefetch_partials(w))
    with pytest.raises(ValueError, match="^tscompile: .*float32 buffer"):
        probe.prefetch_into_l2(w, torch.empty(3))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU message")
def test_probe_says_it_needs_a_gpu(capsys, tmp_path):
    assert probe.main([str(tmp_path / "out.json")]) == 2
    assert "tscompile: " in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()
