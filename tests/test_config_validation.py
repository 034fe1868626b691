"""``TscompileConfig`` refuses every option of the wrong type with a ``tscompile:`` error naming
the option and the value, and a piece compiler that cannot be imported is refused up front."""

from __future__ import annotations

import builtins
import re
from pathlib import Path

import pytest

from tscompile.config import TscompileConfig, check_piece_compiler_importable


@pytest.mark.parametrize("option,value,allowed", [
    ("piece_compiler", "tvm", "one of"),
    ("piece_compiler", 1, "one of"),
    ("split_sdpa", "yes", "True or False"),
    ("split_narrowing", 1, "True or False"),
    ("cudagraphs", None, "True or False"),
    ("split_ops", "tscompile::attention", "sequence of op names"),
    ("split_ops", ["tscompile::attention", 3], "sequence of op names"),
    ("token_ladder", (16, 32.0), "sequence of ints"),
    ("token_ladder", (True, 2), "sequence of ints"),
    ("token_ladder", "16,32", "sequence of ints"),
    ("decode_ladder", 8, "sequence of ints"),
    ("decode_ladder", (4, 2), "strictly increasing positive ints"),
    ("decode_ladder", (), "strictly increasing positive ints"),
    ("decode_ladder", (0, 1), "strictly increasing positive ints"),
    ("prefill_graph_max_tokens", -1, ">= 0"),
    ("prefill_graph_max_tokens", 64.0, ">= 0"),
    ("prefill_graph_max_tokens", True, ">= 0"),
    ("debug_dir", 3, "str path or None"),
    ("inductor_options", 5, "dict of torch._inductor.config names"),
])
def test_option_of_wrong_type_is_refused(option, value, allowed):
    with pytest.raises(ValueError, match=rf"^tscompile: {option} must be .*{re.escape(allowed)}.*"
                                         rf"{re.escape(repr(value))}"):
        TscompileConfig.from_options({option: value})


def test_valid_options_are_kept_and_normalized(tmp_path):
    config = TscompileConfig.from_options({"split_ops": ["aten::mm"], "token_ladder": range(4, 12, 4),
                                           "split_sdpa": True, "prefill_graph_max_tokens": 0,
                                           "debug_dir": Path(tmp_path)})
    assert config.split_ops == ("aten::mm",) and config.token_ladder == (4, 8)
    assert config.debug_dir == str(tmp_path) and config.prefill_graph_max_tokens == 0
    hash(config)  # still hashable: sequences became tuples


