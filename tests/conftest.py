import os

import pytest
import torch

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
