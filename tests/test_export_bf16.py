"""A bf16 package's logits against the engine's, on this machine's device: test_gpu_packages.py's
comparison, here so that CI (the CPU) runs it too. Its own module so that pytest-xdist's per-file
scheduling can run its export beside test_export.py's instead of after them; the fixtures are
test_export.py's (imported, so they apply here as there)."""

import pytest
import torch

import tscompile
from helpers import record_modes
from package_logits import assert_bf16_package_logits_match_engine
from test_export import BOUNDS, DEVICE, PROMPTS, aoti_usable, eager  # noqa: F401  (fixtures)
from tscompile.export import export_package
from tscompile.forward_context import ForwardMode


@pytest.mark.slow
def test_bf16_package_logits_equal_engine_within_what_bf16_costs(tmp_path_factory, eager):  # noqa: F811
    """test_gpu_packages.py's bf16 comparison on this module's device (about a minute on 2 CPU cores,
    most of it the export): prefill and three decode steps teacher forced on the package's tokens,
    within twice (float32 engine) and three times (bf16 engine) the engine's own bf16 error."""
    path = tmp_path_factory.mktemp("bf16") / "llama-tiny-bf16.pt2"
    export_package("llama-tiny", path, device=DEVICE, dtype=torch.bfloat16, verify=False, **BOUNDS)
    llm = tscompile.load_package(path)
    assert llm.package.record["dtype"] == "bfloat16"
    bf16 = tscompile.LLM("llama-tiny", device=DEVICE, dtype=torch.bfloat16, enforce_eager=True, **BOUNDS)
    modes = record_modes(llm)
    assert_bf16_package_logits_match_engine(llm, bf16, eager("llama-tiny"), PROMPTS[:3], steps=4)
    assert modes.count(ForwardMode.EXTEND) == 3 and modes.count(ForwardMode.DECODE) == 9  # both programs