def test_tensorrt_refused_up_front_when_not_importable(monkeypatch):
    real_import = builtins.__import__

    def no_tensorrt(name, *args, **kwargs):
        if name == "torch_tensorrt":
            raise ImportError("No module named 'torch_tensorrt'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorrt)
    config = TscompileConfig.from_options({"piece_compiler": "tensorrt"})  # the option itself is valid
    with pytest.raises(ValueError, match=r"^tscompile: piece_compiler='tensorrt' needs torch-tensorrt, which is "
                                         r"not importable \(ImportError"):
        check_piece_compiler_importable(config)
    check_piece_compiler_importable(TscompileConfig.from_options({"piece_compiler": "eager"}))


def test_static_graphs_and_split_pieces_on_cuda_get_combo_kernels_unless_the_user_sets_it():
    from tscompile.piece_compiler import piece_inductor_patches

    def patches(config, static, device_type, cudagraph_trees=False, split_piece=False):
        out = piece_inductor_patches(config, static, device_type=device_type, split_piece=split_piece,
                                     cudagraph_trees=cudagraph_trees)
        out.pop("post_grad_custom_post_pass", None)  # the residual-addmm pass: tests/test_residual_addmm.py
        return out

    default = TscompileConfig()
    assert patches(default, True, "cuda") == {"combo_kernels": True, "triton.cudagraphs": False}
    assert patches(default, False, "cuda", split_piece=True) == {"combo_kernels": True, "triton.cudagraphs": False}
    # a whole dynamic-shape graph (the bs>1 decode step): measured slower with it on llama-8b
    assert patches(default, False, "cuda") == {"triton.cudagraphs": False}
    # the CPU's C++ backend has no combo kernels: nothing is added there
    assert patches(default, True, "cpu", cudagraph_trees=True) == {"triton.cudagraphs": True}
    off = TscompileConfig(inductor_options={"combo_kernels": False},
                          static_inductor_options={"coordinate_descent_tuning": True})
    assert patches(off, True, "cuda") == \
        {"combo_kernels": False, "coordinate_descent_tuning": True, "triton.cudagraphs": False}
    assert patches(off, False, "cuda", split_piece=True) == {"combo_kernels": False, "triton.cudagraphs": False}
    on = TscompileConfig(inductor_options={"combo_kernels": True})
    assert patches(on, False, "cuda") == {"combo_kernels": True, "triton.cudagraphs": False}


# -- kernels: the KernelPolicy -----------------------------------------------------------------------


def test_kernels_option_becomes_a_frozen_kernel_policy_in_the_hash():
    from tscompile.kernel_policy import KernelPolicy

    config = TscompileConfig.from_options({"kernels": {"decode_pdl": False, "prefill_pdl": True}})
    assert config.kernels == KernelPolicy(decode_pdl=False, prefill_pdl=True)
    assert TscompileConfig.from_options({"kernels": KernelPolicy(decode_pdl=False, prefill_pdl=True)}) == config
    with pytest.raises(Exception):  # frozen
        config.kernels.decode_pdl = True
    hashes = {TscompileConfig().compute_hash(), config.compute_hash(),
              TscompileConfig.from_options({"kernels": {"batch_gemv": False}}).compute_hash()}
    assert len(hashes) == 3  # a graph compiled under one policy is not another's
    assert TscompileConfig.from_options({"kernels": {}}).compute_hash() == TscompileConfig().compute_hash()


def test_unknown_kernels_keys_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"^tscompile: unknown kernels option\(s\) \['gemv_fuse'\]; known kernels "
                                         r"options: \['decode_gemv', 'batch_gemv', 'decode_pdl', 'prefill_pdl', "
                                         r"'fuse_projections', 'fused_verify_attention', 'chunked_gated_delta', "
                                         r"'state_pdl', 'fused_gated_delta', 'split_gated_delta_heads', "
                                         r"'user_graph_eager_tail', 'graphed_refresh'\]"):
        TscompileConfig.from_options({"kernels": {"gemv_fuse": True}})


@pytest.mark.parametrize("value", [1, "yes", None])
def test_kernels_fields_must_be_booleans(value):
    with pytest.raises(ValueError, match=r"^tscompile: kernels.decode_gemv must be True or False"):
        TscompileConfig.from_options({"kernels": {"decode_gemv": value}})
    with pytest.raises(ValueError, match=r"^tscompile: kernels must be a dict of KernelPolicy fields"):
        TscompileConfig.from_options({"kernels": [("decode_gemv", True)]})


def test_no_environment_variable_switches_a_kernel_or_pass():
    """Only the documented debugging aids read the environment in the backend, the passes and the ops:
    TSCOMPILE_DEBUG_DIR (debug_dir's default) and TSCOMPILE_GRAPH_DEBUG; TRITON_INTERPRET says whether
    the Triton kernels run under the CPU interpreter; torchrun's rank variables say which rank a
    tensor-parallel process is (tscompile/distributed)."""
    root = Path(__file__).resolve().parents[1]
    reads = []
    for folder in ("tscompile", "custom_ops", "passes"):
        for path in (root / folder).rglob("*.py"):
            for line in path.read_text().splitlines():
                if re.search(r"os\.environ|getenv", line):
                    reads.append((path.relative_to(root).as_posix(), line.strip()))
    names = {m for _, line in reads for m in re.findall(r"[\"']([A-Z][A-Z0-9_]+)[\"']", line)}
    torchrun = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    assert names <= {"TSCOMPILE_DEBUG_DIR", "TSCOMPILE_GRAPH_DEBUG", "TRITON_INTERPRET", "CXX"} | torchrun, reads
