"""``tscompile export``'s proof that the package it wrote loads: ``load_package`` once, in a fresh
Python process, and one prompt through both programs.

A fresh process because a package that does not load often crashes rather than raising (a
library whose initializers segfault under ``dlopen``); the exporting process must survive to say
why. A failure names the compiler Inductor used and the setting it came from. When the ``CXX``
environment variable chose that compiler, the package is rebuilt once with the system ``g++`` on
``PATH`` and checked again, with a WARNING in the ``tscompile`` log either way: never silently.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from tscompile.package.compiler_check import CompilerChoice, compiler_advice, system_gxx_instead_of

logger = logging.getLogger("tscompile")

DEFAULT_TIMEOUT_S = 900.0  # a large model's weights load in the child too
_MAX_GIST_CHARS = 1000
_LOAD_ONCE = "import sys\nfrom tscompile.package.load_child import load_once\nload_once(sys.argv[1], sys.argv[2])\n"


class PackageLoadError(ValueError):
    """A ``tscompile:`` refusal of a package that does not load; ``reason`` is what went wrong in
    the child, without the advice."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def load_command(path: str | os.PathLike, device: str) -> list[str]:
    """The child process that loads the package (tests replace it with one that crashes)."""
    return [sys.executable, "-c", _LOAD_ONCE, os.fspath(path), str(device)]


def _child_env() -> dict[str, str]:
    """The parent's environment, with this tscompile first on the path (the child must load the
    package with the same code that wrote it, installed or not)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # the folder holding this tscompile package
    env["PYTHONPATH"] = os.pathsep.join([root, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    return env


def _gist(stderr: str) -> str:
    """The child's own ``tscompile:`` refusal if it raised one (without its advice, which the
    parent's message repeats), else its last lines of stderr, on one line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    refusals = [line for line in lines if "tscompile:" in line]
    if refusals:  # its start says what is wrong: cut the end
        text = refusals[-1][refusals[-1].index("tscompile:") + len("tscompile:"):].strip()
        text = text.split(" To load it, ")[0].rstrip(".")
        return text if len(text) <= _MAX_GIST_CHARS else text[:_MAX_GIST_CHARS] + "..."
    text = " | ".join(lines[-3:]) or "no output on stderr"  # a traceback's last lines say the most: cut the start
    return text if len(text) <= _MAX_GIST_CHARS else "..." + text[-_MAX_GIST_CHARS:]


def load_failure(path: str | os.PathLike, device: str, *, timeout: float = DEFAULT_TIMEOUT_S) -> str | None:
    """None when the package loads and runs in a fresh process, else what went wrong there."""
    try:
        run = subprocess.run(load_command(path, device), capture_output=True, text=True, timeout=timeout,
                             env=_child_env())
    except subprocess.TimeoutExpired:
        return f"loading it in a fresh process did not finish within {timeout:.0f} s"
    if run.returncode == 0:
        return None
    if run.returncode < 0:
        try:
            name = signal.Signals(-run.returncode).name
        except ValueError:
            name = "a signal"
        how = f"crashed with {name} (signal {-run.returncode})"
    else:
        how = f"failed with exit status {run.returncode}"
    return f"loading it in a fresh process {how}: {_gist(run.stderr)}"


def _refusal(path, reason: str, compiler: CompilerChoice, history: str = "") -> PackageLoadError:
    return PackageLoadError(
        f"tscompile: package {os.fspath(path)!r} does not load: {reason}. {history}Its C++ code was compiled by "
        f"{compiler.describe()}; a compiler whose shared libraries do not link the C++ runtime (libstdc++) "
        f"builds packages that crash while loading. To load it, {compiler_advice(compiler)}; "
        f"tscompile export --no-verify (verify=False) skips this check.", reason)


def verify_loads_in_subprocess(path: str | os.PathLike, device: str, compiler: CompilerChoice, *,
                               timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Refuse (``PackageLoadError``, a ``ValueError('tscompile: ...')``) a package that does not load
    and run in a fresh process, naming ``compiler``, the one that built it."""
    reason = load_failure(path, device, timeout=timeout)
    if reason is not None:
        raise _refusal(path, reason, compiler)


def ensure_package_loads(path: str | os.PathLike, device: str, compiler: CompilerChoice,
                         rebuild: Callable[[str], CompilerChoice], *,
                         timeout: float = DEFAULT_TIMEOUT_S) -> CompilerChoice:
    """Check the package just written; when it does not load and ``CXX`` chose its compiler,
    ``rebuild(system_gxx)`` rewrites it once with the system ``g++`` and it is checked again.
    Returns the compiler of the package that loads; refuses when none does."""
    start = time.perf_counter()
    try:
        verify_loads_in_subprocess(path, device, compiler, timeout=timeout)
        logger.info("tscompile: %s loads in a fresh process (checked in %.1f s)", os.fspath(path),
                    time.perf_counter() - start)
        return compiler
    except PackageLoadError as first:
        gxx = system_gxx_instead_of(compiler)
        if gxx is None:
            raise
        logger.warning("tscompile: the package built with CXX=%s does not load (%s); rebuilding once with the "
                       "system g++ %s", compiler.command, first.reason, gxx)
        failed = first
    rebuilt = rebuild(gxx)
    reason = load_failure(path, device, timeout=timeout)
    if reason is not None:
        raise _refusal(path, reason, rebuilt, history=f"The first build, with CXX={compiler.command}, did not load "
                                                      f"either ({failed.reason}). ")
    logger.warning("tscompile: the package rebuilt with the system g++ %s loads; it replaces the one built with "
                   "CXX=%s (set CXX=%s or unset it to build it right the first time)", gxx, compiler.command, gxx)
    return rebuilt
