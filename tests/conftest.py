import os

import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through the interpreter; it must be chosen before triton imports.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import tscompile  # noqa: F401  (registers the ops)

pytest_plugins = ["failure_log", "done_log"]


def _threads_per_worker() -> int | None:
    """Under pytest-xdist: this worker's share of the cores the run may use (None otherwise)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if workers < 1:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // workers)


_THREADS = _threads_per_worker()
if _THREADS is not None and _THREADS < torch.get_num_threads():
    # Each worker's intra-op threads (and OpenMP's, in Inductor's CPU kernels) at its share of the
    # cores: more threads than cores make OpenMP's barriers spin against the other worker (the fuzz
    # ran 5x slower so, see test_fuzz.py). The processes the tests start inherit the limit.
    torch.set_num_threads(_THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))


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
