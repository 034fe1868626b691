"""What a bench result says about where it ran: versions, hardware, the kernel choices the engine's
graphs run with, and the tscompile source tree (commit and content tree) that produced it."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _checkout_root() -> Path | None:
    root = Path(__file__).resolve().parents[1]
    # an installed copy: a git repository around it would be another's
    return root if (root / ".git").exists() else None


def source_tree(root: Path | None = None) -> str | None:
    """The commit of the tscompile checkout that ran (``+dirty`` with local changes, then the content
    tree, ``content_tree``), or None where it is not a git checkout: two runs merged into one table
    may come from other code. A copied working tree (a GPU machine's copy of a checkout) can carry an
    older ``.git`` than its files; the content tree names the files themselves."""
    root = root or _checkout_root()
    if root is None:
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        committed = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD^{tree}"], capture_output=True,
                                   text=True, timeout=10)
        # new files count too: a copy whose .git is older than its files may differ only by them
        content = content_tree(root)
        if content is not None and committed.stdout.strip().startswith(content):
            return head.stdout.strip()
        return head.stdout.strip() + "+dirty" + (f", content tree {content}" if content else "")
    except (OSError, subprocess.SubprocessError):
        return None


def content_tree(root: Path | None = None) -> str | None:
    """The git tree hash (12 digits) of the checkout's files as they are, untracked files that git
    does not ignore included: the ``%T`` of the commit that holds exactly these files
    (``git log --format='%h %T'`` finds it), whatever the checkout's HEAD. Written through a
    throwaway index, so the checkout's own index is untouched."""
    root = root or _checkout_root()
    if root is None:
        return None

    import shutil
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tscompile_tree_") as tmp:
        index = os.path.join(tmp, "index")
        env = {**os.environ, "GIT_INDEX_FILE": index}
        try:
            # start from the checkout's own index: unchanged files are not hashed again, and their modes
            # come from it (core.fileMode off), so a copy that lost execute bits still names the commit.
            # copy2 keeps the index's mtime: git trusts a cached stat only for files older than the index
            # file, so a fresh mtime would pass a same-second, same-size rewrite off as unchanged
            own = subprocess.run(["git", "-C", str(root), "rev-parse", "--path-format=absolute", "--git-path",
                                  "index"], capture_output=True, text=True, timeout=10)
            if own.returncode == 0 and os.path.exists(own.stdout.strip()):
                shutil.copy2(own.stdout.strip(), index)
            for cmd in (["-c", "core.fileMode=false", "add", "-A", "."], ["write-tree"]):
                out = subprocess.run(["git", "-C", str(root), *cmd], capture_output=True, text=True, timeout=60,
                                     env=env)
                if out.returncode != 0:
                    return None
        except (OSError, subprocess.SubprocessError):
            return None
    return out.stdout.strip()[:12] or None


def kernel_paths(policy=None) -> dict:
    """The kernel choices the engine's graphs run with on this machine (``KernelPolicy``, default the
    engine's default): each as it applies here (a GEMV swap only on a GPU its tables were timed on, PDL
    only where the GPU has it), with the launch tables of the swaps that apply."""
    from tscompile.custom_ops import triton_gemv
    from tscompile.kernel_policy import KernelPolicy
    from tscompile.piece_compiler import applied_kernel_policy, cuda_device_name

    paths = applied_kernel_policy(policy or KernelPolicy(), cuda_device_name())
    if paths["decode_gemv"]:  # which projections left cuBLAS, at which launches
        paths["decode_gemv_configs"] = {f"{n}x{k}": list(c) for (n, k), c in triton_gemv.DECODE_GEMV_CONFIGS.items()}
        # what a coordinate-descent-tuned bs=1 graph puts back in place of Inductor's reductions
        paths["decode_tuned_matmuls"] = {f"{n}x{k}": c for (n, k), c in triton_gemv.DECODE_TUNED_MATMULS.items()}
    if paths["batch_gemv"]:
        paths["batch_gemv_configs"] = {f"{m}x{n}x{k}": list(c)
                                       for (m, n, k), c in triton_gemv.BATCH_GEMV_CONFIGS.items()}
    return paths


def environment(device: torch.device) -> dict:
    """Versions and hardware every result JSON carries."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001  (absent or broken: report, do not fail)
        triton_version = None
    env = {
        "torch_version": torch.__version__,
        "triton_version": triton_version,
        "cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "cpu_name": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "gpu_name": None,
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
        "source_tree": source_tree(),
        "kernel_paths": kernel_paths(),
    }
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu_name"] = props.name
        env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    return env
