"""passes/residual_addmm.py: a residual ``addmm`` back to ``mm`` + ``add`` in CUDA split pieces.

The pass acts only on CUDA graphs; here it is run on CPU graphs by naming the CPU device, which is
what the engine never does (on the CPU Inductor's addmm costs no copy, and the CPU results stay as
they were)."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from tscompile.config import TscompileConfig
from tscompile.passes.residual_addmm import UnfuseResidualAddmm, unfuse_residual_addmm
from tscompile.piece_compiler import piece_inductor_patches

from helpers import our_pass

aten = torch.ops.aten


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _layer(x, w, r, bias):
    return torch.addmm(r, x, w), torch.addmm(bias, x, w)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(6, 8, generator=g), torch.randn(8, 5, generator=g), torch.randn(6, 5, generator=g),
            torch.randn(5, generator=g)]


def test_a_residual_addmm_becomes_mm_plus_add_and_a_bias_stays():
    gm = make_fx(_layer)(*_inputs())
    assert _targets(gm).count(aten.addmm.default) == 2
    assert unfuse_residual_addmm(gm.graph, devices=("cpu",)) == 1
    gm.recompile()
    targets = _targets(gm)
    assert targets.count(aten.addmm.default) == 1  # the 1-D bias: no copy, left alone
    assert aten.mm.default in targets and aten.add.Tensor in targets
    x, w, r, bias = _inputs()
    residual, biased = gm(x, w, r, bias)
    assert torch.equal(residual, r + x @ w)  # the eager model's order of rounding
    assert torch.equal(biased, torch.addmm(bias, x, w))


def test_other_devices_and_scaled_addmm_are_left_alone():
    gm = make_fx(_layer)(*_inputs())
    assert unfuse_residual_addmm(gm.graph) == 0  # the default is CUDA only: a CPU graph is untouched
    scaled = make_fx(lambda x, w, r: torch.addmm(r, x, w, beta=0.5))(*_inputs()[:3])
    assert unfuse_residual_addmm(scaled.graph, devices=("cpu",)) == 0


def test_inside_inductor_the_add_fuses_and_results_match_eager(monkeypatch):
    """The rewritten graph lowers: no addmm left in the generated code, outputs as eager's."""
    from torch._inductor.utils import run_and_get_code

    import tscompile.passes.residual_addmm as pass_module

    real = pass_module.unfuse_residual_addmm
    monkeypatch.setattr(pass_module, "unfuse_residual_addmm", lambda graph: real(graph, devices=("cpu",)))

    def piece(x, w, h):
        h2 = h + x @ w  # the residual: an output of the piece, so Inductor would pick addmm
        return h2, h2 * torch.rsqrt(h2.pow(2).mean(-1, keepdim=True) + 1e-5)

    x, w, h = _inputs()[0], _inputs()[1], _inputs()[2]
    torch._dynamo.reset()
    plain = torch.compile(piece, backend="inductor")
    _, (code_plain,) = run_and_get_code(plain, x, w, h)
    torch._dynamo.reset()
    unfused = torch.compile(piece, backend="inductor",
                            options={"post_grad_custom_post_pass": UnfuseResidualAddmm()})
    out, (code,) = run_and_get_code(unfused, x, w, h)
    assert "addmm" in code_plain and "addmm" not in code
    torch.testing.assert_close(out, piece(x, w, h), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("device,split_piece,expected", [
    ("cuda", True, True), ("cpu", True, False), ("cuda", False, False),
])
def test_only_cuda_split_pieces_get_the_pass(device, split_piece, expected):
    patches = piece_inductor_patches(TscompileConfig(), False, device_type=device, split_piece=split_piece,
                                     cudagraph_trees=False)
    assert (our_pass(patches, UnfuseResidualAddmm) is not None) is expected


def test_a_post_pass_of_the_users_options_is_kept():
    mine = object()
    config = TscompileConfig.from_options({"inductor_options": {"post_grad_custom_post_pass": mine}})
    assert piece_inductor_patches(config, False, device_type="cuda", split_piece=True,
                                  cudagraph_trees=False)["post_grad_custom_post_pass"] is mine
