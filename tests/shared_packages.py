"""AOTInductor packages that several test files load, built once per test run.

A package build is slow on a CPU (about 45 s: two programs, each a C++ wrapper compiled by g++),
so a package that more than one file needs is built by whichever test asks first and then read,
never written, by the others, across pytest-xdist's workers: it lives in the run's shared temporary
folder (the parent of each worker's own), and a file lock makes the other worker wait for a build
in progress instead of starting a second one. A test that damages or edits a package copies it
first.

The key is everything the build depends on (model, device, dtype, weights, bounds), so two tests
get the same file only when they asked for the same package."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from filelock import FileLock

# test_export.py's packages (and scripts/startup.py's package child): room for 4 requests of up to
# 64 positions, prompts prefilled 32 tokens a step
BOUNDS = dict(max_num_seqs=4, max_model_len=64, page_size=4, max_num_batched_tokens=32)
# tight bounds: 2 requests and 4 tokens a step (batch and token sizes of 1 and 2 are ordinary sizes,
# prompts run in 4-token chunks); 32 positions hold test_export.py's longest prompt and its tokens
TIGHT_BOUNDS = dict(max_num_seqs=2, max_model_len=32, page_size=4, max_num_batched_tokens=4)

SYSTEM_GXX = "/usr/bin/g++"


def loadable_cxx() -> str | None:
    """The system g++ when ``CXX`` names another compiler: the GPU machine's ``CXX`` builds
    libraries without ``libstdc++`` that crash when loaded (``tscompile.package.compiler_check``),
    and these packages are exported with ``verify=False``, so nothing would rebuild them."""
    cxx = os.environ.get("CXX")
    if not cxx or not os.path.exists(SYSTEM_GXX):
        return None
    named = shutil.which(cxx) or cxx
    return None if os.path.realpath(named) == os.path.realpath(SYSTEM_GXX) else SYSTEM_GXX


def _shared_root(tmp_path_factory) -> Path:
    base = tmp_path_factory.getbasetemp()
    # under xdist each worker's basetemp is <run>/popen-gwN: the run's folder is the shared one
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared_packages"
    root.mkdir(parents=True, exist_ok=True)
    return root


def _build(path: Path, model: str, device: str, dtype: torch.dtype, weights: str, bounds: dict) -> None:
    import torch._inductor.config as inductor_config

    from tscompile.cli import main as cli_main
    from tscompile.export import export_package

    gxx = loadable_cxx()
    with inductor_config.patch({"cpp.cxx": (gxx,)} if gxx else {}):
        if weights == "external":  # through the CLI, so `tscompile export` is covered too
            args = ["export", "--model", model, "--out", str(path), "--device", device,
                    "--dtype", str(dtype).removeprefix("torch."), "--weights", "external",
                    "--no-verify"]  # the load check: test_package_load_check.py
            for k, v in bounds.items():
                args += [f"--{k.replace('_', '-')}", str(v)]
            if cli_main(args) != 0:
                raise RuntimeError(f"tscompile export {' '.join(args)} failed")
        else:
            export_package(model, path, device=device, dtype=dtype, weights=weights, verify=False, **bounds)


def shared_package(tmp_path_factory, model: str = "llama-tiny", *, device: str | torch.device,
                   dtype: torch.dtype = torch.float32, weights: str = "inside", bounds: dict) -> Path:
    """The path of this package, exported on first use in this test run (by any worker) and shared.
    Treat it as read-only: copy it (and, for external weights, its ``.safetensors``) to change it."""
    device = torch.device(device).type
    name = "-".join([model, device, str(dtype).removeprefix("torch."), weights,
                     *(f"{k}{v}" for k, v in sorted(bounds.items()))])
    path = _shared_root(tmp_path_factory) / f"{name}.pt2"
    done = path.with_suffix(".done")
    with FileLock(str(path.with_suffix(".lock"))):
        if not done.exists():
            _build(path, model, device, dtype, weights, bounds)
            done.touch()
    return path
