import os

import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through the interpreter; it must be chosen before triton imports.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import tscompile  # noqa: F401  (registers the ops)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return torch.device(os.environ.get("TSCOMPILE_TEST_DEVICE", "cuda" if torch.cuda.is_available() else "cpu"))
